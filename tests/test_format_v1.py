"""Artifacts of format version 1 (SHA-256 digests, written before BLAKE3) still read, verify and
continue exactly; a digest under the other format's key is refused in one line."""

from __future__ import annotations

import pytest

from kvcdn_core import artifact, runtime
from kvcdn_core.errors import ArtifactError
from tests.support import kvfiles

QUESTION = " And then?"


@pytest.fixture(scope="module")
def qwen3_session(qwen3_dir):
    return runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def both(qwen3_artifact, tmp_path_factory):
    """The same cache as a format 2 file (as written today) and as a format 1 file."""
    old = tmp_path_factory.mktemp("v1") / "ctx.kv"
    old.write_bytes(kvfiles.as_format_1(qwen3_artifact.read_bytes()))
    return qwen3_artifact, old


def test_a_format_1_file_reads_with_sha256_digests(both):
    new, old = both
    header = artifact.read_header(old)
    assert (header.format_version, header.digest) == (1, "sha256")
    assert artifact.read_header(new).digest == "blake3"
    assert artifact.check_hashes(header) == []
    assert artifact.read_token_ids(old) == artifact.read_token_ids(new)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_format_1_file_continues_like_the_format_2_file(qwen3_session, both, stream):
    new, old = both
    question = qwen3_session.adapter.encode_continuation(qwen3_session.tokenizer, QUESTION)
    runs = []
    for path in (new, old):
        cache, _ = runtime.load_cache(qwen3_session, artifact.read_header(path), stream=stream)
        runs.append(runtime.greedy(qwen3_session, cache, question, 8))
    (tokens_new, logits_new), (tokens_old, logits_old) = runs
    assert tokens_old == tokens_new
    assert all(a.equal(b) for a, b in zip(logits_new, logits_old))


def test_a_corrupted_format_1_file_fails_its_sha256(both, tmp_path):
    _, old = both
    data = bytearray(old.read_bytes())
    data[-64] ^= 0x10  # inside the last layer's value tensor (the token ids come first in the file)
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        artifact.check_file(bad)


@pytest.mark.parametrize("version,key", [("1", "blake3"), ("2", "sha256")])
def test_a_digest_under_the_other_formats_key_is_refused(tmp_path, version, key):
    parts = kvfiles.valid_parts()
    parts.metadata[artifact.META_VERSION] = version
    for spec in parts.manifest["tensors"].values():
        spec[key] = spec.pop(kvfiles.DIGEST)
    path = tmp_path / "swapped.kv"
    path.write_bytes(parts.to_bytes())
    wanted = "sha256" if version == "1" else "blake3"
    with pytest.raises(ArtifactError, match=f"lacks a {wanted} digest \\(format version {version}\\)"):
        artifact.read_header(path)


def test_inspect_names_the_files_format_and_digest(cli, both):
    new, old = both
    for path, line in ((new, "v2 (blake3 digests)"), (old, "v1 (sha256 digests)")):
        result = cli("inspect", path, "--check")
        assert result.exit_code == 0, result.stderr
        assert line in result.stdout
