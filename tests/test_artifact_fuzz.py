"""Fuzzing the `.kv` parser: structured mutations of a valid file, and random bytes.

Whatever the input, reading it ends in a :class:`Header` or an :class:`ArtifactError` (never another
exception), what the read allocates stays bounded, and a file that is accepted can be used: its
token ids read, its hashes checked, and ``kvcdn inspect`` renders it (exit 0, 1 or 2, no traceback).
"""

from __future__ import annotations

import json
import struct
import tempfile
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn_core import artifact
from kvcdn_core.errors import ArtifactError
from tests.support import kvfiles

#: stands for a deeply nested array, spliced into the JSON text (json.dumps cannot write one)
DEEP = "@@deep@@"
#: the inputs are at most a few hundred KiB; a read may take a few times that
PEAK_LIMIT = 8 << 20
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow], database=None)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(
        [
            "F32",
            "I64",
            "U8",
            "float32",
            "float64",
            "full_attention",
            "sliding_window",
            "token_ids",
            "layers.0.key",
            "",
            "1",
            "kvcdn-kv",
        ]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _containers(value, path=()):
    """Every (path, container) in a JSON tree, the root first."""
    if isinstance(value, (dict, list)):
        yield path, value
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from _containers(child, (*path, key))


@st.composite
def mutated_files(draw) -> bytes:
    """A valid file with up to three structural mutations, then maybe a few raw-byte ones (none at all
    keeps the accepted path in reach)."""
    parts = kvfiles.valid_parts()
    nested = "[" * (depth := draw(st.sampled_from([10, 31, 33, 1000, 60_000]))) + "]" * depth
    for _ in range(draw(st.integers(0, 3))):
        tree = {"entries": parts.entries, "metadata": parts.metadata, "manifest": parts.manifest}
        _, container = draw(st.sampled_from(list(_containers(tree))[1:]))
        op = draw(st.sampled_from(["replace", "delete", "insert", "deep", "number"]))
        keys = list(container) if isinstance(container, dict) else list(range(len(container)))
        if op == "insert" or not keys:
            if isinstance(container, dict):
                container[draw(st.text(max_size=6))] = draw(json_values)
            else:
                container.append(draw(json_values))
            continue
        key = draw(st.sampled_from(keys))
        if op == "delete":
            del container[key]
        elif op == "deep":
            container[key] = DEEP  # replaced by `nested` in the serialized text
        elif op == "number":
            container[key] = draw(st.sampled_from([-1, 0, 1, 2**63, 2**64 + 1, 1.5, True, 10**30]))
        else:
            container[key] = draw(json_values)
    if draw(st.booleans()):
        parts.data = parts.data[: draw(st.integers(0, len(parts.data)))] + draw(st.binary(max_size=16))
    manifest_text = json.dumps(parts.manifest).replace(f'"{DEEP}"', nested)
    if draw(st.integers(0, 9)) == 0:
        manifest_text = draw(st.sampled_from(["", "[", "{}", "null", '{"a": NaN}', "[" * 5000 + "]" * 5000]))
    meta = {**parts.metadata, artifact.META_MANIFEST: manifest_text}
    header_text = json.dumps({"__metadata__": meta, **parts.entries}).replace(f'"{DEEP}"', nested)
    data = bytearray(parts.to_bytes(header_text=header_text))
    for _ in range(draw(st.integers(0, 2))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


random_files = st.binary(max_size=512) | st.builds(
    lambda n, body: struct.pack("<Q", n) + body,
    st.integers(0, 600) | st.integers(0, 2**64 - 1),
    st.binary(max_size=512),
)


def _header_and_peak(path: Path):
    """``read_header(path)`` (None for an ArtifactError, which must be one line) and the peak of
    Python memory allocated meanwhile."""
    tracemalloc.start()
    try:
        header = artifact.read_header(path)
    except ArtifactError as exc:
        assert "\n" not in str(exc)
        header = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return header, peak


def _read(data: bytes, cli=None):
    """Read ``data`` as an artifact the ways every reader does; only ArtifactError may escape."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.kv"
        path.write_bytes(data)
        header, peak = _header_and_peak(path)
        if peak >= PEAK_LIMIT:
            # tracemalloc counts every thread of the process, and a thread an earlier test of this
            # worker left running once allocated 10 MiB inside the window (CI; the same bytes read
            # again took 0.7 MiB). The reader's own allocations repeat on the same bytes.
            header, peak = _header_and_peak(path)
        assert peak < PEAK_LIMIT, f"reading {len(data)} bytes took {peak >> 20} MiB, twice"
        if header is None:
            return
        try:
            artifact.read_token_ids(path, header)
            artifact.check_file(path)
        except ArtifactError:
            pass
        if cli is not None:
            result = cli("inspect", "--check", path)
            assert result.exit_code in (0, 1, 2), result.output


@FUZZ
@given(data=mutated_files())
def test_mutated_headers_give_a_header_or_an_artifact_error(data):
    _read(data)


@FUZZ
@given(data=random_files)
def test_random_bytes_give_an_artifact_error(data):
    _read(data)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=mutated_files())
def test_inspect_never_crashes_on_a_mutated_file(data):
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli

    runner = CliRunner()
    _read(data, cli=lambda *args: runner.invoke(make_cli(), [str(a) for a in args], catch_exceptions=False))


def test_the_fuzzer_reaches_files_that_are_accepted():
    """The structured mutations keep enough files valid that the accepted path is exercised too."""
    accepted = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(data=mutated_files())
    def count(data):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "x.kv"
            path.write_bytes(data)
            try:
                artifact.read_header(path)
                accepted.append(1)
            except ArtifactError:
                pass

    count()
    assert len(accepted) >= 5, f"only {len(accepted)} mutated file(s) accepted: the fuzzer tests only the refusal paths"
