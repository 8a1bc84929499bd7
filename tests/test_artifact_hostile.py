"""Hostile `.kv` files (issue 13): every reader refuses them with one ArtifactError line, cheaply."""

from __future__ import annotations

import tracemalloc

import pytest

from kvcdn_core import artifact
from kvcdn_core.errors import ArtifactError
from tests.support import kvfiles

#: what reading any hostile header may allocate (the biggest case is 7 MiB of padding)
PEAK_LIMIT = 48 << 20


def test_the_valid_file_passes_every_check(tmp_path):
    path = tmp_path / "ok.kv"
    path.write_bytes(kvfiles.valid_bytes())
    header = artifact.check_file(path)
    assert header.token_count == kvfiles.TOKENS
    assert artifact.read_token_ids(path) == [100, 101, 102, 103]


@pytest.mark.parametrize("case", sorted(kvfiles.HOSTILE))
def test_hostile_files_are_refused_with_one_line_and_bounded_memory(tmp_path, case):
    path = tmp_path / f"{case}.kv"
    path.write_bytes(kvfiles.HOSTILE[case]())
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError) as caught:
            artifact.read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert peak < PEAK_LIMIT, f"{case}: parsing took {peak >> 20} MiB"


def test_padding_and_nesting_are_refused_by_the_limits_not_by_the_parser(tmp_path):
    cases = {
        "metadata_20mib_padding": "over the 8 MiB limit",
        "metadata_padding_under_the_cap": "more than 200000 JSON tokens",
        "manifest_50k_deep": "nests deeper than 32 levels",
        "header_50k_deep": "nests deeper than 32 levels",
        "header_50k_deep_objects": "nests deeper than 32 levels",
    }
    for case, reason in cases.items():
        path = tmp_path / f"{case}.kv"
        path.write_bytes(kvfiles.HOSTILE[case]())
        with pytest.raises(ArtifactError, match=reason):
            artifact.read_header(path)


def test_a_short_text_is_refused_for_depth_exactly_when_the_token_scan_would():
    """A text too short to pass the token limit (every header of a real cache) is scanned for depth
    by C-level passes (escapes dropped, split at quotes, brackets summed) in place of a Python loop
    over every token, the largest part of parsing a header, which a lookup's grant does. For JSON
    the parser accepts, it refuses exactly what the token scan refuses: brackets, escaped quotes and
    backslashes inside strings, nesting just under and over the limit. Any other text the token
    scan refuses is refused too (by the scan or by the parser), and nothing it refuses is parsed."""
    import json
    import random

    def deepest(text: str) -> int:  # the token scan longer texts keep
        depth = most = 0
        for match in artifact._JSON_TOKEN.finditer(text):
            char = match.group()
            if char in "[{":
                depth += 1
                most = max(most, depth)
            elif char in "]}":
                depth -= 1
        return most

    def verdict(text: str) -> str:
        try:
            artifact._parse_json("t", text, "header")
            return "parsed"
        except ArtifactError as exc:
            return "deep" if "nests deeper than" in str(exc) else "refused"

    rng = random.Random(0)
    tricky = ["a", "[", "]}", "{", '"', "\\", '\\"', '"[{', "\\\\", "\u005c", "x y"]

    def leaf() -> str:
        return "".join(rng.choice(tricky) for _ in range(rng.randrange(4)))

    def value(depth: int):  # one branch nests ``depth`` levels, the others are strings
        if depth == 0:
            return leaf()
        if rng.random() < 0.5:
            return [leaf(), value(depth - 1), leaf()][rng.randrange(2) :]
        return {leaf() + "k": value(depth - 1), leaf(): leaf()}

    valid = [json.dumps(value(rng.randrange(28, 38))) for _ in range(600)]
    valid += [json.dumps(json.loads("[" * n + "]" * n)) for n in (31, 32, 33, 34)]
    deep = 0
    for text in valid:
        expected = "deep" if deepest(text) > artifact.MAX_JSON_DEPTH else "parsed"
        assert verdict(text) == expected, text
        deep += expected == "deep"
    assert 50 < deep < len(valid) - 50  # both sides of the limit were tried
    pieces = ["[", "]", "{", "}", '"', "\\", '\\"', '"a[{"', '"]}\\""', "a", ",", ":", "1", " "]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) if rng.random() < 0.3 else "[{"[rng.randrange(2)] for _ in range(50))
        text += "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 20)))
        if deepest(text) > artifact.MAX_JSON_DEPTH:
            assert verdict(text) != "parsed", text


def test_a_tensor_that_does_not_hash_to_its_manifest_fails_check_file(tmp_path):
    data = bytearray(kvfiles.valid_bytes())
    data[-40] ^= 0xFF  # inside layers.0.value
    path = tmp_path / "flipped.kv"
    path.write_bytes(bytes(data))
    artifact.read_header(path)  # the structure is intact
    with pytest.raises(ArtifactError, match="blake3 mismatch in 1 tensor.*'layers.0.value'"):
        artifact.check_file(path)


def test_negative_token_ids_are_refused(tmp_path):
    import struct

    from kvcdn_core.artifact import digests

    parts = kvfiles.valid_parts()
    start, end = parts.entries[artifact.TOKEN_IDS]["data_offsets"]
    raw = struct.pack("<4q", 1, 2, -3, 4)
    parts.data = parts.data[:start] + raw
    parts.manifest["tensors"][artifact.TOKEN_IDS][kvfiles.DIGEST] = digests.hexdigest(kvfiles.DIGEST, raw)
    path = tmp_path / "neg.kv"
    path.write_bytes(parts.to_bytes())
    artifact.read_header(path)
    for read in (artifact.read_token_ids, artifact.check_file):
        with pytest.raises(ArtifactError, match="negative token id"):
            read(path)


@pytest.mark.parametrize(
    "case",
    [
        "format_version_list",
        "manifest_50k_deep",
        "float_offsets",
        "string_shape",
        "negative_dims",
        "overlapping_offsets",
        "reversed_offsets",
        "metadata_20mib_padding",
        "lone_surrogate",
        "compute_dtype_float64",
    ],
)
def test_inspect_exits_2_with_one_line(tmp_path, run_kvcdn, case):
    path = tmp_path / f"{case}.kv"
    path.write_bytes(kvfiles.HOSTILE[case]())
    code, out, err = run_kvcdn("inspect", path)
    assert code == 2, (out, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_inspect_check_exits_1_on_a_hash_mismatch_and_0_on_a_valid_file(tmp_path, run_kvcdn):
    good = tmp_path / "good.kv"
    good.write_bytes(kvfiles.valid_bytes())
    run_kvcdn("inspect", "--check", good, check=0)
    data = bytearray(good.read_bytes())
    data[-40] ^= 0xFF
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(data))
    code, _, err = run_kvcdn("inspect", "--check", bad)
    assert code == 1 and "layers.0.value" in err
