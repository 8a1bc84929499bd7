"""Two ``kvcdn serve`` replicas on one S3 bucket (moto's server): presigned and multipart uploads,
isolation, and a replica answering for what the other one stored."""

from __future__ import annotations

import hashlib

import boto3
import httpx

from tests.hosted.conftest import S3_BUCKET
from tests.support.budget import budget
from tests.support.hosted import API, bearer, confirm, mint_key, put_bytes, request_upload, upload, write_synthetic_kv


def bucket_keys(moto_s3) -> list[str]:
    client = boto3.client(
        "s3",
        endpoint_url=moto_s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=S3_BUCKET).get("Contents", []))


def test_replicas_share_one_bucket(s3_replicas, moto_s3, new_org, qwen3_artifact, cli):
    a, b, admin = s3_replicas
    slug = new_org("s3")
    key = mint_key(a.url, admin, slug)
    art = upload(a.url, key, qwen3_artifact)
    # The upload went straight to S3 through a presigned URL, under the configured prefix, and the
    # key names only the artifact's random id.
    assert f"replicated/artifacts/{art['artifact_id']}" in bucket_keys(moto_s3)
    # Replica b knows the org (registered by a, in the shared database) and serves the artifact.
    listing = httpx.get(f"{b.url}{API}/artifacts", headers=bearer(key)).json()
    assert [x["artifact_id"] for x in listing["artifacts"]] == [art["artifact_id"]]
    d = httpx.post(f"{b.url}{API}/artifacts/{art['artifact_id']}/download-url", headers=bearer(key)).json()
    assert "X-Amz-Signature=" in d["download_url"]
    assert hashlib.sha256(httpx.get(d["download_url"]).content).hexdigest() == art["sha256"]
    r = httpx.post(
        f"{b.url}{API}/artifacts/{art['artifact_id']}/infer",
        headers=bearer(key),
        json={"question": " Who kept the ledger?", "n": 8},
        timeout=budget(120),
    )
    assert r.status_code == 200, r.text
    local = cli(
        "continue",
        "--kv-path",
        qwen3_artifact,
        "--question",
        " Who kept the ledger?",
        "--n",
        8,
        "--format",
        "json",
        "--device",
        "cpu",
    )
    import json

    assert r.json()["tokens"] == json.loads(local.stdout)["token_ids"]
    # A key rotated on one replica stops working on the other.
    new = httpx.post(
        f"{a.url}{API}/admin/api-keys/rotate", json={"org_slug": slug}, headers={"X-Kvcdn-Admin-Secret": admin}
    ).json()["api_key"]
    import time

    deadline = time.monotonic() + budget(10)  # KVCDN_ORGS_REFRESH=0.2 in the fixture; slack for a busy machine
    while httpx.get(f"{b.url}{API}/whoami", headers=bearer(key)).status_code != 401:
        assert time.monotonic() < deadline, "the rotated key still works on the other replica"
        time.sleep(0.1)
    assert httpx.get(f"{b.url}{API}/whoami", headers=bearer(new)).status_code == 200
    assert httpx.delete(f"{b.url}{API}/artifacts/{art['artifact_id']}", headers=bearer(new)).status_code == 204
    assert not [k for k in bucket_keys(moto_s3) if art["artifact_id"] in k]


def test_multipart_upload_over_the_part_size(s3_replicas, new_org, tmp_path):
    a, b, admin = s3_replicas
    key = mint_key(a.url, admin, new_org("mp"))
    big = write_synthetic_kv(tmp_path / "big.kv", tokens=700, width=256)  # about 5.5 MiB, part size 5 MiB
    assert big.stat().st_size > 5 << 20
    r = request_upload(a.url, key, big)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["url"] is None and len(plan["multipart"]["parts"]) == 2
    body = put_bytes(plan, big.read_bytes())
    # Confirming without the parts' ETags is refused and keeps the upload pending.
    assert confirm(b.url, key, plan["artifact_id"], {}).status_code == 409
    done = confirm(b.url, key, plan["artifact_id"], body)
    assert done.status_code == 200, done.text
    d = httpx.post(f"{a.url}{API}/artifacts/{plan['artifact_id']}/download-url", headers=bearer(key)).json()
    assert httpx.get(d["download_url"]).content == big.read_bytes()


