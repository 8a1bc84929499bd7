"""Chunked artifacts in the hosted service on the S3 backend (the app in-process, moto's S3 server,
a real SQLite database): the round trip, dedup and the collector against a bucket, and the chunk
PUT's timing (a PUT of bytes another tenant holds takes as long as one of new bytes)."""

from __future__ import annotations

import statistics
import time
import uuid

import boto3
import httpx
import pytest
from fastapi.testclient import TestClient

from tests.hosted.conftest import S3_BUCKET
from tests.hosted.test_chunked import _blobs, begin, down, rule_bytes, tenant_of, up, write_kv
from tests.support.hosted import API, bearer


@pytest.fixture
def s3_server(monkeypatch, moto_s3, tmp_path):
    """The app on the moto bucket under a fresh prefix, SQLite, an API key for each of two orgs."""
    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.config import load_config

    for name, value in moto_s3.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVCDN_API_KEY_ORGS", "acme,beta")
    monkeypatch.setenv("KVCDN_INFER_DEVICE", "cpu")
    monkeypatch.setenv("KVCDN_DATABASE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    prefix = f"chunked-{uuid.uuid4().hex[:8]}"
    config = load_config(storage=f"s3://{S3_BUCKET}/{prefix}")
    app = create_app(config)
    client = Routed(TestClient(app), moto_s3.endpoint)
    keys = {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}
    yield app, client, keys, bucket_chunks(moto_s3, prefix)
    client.close()


class Routed:
    """The app's test client for its own routes, real HTTP for the bucket's presigned URLs."""

    def __init__(self, app_client, bucket_endpoint: str):
        self.app_client, self.bucket_endpoint = app_client, bucket_endpoint

    def _for(self, url: str):
        return httpx if url.startswith(self.bucket_endpoint) else self.app_client

    def get(self, url, **kw):
        return self._for(url).get(url, **kw)

    def put(self, url, **kw):
        return self._for(url).put(url, **kw)

    def post(self, url, **kw):
        return self._for(url).post(url, **kw)

    def delete(self, url, **kw):
        return self._for(url).delete(url, **kw)

    def close(self):
        self.app_client.close()


def bucket_chunks(moto_s3, prefix: str):
    """A function listing the digests of the chunk objects in the bucket under ``prefix``."""
    s3 = boto3.client(
        "s3",
        endpoint_url=moto_s3.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )

    def listed() -> set[str]:
        found = s3.list_objects_v2(Bucket=S3_BUCKET, Prefix=f"{prefix}/chunks/").get("Contents", [])
        return {o["Key"].rsplit("/", 1)[1] for o in found}

    return listed


def test_chunked_round_trip_dedup_and_gc_on_s3(s3_server, tmp_path):
    app, client, keys, listed = s3_server
    store = app.state.services.store
    first_src, second_src = write_kv(tmp_path / "first.kv", 40), write_kv(tmp_path / "second.kv", 56)
    first = up(client, keys["acme"], first_src, "first")
    second = up(client, keys["acme"], second_src, "second")
    assert first.bytes_saved == 0 and second.bytes_saved > 0  # the shared chunks went up once
    assert listed() == set(_blobs(first_src)) | set(_blobs(second_src))
    down(client, keys["acme"], second.artifact_id, tmp_path / "got.kv")
    assert (tmp_path / "got.kv").read_bytes() == second_src.read_bytes()
    # the seed wire's single URL serves the whole file from the bucket too
    r = client.post(f"{API}/artifacts/{first.artifact_id}/download-url", headers=bearer(keys["acme"]))
    assert r.status_code == 200, r.text
    whole = client.get(r.json()["download_url"])
    assert whole.status_code == 200 and whole.content == first_src.read_bytes()
    tenant = tenant_of(client, keys["acme"])
    assert store.reserved(tenant) == (2, rule_bytes(app, tenant))
    # the collector deletes only the objects no artifact references any more
    assert client.delete(f"{API}/artifacts/{first.artifact_id}", headers=bearer(keys["acme"])).status_code == 204
    store.collect()
    assert listed() == set(_blobs(second_src))
    down(client, keys["acme"], second.artifact_id, tmp_path / "again.kv")
    assert (tmp_path / "again.kv").read_bytes() == second_src.read_bytes()
    assert client.delete(f"{API}/artifacts/{second.artifact_id}", headers=bearer(keys["acme"])).status_code == 204
    store.collect()
    assert listed() == set()
    assert store.reserved(tenant) == (0, 0)


def test_a_put_of_a_foreign_chunk_takes_as_long_as_a_put_of_a_new_one(s3_server, tmp_path):
    """Timing: PUTs of objects another tenant already stores against PUTs of objects nobody
    stores, interleaved (one batch of each in turn, so a busy machine's load falls on both alike),
    compared by the medians of batches. Both write the object to the bucket, so their times differ
    only by noise; the bound (medians within a factor of 1.5) is wide enough that no load pattern
    breaks it (1.10 measured on a busy machine), yet a PUT that skipped the bucket write for a stored
    object (one S3 request of its bytes fewer; objects of 2 MB make that cost plain) answers in
    under two thirds of the time and fails it (0.47 measured with the old server)."""
    app, client, keys, _listed = s3_server
    foreign_src = write_kv(tmp_path / "foreign.kv", 64, width=4096)
    up(client, keys["beta"], foreign_src, "secret")  # beta's private objects
    blobs = _blobs(foreign_src)
    foreign = begin(client, keys["acme"], foreign_src)
    assert len(foreign["missing"]) == foreign["objects"]  # answered missing, as unknown ones are

    def put_all(grant, bodies) -> float:
        start = time.perf_counter()
        for item in grant["missing"]:
            assert client.put(item["url"], content=bodies[item["digest"]]).status_code == 200
        return time.perf_counter() - start

    def unknown_batch(seed: int):
        """A fresh upload of bytes nobody stores, of the same shape (its rows made, not timed)."""
        src = write_kv(tmp_path / f"u{seed}.kv", 64, width=4096, seed=seed)
        return begin(client, keys["acme"], src, f"u{seed}"), _blobs(src)

    put_all(foreign, blobs)  # warm both paths
    put_all(*unknown_batch(1000))
    foreign_times, unknown_times = [], []
    for round_ in range(16):
        fresh = unknown_batch(round_ + 1)
        pair = [(foreign_times, (foreign, blobs)), (unknown_times, fresh)]
        if round_ % 2:
            pair.reverse()
        for into, args in pair:
            into.append(put_all(*args))
    ratio = statistics.median(foreign_times) / statistics.median(unknown_times)
    assert 1 / 1.5 < ratio < 1.5, (ratio, foreign_times, unknown_times)
