"""The artifact record's parser: a record is outside input (any writer of the store), so whatever
the bytes, parsing ends in a record that rebuilds its file or in one-line :class:`ArtifactError`."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.errors import ArtifactError
from kvcdn_core.store.chunkstore import ChunkStore
from kvcdn_core.store.record import ArtifactRecord
from tests.support.storefiles import write_kinds

FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], database=None)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["any_prefix", "whole_prefix", "kvcdn-chunked", "layers.0.key", "0" * 64, "", 256, 1])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid record (JSON) of a 300-token artifact: two chunks and a tail."""
    tmp = tmp_path_factory.mktemp("rec")
    write_kinds(tmp / "a.kv", ["full_attention"], 300)
    store = ChunkStore(LocalStorage(tmp / "store"))
    store.put(tmp / "a.kv", "a")
    return json.loads(store.backend.read_bytes("artifacts/a.json"))


@pytest.fixture(scope="module")
def pieced(tmp_path_factory):
    """A valid version 2 record: a 400-token artifact continuing a 300-token one, whose second
    chunk is the first artifact's partial chunk (tokens 256-300) as a piece, then its own piece."""
    tmp = tmp_path_factory.mktemp("rec")
    tensors = write_kinds(tmp / "a.kv", ["full_attention", "mla_latent"], 300, seed=1)
    write_kinds(tmp / "b.kv", ["full_attention", "mla_latent"], 400, seed=2, prefix_of=tensors)
    store = ChunkStore(LocalStorage(tmp / "store"))
    store.put(tmp / "a.kv", "a")
    store.put(tmp / "b.kv", "b")
    doc = json.loads(store.backend.read_bytes("artifacts/b.json"))
    assert doc["version"] == 2 and [p["tokens"] for p in doc["chunks"][1]["pieces"]] == [44, 100]
    return doc


def _containers(value, path=()):
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _containers(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _containers(v, (*path, i))


def _parse(data: bytes):
    try:
        record = ArtifactRecord.from_json(data)
    except ArtifactError as exc:
        assert "\n" not in str(exc)
        return None
    # accepted: it must be consistent enough to rebuild from and to serialize again
    assert ArtifactRecord.from_json(record.to_json()) == record
    record.parsed_header()
    return record


def test_the_valid_record_parses_and_round_trips(valid):
    record = _parse(json.dumps(valid).encode())
    assert record is not None and len(record.chunks) == 2 and record.tail is not None


@FUZZ
@given(data=st.data())
def test_structured_mutations_never_crash(valid, data):
    doc = json.loads(json.dumps(valid))
    spots = [(p, c) for p, c in _containers(doc) if isinstance(c, (dict, list)) and p[:1] != ("header",)]
    for _ in range(data.draw(st.integers(1, 3))):
        path, container = data.draw(st.sampled_from(spots))
        if isinstance(container, dict) and container:
            key = data.draw(st.sampled_from(sorted(container)) | st.text(max_size=6))
            if data.draw(st.booleans()):
                container[key] = data.draw(json_values)
            else:
                container.pop(key, None)
        elif isinstance(container, list) and container:
            i = data.draw(st.integers(0, len(container) - 1))
            container[i] = data.draw(json_values)
    _parse(json.dumps(doc).encode())


@pytest.mark.parametrize("name", ["\n", "a\r\nb", "layers.9.key\n"])
def test_a_chunked_tensor_name_with_a_line_break_is_refused_in_one_line(valid, name):
    doc = json.loads(json.dumps(valid))
    doc["chunked"][0] = name  # found by the fuzzer above: the name was echoed as it was
    assert _parse(json.dumps(doc).encode()) is None


def test_the_pieced_record_parses_and_round_trips(pieced, valid):
    record = _parse(json.dumps(pieced).encode())
    assert record is not None and record.version == 2 and record.chunks[1].digest is None
    assert [p.tokens for p in record.chunks[1].parts] == [44, 100]
    assert _parse(json.dumps(valid).encode()).version == 1  # a record without pieces stays version 1


@FUZZ
@given(data=st.data())
def test_structured_mutations_of_a_pieced_record_never_crash(pieced, data):
    test_structured_mutations_never_crash.hypothesis.inner_test(pieced, data)


@FUZZ
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 255), at=st.integers(0, 10_000))
def test_byte_damage_never_crashes(valid, cut, flip, at):
    raw = bytearray(json.dumps(valid).encode())
    at %= len(raw)
    raw[at] ^= flip
    _parse(bytes(raw[: len(raw) - cut % len(raw)]))


