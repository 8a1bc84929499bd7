"""The server answers what kvcdn-wire's response models declare, no more: each JSON route declares
its model (so /openapi.json documents every answer), and a whole upload-to-download round trip reads
back through the models with no field they do not name."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvcdn_wire import responses
from tests.support.hosted import API, bearer, sha256_of


@pytest.fixture
def app_client(monkeypatch, tmp_path):
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme")
    monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
    config = load_config(storage=str(tmp_path / "objects"))
    with TestClient(create_app(config)) as client:
        yield client, derive_key(config.api_key_seed, "acme"), config


def test_every_json_route_declares_its_response_model(app_client):
    client, _, _ = app_client
    models = set(responses.__all__)
    undeclared = []
    for path, operations in client.get("/openapi.json").json()["paths"].items():
        for method, operation in operations.items():
            ok = next(status for status in operation["responses"] if status.startswith("2"))
            if ok == "204" or path.startswith(f"{API}/blobs/"):
                continue  # no body, or bytes
            ref = operation["responses"][ok].get("content", {}).get("application/json", {}).get("schema", {})
            if ref.get("$ref", "").rsplit("/", 1)[-1] not in models:
                undeclared.append(f"{method.upper()} {path}")
    assert undeclared == []


def exact(model, response):
    """The body as ``model``, which must name every field the server sent."""
    assert response.status_code in (200, 201), response.text
    answer = responses.parse(model, response.json())
    assert answer.model_extra == {}, (model.__name__, answer.model_extra)
    return answer


def test_a_round_trip_reads_back_through_the_models(app_client, small_kv):
    client, key, config = app_client
    auth = bearer(key)
    body = {"name": "wire.kv", "size_bytes": small_kv.stat().st_size, "sha256": sha256_of(small_kv)}
    grant = exact(responses.UploadGrant, client.post(f"{API}/artifacts/upload-url", headers=auth, json=body))
    assert grant.url and grant.multipart is None
    put = "/" + grant.url.split("://", 1)[1].split("/", 1)[1]  # the signed URL's path and query
    assert client.put(put, content=small_kv.read_bytes(), headers=grant.headers).status_code == 200
    confirm = client.post(f"{API}/artifacts/{grant.artifact_id}/confirm-upload", headers=auth)
    record = exact(responses.ArtifactRecord, confirm)
    assert record.status == "ready" and record.manifest is not None and record.manifest.model_extra == {}
    page = exact(responses.ArtifactPage, client.get(f"{API}/artifacts", headers=auth))
    assert [a.artifact_id for a in page.artifacts] == [grant.artifact_id] and page.next_cursor is None
    assert exact(responses.ArtifactRecord, client.get(f"{API}/artifacts/{grant.artifact_id}", headers=auth)) == record
    download = client.post(f"{API}/artifacts/{grant.artifact_id}/download-url", headers=auth)
    assert exact(responses.DownloadGrant, download).sha256 == body["sha256"]
    assert exact(responses.Quota, client.get(f"{API}/quota", headers=auth)).usage.artifacts == 1
    assert exact(responses.Identity, client.get(f"{API}/whoami", headers=auth)).org == "acme"
    assert exact(responses.KeyVerification, client.post(f"{API}/api-keys/verify", headers=auth)).org == "acme"
    assert exact(responses.Health, client.get("/health")).status == "ok"
    admin = {"X-Kvcdn-Admin-Secret": config.admin_secret}
    minted = client.post(f"{API}/admin/api-keys", headers=admin, json={"org_slug": "acme"})
    assert exact(responses.OrgKey, minted).api_key == key
    refused = client.get(f"{API}/artifacts/{grant.artifact_id}x", headers=auth)
    error = responses.parse(responses.ErrorBody, refused.json())
    assert refused.status_code == 404 and error.error == "not_found" and error.model_extra == {}
