"""The hosted server's peak memory while it confirms large uploads.

Starts ``kvcdn serve`` (SQLite, local storage) in a work directory, and for each case uploads valid
artifacts (``kvcdn_core.testing.large_artifact``: real `.kv` files whose tensors are large), then
confirms them. Before each confirm the server's peak RSS is reset to its idle RSS
(``/proc/<pid>/clear_refs``); after it, the table gives the peak above idle (``VmHWM - VmRSS``) and the
confirm's wall time. Cases:

- one valid artifact of each ``--sizes`` GiB;
- one of ``--bad`` GiB whose last tensor does not match its manifest digest (refused with 422
  after the whole check);
- ``--concurrent`` valid artifacts of ``--concurrent-size`` GiB confirmed at once.

Every file is deleted after its case (the artifact through the API, the source from disk), so the
disk holds at most one case at a time (twice its bytes: the source and the server's copy). Linux only.

    python benchmarks/confirm_memory.py --sizes 1,2,4 --bad 2 --concurrent 4 --concurrent-size 1 [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

API = "/api/v1"
GIB = 1 << 30


def memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> int:
    """Reset the peak RSS to the current RSS; return it."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory(pid)["VmRSS"]


class Server:
    """``kvcdn serve`` on a free loopback port, its state under ``home``."""

    def __init__(self, home: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "XDG_DATA_HOME": str(home),
            "KVCDN_QUOTA_ARTIFACTS": "100",
            "KVCDN_QUOTA_STORAGE_BYTES": str(64 * GIB),
        }
        cmd = [sys.executable, "-m", "kvcdn_core", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--database", f"sqlite:///{home / 'state.db'}"]
        self.log = open(home / "server.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"kvcdn serve exited with {self.process.returncode}; see {home / 'server.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("kvcdn serve did not become healthy")
            time.sleep(0.2)
        secret = (home / "kvcdn" / "server" / "admin-secret").read_text().strip()
        r = httpx.post(
            f"{self.url}{API}/admin/api-keys", json={"org_slug": "bench"}, headers={"X-Kvcdn-Admin-Secret": secret}
        )
        r.raise_for_status()
        self.headers = {"Authorization": f"Bearer {r.json()['api_key']}"}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def put(self, path: Path, sha256: str) -> str:
        """upload-url and the PUT, streamed from disk; return the artifact id (not yet confirmed)."""
        size = path.stat().st_size
        body = {"name": path.name, "size_bytes": size, "sha256": sha256, "visibility": "private"}
        r = httpx.post(f"{self.url}{API}/artifacts/upload-url", json=body, headers=self.headers)
        r.raise_for_status()
        plan = r.json()

        def chunks():
            with open(path, "rb") as fh:
                while block := fh.read(4 << 20):
                    yield block

        headers = {**plan["headers"], "Content-Length": str(size)}
        httpx.put(plan["url"], content=chunks(), headers=headers, timeout=3600).raise_for_status()
        return plan["artifact_id"]

    def confirm(self, artifact_id: str) -> int:
        r = httpx.post(
            f"{self.url}{API}/artifacts/{artifact_id}/confirm-upload", json={}, headers=self.headers, timeout=3600
        )
        return r.status_code

    def delete(self, artifact_id: str) -> None:
        httpx.delete(f"{self.url}{API}/artifacts/{artifact_id}", headers=self.headers)


def run_case(server: Server, work: Path, label: str, sizes: list[float], corrupt: bool = False) -> dict:
    from kvcdn_core.testing.large_artifact import write_large_kv

    ids, files = [], []
    for i, gib in enumerate(sizes):
        path = work / f"case-{i}.kv"
        sha256 = write_large_kv(path, int(gib * GIB), seed=i, corrupt=corrupt)
        ids.append(server.put(path, sha256))
        files.append(path)
        path.unlink()  # the server holds its copy; the disk holds one
    pid = server.process.pid
    idle = reset_peak(pid)
    statuses: list[int] = []
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda a=a: statuses.append(server.confirm(a))) for a in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    peak = memory(pid)["VmHWM"]
    for artifact_id in ids:
        server.delete(artifact_id)
    return {
        "case": label,
        "bytes": sum(int(g * GIB) for g in sizes),
        "statuses": sorted(statuses),
        "idle": idle,
        "peak": peak,
        "seconds": seconds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="GiB of each valid artifact, one confirm each")
    parser.add_argument("--bad", type=float, default=2.0, help="GiB of the artifact with a wrong digest (0: none)")
    parser.add_argument("--concurrent", type=int, default=4, help="confirms at once (0: none)")
    parser.add_argument("--concurrent-size", type=float, default=1.0, help="GiB of each concurrent artifact")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("this benchmark reads /proc and runs on Linux only")

    from kvcdn_core.cores import hash_workers

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-confirm-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    server = Server(work)
    rows = []
    try:
        run_case(server, work, "warm-up", [1 / 1024])  # the first confirm's imports are not a confirm's cost
        cases = [(f"{float(g):g} GiB valid", [float(g)], False) for g in args.sizes.split(",") if g]
        if args.bad:
            cases.append((f"{args.bad:g} GiB, wrong tensor digest", [args.bad], True))
        if args.concurrent:
            cases.append(
                (
                    f"{args.concurrent} × {args.concurrent_size:g} GiB at once",
                    [args.concurrent_size] * args.concurrent,
                    False,
                )
            )
        for label, sizes, corrupt in cases:
            rows.append(run_case(server, work, label, sizes, corrupt))
            print(_row(rows[-1]), flush=True)
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"cores: {len(os.sched_getaffinity(0))}, hashing threads: {hash_workers()}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print("| case | bytes confirmed | responses | idle RSS | peak RSS | peak above idle | wall time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(_row(row))
    return 0


def _row(row: dict) -> str:
    mib = 1 << 20
    return (
        f"| {row['case']} | {row['bytes'] / GIB:g} GiB | {', '.join(map(str, row['statuses']))} | "
        f"{row['idle'] / mib:.0f} MiB | {row['peak'] / mib:.0f} MiB | {(row['peak'] - row['idle']) / mib:.0f} MiB | "
        f"{row['seconds']:.1f} s |"
    )


if __name__ == "__main__":
    sys.exit(main())
