"""Issue 26, the smaller items: one text rule (kvcdn_core.text) for every string people give the
server and it shows back (artifact names, manifest labels, listing prefixes, declared manifest
facts), names unique after NFC normalisation, and the rule fuzzed with hypothesis."""

from __future__ import annotations

import unicodedata

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core.text import BLANK, is_printable_text, text_problem
from kvcdn_server.errors import ApiError
from kvcdn_server.validation import check_name
from tests.support import kvfiles
from tests.support.hosted import API, bearer, confirm, put_bytes, request_upload

#: what the audit found accepted, as names or labels
AUDIT_CHARACTERS = ["\u061c", "\u2028", "\ue000", "\u180e", "\u2060", "\u3164", "\u2800"]
REFUSED_NAMES = [
    *[f"a{ch}b.kv" for ch in AUDIT_CHARACTERS],
    "\u3164",  # a Hangul filler alone
    "\u2800.kv",  # the Braille blank
    "\u0301\u0302\u0303",  # only combining marks
    "\u0301abc.kv",  # a combining mark first
    "\uff0e\uff0e/x",  # fullwidth dots: '../x' once NFKC-folded
    "a/\uff0e/b",  # a fullwidth '.' part
    "a\u2025b",  # the two-dot leader reads as '..'
    "\uff0fetc/passwd",  # a fullwidth solidus first
    "a\uff3cb",  # a fullwidth backslash
    "a\u00a0b.kv",  # a no-break space
    "a\ufe0fb.kv",  # a variation selector
]


@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_the_name_rule_refuses_what_the_audit_found(name):
    with pytest.raises(ApiError) as refused:
        check_name(name)
    assert refused.value.status == 422 and refused.value.code == "invalid_name"
    assert "\n" not in refused.value.message


def test_the_server_refuses_those_names_with_422(local_server, org_key, small_kv):
    key = org_key("names")
    for name in REFUSED_NAMES:
        r = request_upload(local_server.url, key, small_kv, name=name)
        assert r.status_code == 422 and r.json()["error"] == "invalid_name", (name, r.text)
    assert httpx.get(f"{local_server.url}{API}/quota", headers=bearer(key)).json()["usage"]["pending_artifacts"] == 0


def test_labels_that_names_refuse_are_refused_at_confirm_and_never_listed(local_server, org_key, tmp_path):
    key = org_key("labels")
    for case in sorted(kvfiles.LABEL_CASES):
        path = tmp_path / f"{case}.kv"
        path.write_bytes(kvfiles.HOSTILE[case]())
        r = request_upload(local_server.url, key, path, name="labelled.kv")
        assert r.status_code == 200, r.text
        put_bytes(r.json(), path.read_bytes())
        done = confirm(local_server.url, key, r.json()["artifact_id"])
        assert done.status_code == 422 and done.json()["error"] == "not_a_kv_artifact", (case, done.text)
    assert httpx.get(f"{local_server.url}{API}/artifacts", headers=bearer(key)).json()["artifacts"] == []


def test_declared_manifest_facts_keep_the_rule(local_server, org_key, small_kv):
    key = org_key("hints")
    r = request_upload(local_server.url, key, small_kv, manifest={"model_id": "qwen\u2028evil"})
    assert r.status_code == 422 and r.json()["message"].startswith("manifest.model_id: must"), r.text


def test_nfc_and_nfd_spellings_are_one_name_and_the_prefix_is_normalised(local_server, org_key, small_kv):
    key = org_key("nfd")
    composed, decomposed = "caf\u00e9/doc.kv", "cafe\u0301/doc.kv"
    ids = []
    for spelling in (decomposed, composed):
        r = request_upload(local_server.url, key, small_kv, name=spelling)
        assert r.status_code == 200, r.text
        put_bytes(r.json(), small_kv.read_bytes())
        # replace: the tenant's other artifacts of this name go, as the storage backend's put does
        done = confirm(local_server.url, key, r.json()["artifact_id"], {"replace": True})
        assert done.status_code == 200 and done.json()["name"] == composed, done.text
        ids.append(done.json()["artifact_id"])
    for prefix in ("cafe\u0301/", "caf\u00e9/", ""):
        listing = httpx.get(f"{local_server.url}{API}/artifacts", params={"prefix": prefix}, headers=bearer(key))
        assert listing.status_code == 200, listing.text
        assert [(a["artifact_id"], a["name"]) for a in listing.json()["artifacts"]] == [(ids[1], composed)], prefix


