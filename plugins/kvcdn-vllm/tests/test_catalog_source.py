"""The scheduler side without vLLM: matching against artifacts, a source whose backend declares
``local_path`` read in place, and an S3 source (moto's server on 127.0.0.1, real boto3) mirrored
locally and published back."""

from __future__ import annotations

import shutil
import socket
import types

import pytest
import torch
from kvcdn_vllm.catalog import Catalog, ModelShape
from kvcdn_vllm.source import Source

import kvcdn_core
from kvcdn_core import LayerEntry, LocalStorage, StorageBackend, artifact
from kvcdn_core.runtime import model_manifest

FINGERPRINT = {
    "architecture": "LlamaForCausalLM",
    "config_sha256": "c" * 64,
    "tokenizer_sha256": "t" * 64,
    "weights_sha256": None,
}
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_size=4)
BUCKET = "kvcdn-vllm-test"


def write(path, ids, fingerprint=FINGERPRINT, heads=2):
    layers, tensors = [], {}
    for i in range(SHAPE.num_layers):
        layers.append(LayerEntry(i, artifact.FULL_ATTENTION, {"key": f"layers.{i}.key", "value": f"layers.{i}.value"}))
        tensors[f"layers.{i}.key"] = torch.randn(1, heads, len(ids), SHAPE.head_size)
        tensors[f"layers.{i}.value"] = torch.randn(1, heads, len(ids), SHAPE.head_size)
    tensors[artifact.TOKEN_IDS] = torch.tensor(ids)
    manifest = model_manifest("m", None, "llama", fingerprint, "float32", layers, None)
    return artifact.write_artifact(path, manifest, tensors)


def catalog(directory, warnings):
    return Catalog(directory, FINGERPRINT, SHAPE, warnings.append)


def test_best_match_is_block_aligned_and_never_the_whole_prompt(tmp_path):
    write(tmp_path / "a.kv", list(range(100)))
    warnings = []
    cat = catalog(tmp_path, warnings)
    hit = cat.best(list(range(100)) + [7, 8], block_size=16, min_tokens=16)
    assert hit.tokens == 96 and hit.path == str(tmp_path / "a.kv")
    assert cat.best(list(range(40)), block_size=16, min_tokens=16).tokens == 32  # one below the prompt: 39 → 32
    assert cat.best(list(range(40)), block_size=16, min_tokens=48) is None
    assert cat.best([5, 6, 7] * 20, block_size=16, min_tokens=16) is None
    assert cat.holds(list(range(50))) and not cat.holds(list(range(101)))
    assert warnings == []


