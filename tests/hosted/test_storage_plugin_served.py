"""The storage plugin of docs/plugin-guide.md, installed as its own package, behind ``kvcdn serve``.

The SQLite backend has no presigned URLs, so the server signs its own: uploads are written through
``put_file`` and downloads stream back through ``open_read``, every byte checked by sha256.
"""

from __future__ import annotations

import hashlib
import sqlite3

import httpx

from tests.support import plugin_examples, services
from tests.support.hosted import API, bearer, mint_key, upload


def test_the_guide_sqlite_storage_serves_uploads_and_downloads(tmp_path, oidc_issuer, small_kv):
    site = tmp_path / "site"
    plugin_examples.install(plugin_examples.STORAGE, site, tmp_path / "build")
    store = tmp_path / "objects.db"
    env = {"PYTHONPATH": str(site), "KVCDN_ISSUER_URL": oidc_issuer.url}
    with services.kvcdn_server(tmp_path / "home", ["--storage", f"sqlite://{store}"], env) as server:
        key = mint_key(server.url, server.admin_secret(), "sqlite-plugin")
        art = upload(server.url, key, small_kv)
        with sqlite3.connect(store) as db:
            rows = dict(db.execute("SELECT key, length(data) FROM objects").fetchall())
        stored = [k for k in rows if art["artifact_id"] in k]
        assert len(stored) == 1 and rows[stored[0]] == small_kv.stat().st_size, rows
        grant = httpx.post(f"{server.url}{API}/artifacts/{art['artifact_id']}/download-url", headers=bearer(key))
        assert grant.status_code == 200, grant.text
        url = grant.json()["download_url"]
        assert url.startswith(server.url), url  # signed by the server: the backend has no presigned URLs
        with httpx.stream("GET", url) as response:
            assert response.status_code == 200
            digest = hashlib.sha256()
            for chunk in response.iter_bytes():
                digest.update(chunk)
        assert digest.hexdigest() == art["sha256"] == hashlib.sha256(small_kv.read_bytes()).hexdigest()
        assert httpx.delete(f"{server.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(key)).status_code == 204
        with sqlite3.connect(store) as db:
            left = [k for (k,) in db.execute("SELECT key FROM objects") if art["artifact_id"] in k]
        assert left == []