@FUZZ
@given(header_edit=st.sampled_from(['"F32"', '"I64"', "300", "299", "[0,", "kvcdn-kv", "  "]), at=st.integers(0, 10**6))
def test_a_damaged_header_is_refused_or_consistent(valid, header_edit, at):
    doc = dict(valid)
    header = doc["header"]
    at %= len(header)
    doc["header"] = header[:at] + header_edit + header[at + len(header_edit) :]
    _parse(json.dumps(doc).encode())


@FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes_are_refused(data):
    assert _parse(data) is None


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(version=3), "record version 3 is not one this kvcdn reads"),
        (lambda d: d.update(extra=1), "unknown field 'extra'"),
        (lambda d: d.pop("tail"), "lacks tail"),
        (lambda d: d.update(name="../x"), "name is not a valid artifact name"),
        (lambda d: d["chunks"][0].update(digest="X" * 64), "chunk 0 is not"),
        (lambda d: d["chunks"][0].update(bytes=1), "a chunk's size is not its tokens' bytes"),
        (lambda d: d.update(size=d["size"] + 8), "truncated|trailing|tail is not"),
        (lambda d: d["tail"].update(bytes=d["tail"]["bytes"] - 1), "tail is not the"),
        (lambda d: d.update(chunked=["token_ids"]), "is not a \\[..., tokens, inner\\] tensor"),
        (lambda d: d.update(token_count=True), "token_count is not"),
    ],
)
def test_refusals_name_the_problem(valid, change, message):
    doc = json.loads(json.dumps(valid))
    change(doc)
    with pytest.raises(ArtifactError, match=message):
        ArtifactRecord.from_json(json.dumps(doc).encode(), "record 'a'")


def _piece(d, i, **change):
    d["chunks"][1]["pieces"][i].update(change)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(version=1), "chunk 1 is not"),  # version 1 has no pieces
        (lambda d: _piece(d, 0, tokens=43), "chunk 1's pieces do not tile its tokens"),
        (lambda d: _piece(d, 0, tokens=0), "chunk 1's pieces are not"),
        (lambda d: _piece(d, 1, bytes=1), "a piece's size is not its tokens' bytes"),
        (lambda d: _piece(d, 1, digest="x"), "chunk 1's pieces are not"),
        (lambda d: d["chunks"][1]["pieces"].pop(), "chunk 1's pieces are not a list of two or more"),
        (lambda d: d["chunks"][1].update(digest="0" * 64), "chunk 1 is not"),
        (lambda d: _piece(d, 1, tokens=101), "do not tile|a piece's size"),
    ],
)
def test_pieced_refusals_name_the_problem(pieced, change, message):
    doc = json.loads(json.dumps(pieced))
    change(doc)
    with pytest.raises(ArtifactError, match=message):
        ArtifactRecord.from_json(json.dumps(doc).encode(), "record 'b'")


def test_the_header_checked_on_parse_is_kept_and_a_stored_record_reads_back_without_it(valid, monkeypatch):
    """:meth:`ArtifactRecord.from_json` keeps the header it parsed to check the record: the engine's
    scheduler asks a grant's record for it twice per request, which parsed it twice more. A record
    built otherwise parses it once, on first use. :meth:`ArtifactRecord.from_checked` reads back
    what :meth:`ArtifactRecord.to_json` wrote (the hosted server's own rows) without the header
    check, and is the same record."""
    from kvcdn_core import artifact

    record = ArtifactRecord.from_json(json.dumps(valid).encode(), "a chunk grant")
    parsed: list[object] = []
    real = artifact.parse_header
    monkeypatch.setattr(artifact, "parse_header", lambda *a: parsed.append(a[0]) or real(*a))
    header = record.parsed_header()
    assert parsed == [] and record.parsed_header() is header
    assert header.path == f"record '{record.name}'"  # named as before, not as the parse's caller
    assert header == real(f"record '{record.name}'", record.header.encode(), record.size)
    again = ArtifactRecord.from_checked(record.to_json().decode())
    assert again == record and parsed == []
    assert again.parsed_header() == header and again.parsed_header() is again.parsed_header()
    assert parsed == [f"record '{record.name}'"]
    with pytest.raises(ArtifactError, match="corrupted"):
        ArtifactRecord.from_checked('{"format": "kvcdn-chunked"')
