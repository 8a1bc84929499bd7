"""A confirm costs the server bounded memory, whatever the upload's size (issue 26, item 1).

A real ``kvcdn serve`` confirms a 256 MiB upload (local storage on SQLite, S3 on PostgreSQL); the
server's RSS high-water mark (``VmHWM``, reset to the idle RSS just before through
``/proc/<pid>/clear_refs``) may exceed the idle RSS by at most 64 MiB. Before the fix the confirm
read the whole file into memory (a 1 GiB upload took the server from 92 to 1,120 MB).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from kvcdn_core.testing.large_artifact import write_large_kv
from tests.hosted.conftest import S3_BUCKET
from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import confirm, mint_key, request_upload, upload, write_synthetic_kv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")

#: what one confirm may add to the server's RSS
BUDGET = 64 << 20
SIZE = 256 << 20


def _benchmark_script():
    """benchmarks/confirm_memory.py as a module: its /proc readers serve the tests too."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "confirm_memory.py"
    spec = importlib.util.spec_from_file_location("confirm_memory", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


SCRIPT = _benchmark_script()
memory, reset_peak = SCRIPT.memory, SCRIPT.reset_peak


def put_file(plan: dict, path: Path, chunk: int = 1 << 20) -> dict | None:
    """The upload-url plan's PUT(s) of ``path``, streamed from disk; return the confirm body."""

    def body(start: int, length: int):
        with open(path, "rb") as fh:
            fh.seek(start)
            while length:
                block = fh.read(min(chunk, length))
                length -= len(block)
                yield block

    size = path.stat().st_size
    if plan["multipart"] is None:
        headers = {**plan["headers"], "Content-Length": str(size)}
        r = httpx.put(plan["url"], content=body(0, size), headers=headers, timeout=budget(600))
        assert r.status_code == 200, r.text
        return None
    mp, parts = plan["multipart"], []
    for part in mp["parts"]:
        start = (part["part_number"] - 1) * mp["part_size"]
        r = httpx.put(
            part["url"],
            content=body(start, part["size"]),
            headers={"Content-Length": str(part["size"])},
            timeout=budget(600),
        )
        assert r.status_code == 200, r.text
        parts.append({"part_number": part["part_number"], "etag": r.headers["ETag"]})
    return {"parts": parts}


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    path = tmp_path_factory.mktemp("large") / "large.kv"
    return path, write_large_kv(path, SIZE, seed=2)


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_confirming_a_large_upload_keeps_the_server_rss_bounded(storage, large, tmp_path, request):
    path, sha256 = large
    quota = {"KVCDN_QUOTA_ARTIFACTS": "10", "KVCDN_QUOTA_STORAGE_BYTES": str(1 << 30)}
    if storage == "local":
        database, args, env = f"sqlite:///{tmp_path / 'state.db'}", [], quota
    else:
        moto = request.getfixturevalue("moto_s3")
        database = request.getfixturevalue("postgres_server").new_database()
        args, env = ["--storage", f"s3://{S3_BUCKET}/confirm-memory"], {**moto.env, **quota}
    with services.kvcdn_server(tmp_path / "home", ["--database", database, *args], env) as server:
        key = mint_key(server.url, server.admin_secret(), "big")
        upload(server.url, key, write_synthetic_kv(tmp_path / "warm.kv"))  # every import of a confirm done
        plan = request_upload(server.url, key, path, sha256=sha256).json()
        body = put_file(plan, path)
        pid = server.process.pid
        idle = reset_peak(pid)
        done = confirm(server.url, key, plan["artifact_id"], body)
        peak = memory(pid)["VmHWM"]
        assert done.status_code == 200, done.text
        assert done.json()["size_bytes"] == path.stat().st_size
        assert peak - idle <= BUDGET, f"the confirm took the server from {idle >> 20} to {peak >> 20} MiB"


def test_the_benchmark_script_runs_every_case(tmp_path, capsys):
    """benchmarks/confirm_memory.py as docs/deployment.md runs it, on tiny artifacts: every case
    answers as it should (200s, a 422 for the wrong digest) and gets a row."""
    script = SCRIPT
    tiny = str(1 / 1024)
    argv = ["--sizes", tiny, "--bad", tiny, "--concurrent", "2", "--concurrent-size", tiny]
    assert script.main([*argv, "--workdir", str(tmp_path / "work")]) == 0
    table = capsys.readouterr().out.split("| case |", 1)[1].splitlines()
    assert [row.split(" | ")[2] for row in table[2:]] == ["200", "422", "200, 200"]
    assert not list((tmp_path / "work").glob("*.kv"))