def test_bad_artifacts_are_skipped_with_one_warning_each_and_the_next_best_wins(tmp_path):
    good = write(tmp_path / "b-good.kv", list(range(64)))
    shutil.copy(good, tmp_path / "a-corrupt.kv")
    with open(tmp_path / "a-corrupt.kv", "r+b") as fh:
        fh.seek(-10, 2)
        fh.write(b"\xff" * 4)
    write(tmp_path / "a-foreign.kv", list(range(64)), {**FINGERPRINT, "config_sha256": "d" * 64})
    write(tmp_path / "a-shape.kv", list(range(64)), heads=3)
    (tmp_path / "a-junk.kv").write_bytes(b"not an artifact")
    warnings = []
    cat = catalog(tmp_path, warnings)
    for _ in range(3):
        assert cat.best(list(range(64)) + [1], block_size=16, min_tokens=16).path == str(good)
    assert len(warnings) == 4, warnings
    for name, why in (
        ("a-corrupt", "blake3 mismatch"),
        ("a-foreign", "another model"),
        ("a-shape", "the engine needs"),
        ("a-junk", "not a kvcdn artifact"),
    ):
        assert [w for w in warnings if name in w and why in w], (name, warnings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint():
    pytest.importorskip("kvcdn_storage_s3")
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_s3_source_is_mirrored_searched_and_published(moto_endpoint, tmp_path, monkeypatch):
    from kvcdn_storage_s3 import S3Storage

    for name, value in {
        "KVCDN_S3_ENDPOINT_URL": moto_endpoint,
        "KVCDN_S3_REGION": "us-east-1",
        "KVCDN_S3_ACCESS_KEY_ID": "testing",
        "KVCDN_S3_SECRET_ACCESS_KEY": "testing",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }.items():
        monkeypatch.setenv(name, value)
    S3Storage(BUCKET).client.create_bucket(Bucket=BUCKET)
    remote = S3Storage.from_uri(f"s3://{BUCKET}/team/")
    remote.put_file("docs/a.kv", write(tmp_path / "a.kv", list(range(80))))
    source = Source(f"s3://{BUCKET}/team/")
    assert source.directory.is_relative_to(tmp_path / "cache")
    source.sync()
    mirrored = source.directory / "docs" / "a.kv"
    assert mirrored.read_bytes() == (tmp_path / "a.kv").read_bytes()
    assert catalog(source.directory, []).best(list(range(80)) + [3], 16, 16).path == str(mirrored)
    # An artifact saved into the mirror is uploaded under the same key.
    saved = write(source.directory / "vllm-x.kv", list(range(20)))
    source.publish(saved)
    assert remote.size_of("vllm-x.kv") == saved.stat().st_size


class _Directory(StorageBackend):
    """A third-party backend over a directory (not a LocalStorage: it holds one)."""

    schemes = ("thirdparty",)

    def __init__(self, root):
        self.files = LocalStorage(root)

    @classmethod
    def from_uri(cls, uri):
        return cls(uri.split("://", 1)[1])

    def put_file(self, key, source):
        self.files.put_file(key, source)

    def get_file(self, key, target):
        self.files.get_file(key, target)

    def delete(self, key):
        self.files.delete(key)

    def list(self, prefix=""):
        return self.files.list(prefix)


class _DeclaresLocalPath(_Directory):
    """Its objects are files on this machine, and it says so."""

    capabilities = frozenset({"local_path"})

    def path_of(self, key):
        return self.files.path_of(key)


class _LocalButUndeclared(LocalStorage):
    """A LocalStorage subclass that declares no capability: it is a remote store to its callers."""

    schemes = ("undeclared",)
    capabilities = frozenset()

    @classmethod
    def from_uri(cls, uri):
        return cls(uri.split("://", 1)[1])


@pytest.fixture
def storage_plugin(kvcdn_host):
    kvcdn_host.register(
        types.SimpleNamespace(
            kvcdn_register_storage_backends=kvcdn_core.hookimpl(lambda: [_DeclaresLocalPath, _LocalButUndeclared])
        ),
        "thirdparty-storage",
        "kvcdn.storage",
    )


@pytest.mark.parametrize("scheme", ["thirdparty://", "file://", ""])
def test_a_declared_local_path_is_read_in_place(storage_plugin, scheme, tmp_path, monkeypatch):
    """Any backend declaring local_path (a plugin's or LocalStorage) is searched where its files are."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "objects"
    stored = write(root / "docs" / "a.kv", list(range(80)))
    source = Source(f"{scheme}{root}")
    assert source.directory == root and source.storage is None
    source.sync(force=True)
    assert not (tmp_path / "cache").exists()  # nothing mirrored
    assert catalog(source.directory, []).best(list(range(80)) + [3], 16, 16).path == str(stored)
    # An artifact saved into the directory is the object itself: publishing uploads nothing.
    saved = write(source.directory / "vllm-x.kv", list(range(20)))
    source.publish(saved)
    assert [o.key for o in kvcdn_core.open_storage(f"{scheme}{root}").list("")] == ["docs/a.kv", "vllm-x.kv"]


def test_an_undeclared_backend_is_mirrored_even_over_local_files(storage_plugin, tmp_path, monkeypatch):
    """Capabilities are declared, not inferred from the class: no local_path means a mirror."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "objects"
    write(root / "a.kv", list(range(40)))
    source = Source(f"undeclared://{root}")
    assert source.directory.is_relative_to(tmp_path / "cache") and source.storage is not None
    source.sync(force=True)
    assert (source.directory / "a.kv").read_bytes() == (root / "a.kv").read_bytes()
