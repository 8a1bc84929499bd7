"""The original kvcdn client's requests replayed byte for byte, artifact names, and the small
security items of the hosted API (signed URLs, access log, storage errors)."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from tests.support.hosted import API, bearer, confirm, request_upload, sha256_of, upload

SEED_HEADERS = {"Content-Type": "application/json"}


def seed_upload_body(path, name="ctx", **overrides):
    """The upload-url body of the original client (its field names and shapes)."""
    digest = sha256_of(path)
    body = {
        "model_name": name,
        "dtype": "float32",
        "num_tokens": 8,
        "visibility": "private",
        "size_bytes": path.stat().st_size,
        "checksum": digest,
        "metadata": {"name": name, "sha256": digest, "storage_dtype": "float32", "num_layers": 2, "quantized": False},
    }
    body.update(overrides)
    return body


def test_the_original_client_round_trip(local_server, new_org, small_kv):
    base, admin = local_server.url, local_server.admin_secret()
    slug = new_org("seed")
    # admin mint-api-key: Authorization: Bearer <admin secret>
    r = httpx.post(
        f"{base}{API}/admin/api-keys",
        content=json.dumps({"org_slug": slug}),
        headers={**SEED_HEADERS, "Authorization": f"Bearer {admin}"},
    )
    assert r.status_code in (200, 201), r.text
    minted = r.json()
    assert {"api_key", "customer_id", "org_slug"} <= set(minted)
    key = minted["api_key"]
    # whoami / api-key verify: empty POST
    r = httpx.post(f"{base}{API}/api-keys/verify", headers=bearer(key))
    assert r.status_code == 200 and r.json()["customer_id"] == minted["customer_id"]
    # upload: upload-url, a PUT of the raw bytes without content type, confirm with digest and size
    r = httpx.post(
        f"{base}{API}/artifacts/upload-url",
        content=json.dumps(seed_upload_body(small_kv)),
        headers={**SEED_HEADERS, **bearer(key)},
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    artifact_id, url = plan["artifact_id"], plan["url"]
    data = small_kv.read_bytes()
    r = httpx.put(url, content=data, headers={"Content-Length": str(len(data))})
    assert 200 <= r.status_code < 300, r.text
    r = httpx.post(
        f"{base}{API}/artifacts/{artifact_id}/confirm-upload",
        content=json.dumps({"digest": sha256_of(small_kv), "size_bytes": len(data)}),
        headers={**SEED_HEADERS, **bearer(key)},
    )
    assert r.status_code == 200, r.text
    # list: the fields the original client reads, each key once (its parser refuses duplicates of aliases)
    r = httpx.get(f"{base}{API}/artifacts", headers=bearer(key))
    [entry] = r.json()["artifacts"]
    assert entry["artifact_id"] == artifact_id and entry["name"] == "ctx"
    assert (
        entry["size_bytes"],
        entry["sha256"],
        entry["num_tokens"],
        entry["num_layers"],
        entry["quantized"],
        entry["dtype"],
        entry["visibility"],
    ) == (len(data), sha256_of(small_kv), 8, 2, False, "float32", "private")
    assert "id" not in entry and "model_name" not in entry and "created_at" in entry
    # download: empty POST, then GET the URL
    r = httpx.post(f"{base}{API}/artifacts/{artifact_id}/download-url", headers=bearer(key))
    assert r.json()["artifact_id"] == artifact_id
    assert httpx.get(r.json()["download_url"]).content == data
    # quota: the original table
    q = httpx.get(f"{base}{API}/quota", headers=bearer(key)).json()
    assert q["used"]["artifacts"] == 1 and q["used"]["storage_bytes"] == len(data)
    assert q["quota"]["artifacts"] == q["limits"]["artifacts"]
    assert httpx.delete(f"{base}{API}/artifacts/{artifact_id}", headers=bearer(key)).status_code == 204


def test_the_original_client_lists_and_downloads_a_chunked_artifact(local_server, org_key, tmp_path):
    """An artifact uploaded by chunks is, to the original client, an artifact like any other: its
    list entry has the fields it reads, and its single download URL gives the whole `.kv` file."""
    from kvcdn_hosted import chunked
    from tests.support.hosted import write_synthetic_kv

    base, key = local_server.url, org_key("seedchunk")
    path = write_synthetic_kv(tmp_path / "c.kv", tokens=40, width=8)
    data = path.read_bytes()
    with httpx.Client(timeout=120) as http:
        report = chunked.upload(http, base, bearer(key), path, "ctx", chunk_tokens=16)
    [entry] = httpx.get(f"{base}{API}/artifacts", headers=bearer(key)).json()["artifacts"]
    assert (entry["artifact_id"], entry["size_bytes"], entry["sha256"], entry["num_tokens"], entry["chunked"]) == (
        report.artifact_id,
        len(data),
        sha256_of(path),
        40,
        True,
    )
    assert "id" not in entry and "model_name" not in entry
    r = httpx.post(f"{base}{API}/artifacts/{report.artifact_id}/download-url", headers=bearer(key))
    assert r.status_code == 200 and r.json()["size_bytes"] == len(data)
    got = httpx.get(r.json()["download_url"])
    assert got.content == data and hashlib.sha256(got.content).hexdigest() == r.json()["sha256"]
    assert httpx.delete(f"{base}{API}/artifacts/{report.artifact_id}", headers=bearer(key)).status_code == 204


@pytest.mark.parametrize(
    "change,error",
    [
        ({"checksum": "ab" * 32}, "sha256_mismatch"),  # not the sha256 of the bytes
        ({"num_tokens": 9}, "manifest_mismatch"),  # not what the artifact says
    ],
)
def test_the_original_clients_fields_are_checked_for_meaning(local_server, org_key, small_kv, change, error):
    key = org_key("seedcheck")
    body = seed_upload_body(small_kv, **change)
    body["metadata"]["sha256"] = body["checksum"]
    plan = httpx.post(f"{local_server.url}{API}/artifacts/upload-url", json=body, headers=bearer(key)).json()
    assert httpx.put(plan["url"], content=small_kv.read_bytes()).status_code == 200
    r = confirm(local_server.url, key, plan["artifact_id"])
    assert r.status_code == 422 and r.json()["error"] == error


def test_disagreeing_digests_are_refused(local_server, org_key, small_kv):
    key = org_key("seeddigest")
    body = seed_upload_body(small_kv)
    body["metadata"]["sha256"] = "cd" * 32
    r = httpx.post(f"{local_server.url}{API}/artifacts/upload-url", json=body, headers=bearer(key))
    assert r.status_code == 422 and "disagree" in r.json()["message"]
    plan = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url", json=seed_upload_body(small_kv), headers=bearer(key)
    ).json()
    httpx.put(plan["url"], content=small_kv.read_bytes())
    r = confirm(
        local_server.url, key, plan["artifact_id"], {"digest": "ef" * 32, "size_bytes": small_kv.stat().st_size}
    )
    assert r.status_code == 422 and r.json()["error"] == "sha256_mismatch"
    # The failed upload gave its place back: the quota counts nothing.
    assert httpx.get(f"{local_server.url}{API}/quota", headers=bearer(key)).json()["usage"]["pending_artifacts"] == 0


@pytest.mark.parametrize(
    "raw_name",
    [
        '"x\\ud800y"',  # a lone surrogate
        '"a\\u202eb.kv"',  # right-to-left override
        '"a\\u2066b.kv"',  # left-to-right isolate
        '"a\\u200bb.kv"',  # zero-width space
        '"a\\ufeffb.kv"',  # zero-width no-break space
        '"a\\u0085b.kv"',  # C1 control (next line)
        '"a\\u009bb.kv"',  # C1 control sequence introducer
    ],
)
def test_names_with_invisible_or_control_characters_are_refused(local_server, org_key, small_kv, raw_name):
    key = org_key("names")
    body = f'{{"name": {raw_name}, "size_bytes": {small_kv.stat().st_size}, "sha256": "{sha256_of(small_kv)}"}}'
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url",
        content=body.encode(),
        headers={**bearer(key), "Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"] in ("invalid_name", "validation_error") and "\n" not in r.json()["message"]
    assert httpx.get(f"{local_server.url}{API}/artifacts", headers=bearer(key)).status_code == 200


@pytest.mark.parametrize("name", ["x\ud800y", "a\u202eb", "a\u200db", "a\u0085b", "a\u2028b", "a\ue000b"])
def test_the_name_check_itself(name):
    """The check behind upload-url, whatever the JSON parser in front of it lets through."""
    from kvcdn_server.errors import ApiError
    from kvcdn_server.validation import check_name

    with pytest.raises(ApiError) as refused:
        check_name(name)
    assert refused.value.status == 422 and refused.value.code == "invalid_name"
    assert check_name("cafe\u0301") == "caf\u00e9"
    assert check_name("team/q3/doc.kv") == "team/q3/doc.kv"  # parts, as storage keys have


def test_names_are_stored_in_nfc(local_server, org_key, small_kv):
    key = org_key("nfc")
    art = upload(local_server.url, key, small_kv, name="cafe\u0301.kv")
    assert art["name"] == "caf\u00e9.kv"
    listing = httpx.get(f"{local_server.url}{API}/artifacts", headers=bearer(key))
    assert listing.status_code == 200 and [a["name"] for a in listing.json()["artifacts"]] == ["caf\u00e9.kv"]


def test_public_urls_name_only_the_artifact_and_ignore_the_host_header(local_server, new_org, small_kv):
    from tests.support.hosted import mint_key

    slug = new_org("pub")
    key = mint_key(local_server.url, local_server.admin_secret(), slug)
    r = request_upload(local_server.url, key, small_kv, visibility="public")
    plan = r.json()
    evil = httpx.post(
        f"{local_server.url}{API}/artifacts/upload-url",
        headers={**bearer(key), "Host": "evil.example"},
        json={"name": "h.kv", "size_bytes": 10, "sha256": "0" * 64},
    )
    assert evil.json()["url"].startswith(local_server.url + "/")
    httpx.put(plan["url"], content=small_kv.read_bytes())
    assert confirm(local_server.url, key, plan["artifact_id"]).status_code == 200
    anonymous = httpx.post(
        f"{local_server.url}{API}/artifacts/{plan['artifact_id']}/download-url", headers={"Host": "evil.example"}
    ).json()
    url = httpx.URL(anonymous["download_url"])
    assert str(url).startswith(local_server.url + "/")
    assert url.path == f"{API}/blobs/{plan['artifact_id']}"
    for owner_hash in (hashlib.sha256(f"org:{slug}".encode()).hexdigest()[:32], slug):
        assert owner_hash not in str(url)
    assert httpx.get(url).content == small_kv.read_bytes()
    # ...and the access log shows the path, never the signature.
    log = "".join(local_server.log)
    assert f"/blobs/{plan['artifact_id']}" in log and "sig=" not in log


def test_storage_errors_do_not_leak_object_keys(tmp_path, monkeypatch, small_kv):
    from fastapi.testclient import TestClient

    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme")
    config = load_config(storage=str(tmp_path / "objects"))
    app = create_app(config)
    client = TestClient(app)
    key = derive_key(config.api_key_seed, "acme")
    plan = client.post(
        f"{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": "a.kv", "size_bytes": small_kv.stat().st_size, "sha256": sha256_of(small_kv)},
    ).json()
    path = "/" + plan["url"].split("://", 1)[1].split("/", 1)[1]
    assert client.put(path, content=small_kv.read_bytes()).status_code == 200
    assert client.post(f"{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key)).status_code == 200
    (tmp_path / "objects" / "artifacts" / plan["artifact_id"]).unlink()  # lost behind the server's back
    d = client.post(f"{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key)).json()
    r = client.get("/" + d["download_url"].split("://", 1)[1].split("/", 1)[1])
    assert r.status_code == 502 and r.json()["error"] == "storage_error"
    assert "artifacts/" not in r.text and str(tmp_path) not in r.text
