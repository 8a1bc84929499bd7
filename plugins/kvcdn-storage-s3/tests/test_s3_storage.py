"""The S3 backend against moto's S3 server on 127.0.0.1 (real HTTP, real boto3)."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from kvcdn_core.errors import KvcdnError
from kvcdn_storage_s3 import MIB, S3Storage

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository's tests.support
from tests.support.sigv4 import sigv4_query_valid as _sigv4_query_valid  # noqa: E402

BUCKET = "kvcdn-s3-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    for name, value in {
        "KVCDN_S3_ENDPOINT_URL": moto_endpoint,
        "KVCDN_S3_REGION": "us-east-1",
        "KVCDN_S3_ACCESS_KEY_ID": "testing",
        "KVCDN_S3_SECRET_ACCESS_KEY": "testing",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KVCDN_S3_PART_SIZE", raising=False)
    store = S3Storage(BUCKET)
    try:
        store.client.create_bucket(Bucket=BUCKET)
    except Exception:
        pass  # created by an earlier test of this module
    return moto_endpoint


def test_round_trip_under_a_prefix(s3_env, tmp_path):
    store = S3Storage.from_uri(f"s3://{BUCKET}/tenant-x/")
    source = tmp_path / "a.kv"
    source.write_bytes(os.urandom(4096))
    store.put_file("dir/a.kv", source)
    assert store.exists("dir/a.kv") and store.size_of("dir/a.kv") == 4096
    assert [(o.key, o.size) for o in store.list("dir/")] == [("dir/a.kv", 4096)]
    # The prefix is really applied: the raw bucket key carries it.
    raw = store.client.list_objects_v2(Bucket=BUCKET, Prefix="tenant-x/")["Contents"]
    assert [o["Key"] for o in raw] == ["tenant-x/dir/a.kv"]
    out = tmp_path / "out" / "b.kv"
    store.get_file("dir/a.kv", out)
    assert out.read_bytes() == source.read_bytes()
    assert not list(out.parent.glob(".*.tmp"))
    store.write_bytes("dir/a.meta.json", b'{"x": 1}')
    assert store.read_bytes("dir/a.meta.json") == b'{"x": 1}'
    store.rename("dir/a.kv", "dir/c.kv")
    assert not store.exists("dir/a.kv") and store.size_of("dir/c.kv") == 4096
    body = store.open_read("dir/c.kv")
    assert body.read() == source.read_bytes()
    body.close()
    store.delete("dir/c.kv")
    store.delete("dir/c.kv")  # deleting twice is fine
    assert store.read_bytes("dir/c.kv") is None and store.size_of("dir/c.kv") is None


def test_missing_object_and_bad_keys_are_one_line_errors(s3_env, tmp_path):
    store = S3Storage(BUCKET, "p")
    with pytest.raises(KvcdnError, match="no object"):
        store.get_file("nope.kv", tmp_path / "x.kv")
    assert not (tmp_path / "x.kv").exists()
    for key in ("../escape", "/abs", "a//b", "a/./b"):
        with pytest.raises(KvcdnError, match="invalid storage key"):
            store.put_file(key, tmp_path)


def test_presigned_put_and_get(s3_env):
    store = S3Storage(BUCKET, "presigned")
    data = os.urandom(10_000)
    url = store.presigned_url("PUT", "obj.kv", 60, size=len(data))
    assert "X-Amz-Signature=" in url and "X-Amz-Expires=60" in url
    r = httpx.put(url, content=data, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    got = httpx.get(store.presigned_url("GET", "obj.kv", 60))
    assert got.status_code == 200 and got.content == data


def test_multipart_upload_through_presigned_part_urls(s3_env):
    store = S3Storage(BUCKET, "mp", part_size=5 * MIB)
    size = 11 * MIB + 123
    data = os.urandom(size)
    assert store.needs_multipart(size) and not store.needs_multipart(5 * MIB)
    plan = store.start_multipart("big.kv", size, 60)
    assert [p["size"] for p in plan["parts"]] == [5 * MIB, 5 * MIB, MIB + 123]
    etags = []
    for part in plan["parts"]:
        start = (part["part_number"] - 1) * plan["part_size"]
        r = httpx.put(part["url"], content=data[start : start + part["size"]])
        assert r.status_code == 200, r.text
        etags.append({"part_number": part["part_number"], "etag": r.headers["ETag"]})
    store.complete_multipart("big.kv", plan["upload_id"], etags)
    assert store.size_of("big.kv") == size
    assert hashlib.sha256(store.read_bytes("big.kv")).digest() == hashlib.sha256(data).digest()


def test_abort_multipart_leaves_nothing(s3_env):
    store = S3Storage(BUCKET, "abort", part_size=5 * MIB)
    plan = store.start_multipart("x.kv", 6 * MIB, 60)
    store.abort_multipart("x.kv", plan["upload_id"])
    with pytest.raises(KvcdnError):
        store.complete_multipart("x.kv", plan["upload_id"], [{"part_number": 1, "etag": '"x"'}])
    assert store.size_of("x.kv") is None


def test_put_file_over_the_part_size_goes_up_in_parts(s3_env, tmp_path):
    store = S3Storage(BUCKET, "managed", part_size=5 * MIB)
    source = tmp_path / "big.kv"
    source.write_bytes(os.urandom(6 * MIB))
    store.put_file("big.kv", source)
    etag = store.client.head_object(Bucket=BUCKET, Key="managed/big.kv")["ETag"]
    assert etag.strip('"').endswith("-2")  # a multipart ETag names its part count


def test_part_size_setting_is_checked(monkeypatch):
    monkeypatch.setenv("KVCDN_S3_PART_SIZE", "1024")
    with pytest.raises(KvcdnError, match="between"):
        S3Storage(BUCKET)
    monkeypatch.setenv("KVCDN_S3_PART_SIZE", "lots")
    with pytest.raises(KvcdnError, match="number of bytes"):
        S3Storage(BUCKET)


def test_registered_through_the_storage_hook(discovered_host, s3_env):
    from kvcdn_core.plugin_host.registry import open_storage

    store = open_storage(f"s3://{BUCKET}/hooked")
    assert isinstance(store, S3Storage) and store.prefix == "hooked"
    with pytest.raises(KvcdnError, match="bucket"):
        open_storage("s3:///nobucket")


def test_presigned_put_urls_sign_the_declared_size(s3_env):
    """S3 refuses a PUT whose Content-Length differs from the one signed into its URL."""
    store = S3Storage(BUCKET, "sized", part_size=5 * MIB)
    url = store.presigned_url("PUT", "obj.kv", 60, size=1000)
    typ = {"Content-Type": "application/octet-stream"}
    assert _sigv4_query_valid(url, "PUT", {**typ, "Content-Length": "1000"}, "testing")
    assert not _sigv4_query_valid(url, "PUT", {**typ, "Content-Length": "1001"}, "testing")
    assert not _sigv4_query_valid(url, "PUT", typ, "testing")
    # The original kvcdn client's PUT: a sized body and no Content-Type. Only what every client
    # sends may be signed, or real S3 refuses the signature (moto checks none).
    assert parse_qs(urlsplit(url).query)["X-Amz-SignedHeaders"] == ["content-length;host"]
    assert _sigv4_query_valid(url, "PUT", {"Content-Length": "1000"}, "testing")
    plan = store.start_multipart("big.kv", 6 * MIB + 7, 60)
    assert [p["size"] for p in plan["parts"]] == [5 * MIB, MIB + 7]
    for part in plan["parts"]:
        assert _sigv4_query_valid(part["url"], "PUT", {"Content-Length": str(part["size"])}, "testing")
        assert not _sigv4_query_valid(part["url"], "PUT", {"Content-Length": str(part["size"] - 1)}, "testing")
    store.abort_multipart("big.kv", plan["upload_id"])


def test_rename_moves_and_refuses_a_missing_source(s3_env):
    store = S3Storage(BUCKET, "moves")
    store.write_bytes("a", b"payload")
    store.rename("a", "b")
    assert store.read_bytes("b") == b"payload" and store.read_bytes("a") is None
    with pytest.raises(KvcdnError):
        store.rename("a", "c")


def test_s3_passes_the_storage_contract(s3_env):
    from kvcdn_core.testing import assert_storage_contract

    prefixes = iter(range(1000))
    assert_storage_contract(lambda: S3Storage.from_uri(f"s3://{BUCKET}/contract-{os.getpid()}-{next(prefixes)}"))