@pytest.mark.parametrize("prefix", ["a\u202e", "\u2060", "x\u3164"])
def test_a_prefix_filter_keeps_the_rule(local_server, org_key, prefix):
    r = httpx.get(f"{local_server.url}{API}/artifacts", params={"prefix": prefix}, headers=bearer(org_key("p")))
    assert r.status_code == 422 and r.json()["message"].startswith("prefix: must"), r.text


# -- the rule fuzzed ----------------------------------------------------------------------------

FUZZ = settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
#: any code point (surrogates included), with the audit's and the rule's own characters made common
ANY_CHAR = st.one_of(
    st.characters(exclude_categories=[]),
    st.sampled_from([*AUDIT_CHARACTERS, *sorted(BLANK)[:20], "/", ".", "\uff0e", "\\", " ", "\u0301", "e", "\u00e9"]),
)
TEXT = st.text(ANY_CHAR, max_size=12)


def _name_or_none(value: str) -> str | None:
    try:
        return check_name(value)
    except ApiError as exc:
        assert exc.status == 422 and exc.code == "invalid_name" and "\n" not in exc.message
        return None


@FUZZ
@given(TEXT)
def test_what_the_rule_accepts_prints_as_itself(value):
    """Accepted text is printable (Python's own test: no Cc/Cf/Cs/Co/Cn/Zl/Zp, no space but ' '),
    draws something in every character, and never starts with a combining mark."""
    if is_printable_text(value):
        assert value.isprintable()
        assert not BLANK.intersection(value)
        assert not value or not unicodedata.category(value[0]).startswith("M")
    else:
        assert "\n" not in text_problem(value)


@FUZZ
@given(TEXT)
def test_names_are_one_per_nfc_form_and_never_a_path_that_climbs(value):
    name = _name_or_none(value)
    # Composed and decomposed spellings are one name, or refused alike.
    assert _name_or_none(unicodedata.normalize("NFD", value)) == name
    if name is None:
        return
    assert name == unicodedata.normalize("NFC", name) and check_name(name) == name
    assert is_printable_text(name)  # names keep the rule labels keep
    folded = unicodedata.normalize("NFKC", name)
    assert "\\" not in folded and ".." not in folded
    assert all(part not in ("", ".") for part in folded.split("/"))


@FUZZ
@given(TEXT.filter(lambda v: v.strip() == v and v and not ({"/", "\\"} & set(v)) and "." not in v))
def test_names_and_labels_follow_one_rule(value):
    """Apart from the path rules, a name is accepted exactly when it is a valid label."""
    from kvcdn_core.text import nfc

    if any(c in unicodedata.normalize("NFKC", value) for c in "./\\") or nfc(value).strip() != nfc(value):
        return  # a look-alike of a path character: the name's own rule
    assert (_name_or_none(value) is not None) == is_printable_text(nfc(value)) == is_printable_text(value)


@FUZZ
@given(TEXT)
def test_prefix_filters_are_normalised_like_names(value):
    from kvcdn_server.validation import check_prefix_filter

    try:
        prefix = check_prefix_filter(value)
    except ApiError as exc:
        assert exc.status == 422 and not is_printable_text(value)
        return
    assert prefix == unicodedata.normalize("NFC", value)
    name = _name_or_none(value + "x.kv")
    assert name is None or name.startswith(prefix)  # a name the prefix spells lists under it


def test_ascii_text_is_judged_at_c_speed_exactly_as_character_by_character():
    """An ASCII string without controls keeps the rule without the per-character loop (every manifest
    label of every header parse went through it). Each ASCII string of up to two characters is
    judged as the loop judges it: followed by a letter outside ASCII (which the rule accepts, and
    which takes the loop), the verdict and its reason are the same."""
    chars = [chr(c) for c in range(128)]
    for value in ["", *chars, *(a + b for a in chars for b in chars)]:
        assert text_problem(value) == text_problem(value + "\u00e9"), repr(value)
    assert text_problem("layers.0.key") is None and text_problem("a\x7fb") is not None
