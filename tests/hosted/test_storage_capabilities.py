"""The server reads a storage backend's declared capabilities, never its method names (issue 25, item 4).

The server used to ask ``getattr(storage, "needs_multipart")`` and ``isinstance(storage,
LocalStorage)``: a third-party backend with a helper of that name was sent down the multipart path
(and its upload failed), and one whose objects are local files was not seen as local.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvcdn_core import LocalStorage, StorageBackend
from tests.support.hosted import API, bearer, sha256_of


class _Directory(StorageBackend):
    """A third-party backend over a directory (not a LocalStorage: it holds one)."""

    schemes = ("thirdparty",)

    def __init__(self, root: Path):
        self.files = LocalStorage(root)

    def put_file(self, key, source):
        self.files.put_file(key, source)

    def get_file(self, key, target):
        self.files.get_file(key, target)

    def delete(self, key):
        self.files.delete(key)

    def list(self, prefix=""):
        return self.files.list(prefix)

    def open_read(self, key):
        return self.files.open_read(key)

    def rename(self, source_key, target_key):
        self.files.rename(source_key, target_key)


class _HelperNamedLikeMultipart(_Directory):
    """Declares no capability, but has a helper that happens to be called ``needs_multipart``."""

    def needs_multipart(self, size):
        return True  # its own business (say, how it batches writes): not the multipart capability


class _DeclaresLocalPath(_Directory):
    """Its objects are files on this machine, and it says so."""

    capabilities = frozenset({"local_path"})

    def path_of(self, key):
        return self.files.path_of(key)


@pytest.fixture
def app_over(monkeypatch, tmp_path):
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    def make(storage: StorageBackend):
        monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme")
        config = load_config(storage=str(tmp_path / "unused"), database_url=f"sqlite:///{tmp_path / 'state.db'}")
        client = TestClient(create_app(config, storage=storage))
        return client, derive_key(config.api_key_seed, "acme")

    return make


def _round_trip(client: TestClient, key: str, path: Path) -> None:
    """Upload, confirm and download ``path`` through the app, every byte checked."""
    body = {"name": "a.kv", "size_bytes": path.stat().st_size, "sha256": sha256_of(path)}
    r = client.post(f"{API}/artifacts/upload-url", headers=bearer(key), json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["multipart"] is None and plan["url"], plan
    put = client.put("/" + plan["url"].split("://", 1)[1].split("/", 1)[1], content=path.read_bytes())
    assert put.status_code == 200, put.text
    r = client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 200, r.text
    grant = client.post(f"{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key)).json()
    got = client.get("/" + grant["download_url"].split("://", 1)[1].split("/", 1)[1])
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == sha256_of(path)


def test_a_method_named_needs_multipart_is_not_the_capability(app_over, tmp_path, small_kv):
    client, key = app_over(_HelperNamedLikeMultipart(tmp_path / "objects"))
    _round_trip(client, key, small_kv)  # a server-signed URL, never start_multipart (it has none)
    assert client.get("/health").json()["storage"] == "thirdparty"


def test_a_declared_local_path_is_local_whatever_the_class(app_over, tmp_path, small_kv):
    storage = _DeclaresLocalPath(tmp_path / "objects")
    client, key = app_over(storage)
    assert client.get("/health").json()["storage"] == "local"
    _round_trip(client, key, small_kv)
    (stored,) = storage.list("artifacts/")
    assert storage.path_of(stored.key).read_bytes() == small_kv.read_bytes()