def test_s3_isolation_and_refusals_store_nothing(s3_replicas, moto_s3, new_org, small_kv, tmp_path):
    a, b, admin = s3_replicas
    owner, intruder = (mint_key(a.url, admin, new_org("s3iso")) for _ in range(2))
    art = upload(a.url, owner, small_kv)
    for server in (a, b):
        for method, route in [
            ("GET", f"/artifacts/{art['artifact_id']}"),
            ("POST", f"/artifacts/{art['artifact_id']}/download-url"),
            ("DELETE", f"/artifacts/{art['artifact_id']}"),
        ]:
            assert httpx.request(method, f"{server.url}{API}{route}", headers=bearer(intruder)).status_code == 404
    before = bucket_keys(moto_s3)
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"not a kv artifact at all" * 10)
    plan = request_upload(a.url, owner, junk).json()
    put_bytes(plan, junk.read_bytes())
    r = confirm(b.url, owner, plan["artifact_id"])
    assert r.status_code == 422 and r.json()["error"] == "not_a_kv_artifact"
    plan = request_upload(a.url, owner, small_kv, sha256="cd" * 32).json()
    put_bytes(plan, small_kv.read_bytes())
    r = confirm(a.url, owner, plan["artifact_id"])
    assert r.status_code == 422 and r.json()["error"] == "sha256_mismatch"
    assert bucket_keys(moto_s3) == before


def test_the_collector_aborts_multipart_uploads_no_open_upload_owns(moto_s3, monkeypatch, tmp_path):
    """A multipart upload the database does not know (a crash between starting it and recording
    it) is aborted; the one an open upload is using is left alone."""
    from fastapi.testclient import TestClient

    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    for name, value in {**moto_s3.env, "KVCDN_S3_PART_SIZE": str(5 << 20), "KVCDN_API_KEY_ORGS": "acme"}.items():
        monkeypatch.setenv(name, value)
    config = load_config(storage=f"s3://{S3_BUCKET}/collector", database_url=f"sqlite:///{tmp_path / 'state.db'}")
    app = create_app(config)
    client, store = TestClient(app), app.state.services.store
    key = derive_key(config.api_key_seed, "acme")
    size = 6 << 20
    plan = client.post(
        f"{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": "big.kv", "size_bytes": size, "sha256": "0" * 64},
    ).json()
    assert plan["multipart"] is not None
    stray = "22222222-2222-4222-8222-222222222222"
    store.storage.start_multipart(f"uploads/{stray}", size, 60)
    assert {k for k, _ in store.storage.list_multipart("uploads/")} == {
        f"uploads/{plan['artifact_id']}",
        f"uploads/{stray}",
    }
    assert store.collect()["multipart"] == 1
    assert [k for k, _ in store.storage.list_multipart("uploads/")] == [f"uploads/{plan['artifact_id']}"]
    # Deleting the open upload aborts its multipart upload too.
    assert client.delete(f"{API}/artifacts/{plan['artifact_id']}", headers=bearer(key)).status_code == 204
    assert store.storage.list_multipart("uploads/") == []


def test_the_original_clients_put_is_signed_for_what_it_sends(s3_replicas, new_org, small_kv):
    """Issue 26, item 8: the presigned PUT must be valid for the original client's exact request
    (a sized body, ``Host`` and ``Content-Length``, no ``Content-Type``). moto checks no signatures,
    so the signature is recomputed from the URL's query and the credentials, as S3 would."""
    import json

    from tests.hosted.test_server_compat import SEED_HEADERS, seed_upload_body
    from tests.support.sigv4 import sigv4_query_valid

    a, _b, admin = s3_replicas
    key = mint_key(a.url, admin, new_org("seed-s3"))
    r = httpx.post(
        f"{a.url}{API}/artifacts/upload-url",
        content=json.dumps(seed_upload_body(small_kv)),
        headers={**SEED_HEADERS, **bearer(key)},
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    data = small_kv.read_bytes()
    seed_put = {"Content-Length": str(len(data))}
    assert sigv4_query_valid(plan["url"], "PUT", seed_put, "testing"), plan["url"]
    # A signature that checks nothing would pass too: the same check fails another length.
    assert not sigv4_query_valid(plan["url"], "PUT", {"Content-Length": str(len(data) + 1)}, "testing")
    put = httpx.put(plan["url"], content=data, headers=seed_put)
    assert put.status_code == 200 and "content-type" not in put.request.headers, put.text
    done = confirm(
        a.url, key, plan["artifact_id"], {"digest": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    )
    assert done.status_code == 200, done.text
