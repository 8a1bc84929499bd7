"""benchmarks/vllm_fleet.py's own parts: the HTTP byte count that says "nothing else downloaded",
the connector log line it reads the per-request figures from, and the goals' arithmetic.

The benchmark itself needs the vLLM environment and minutes of CPU; these tests need neither.
"""

from __future__ import annotations

import http.client
import http.server
import importlib.util
import math
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvcdn_hosted.objects import ObjectReader
from tests.support import services

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def fleet():
    sys.path.insert(0, str(BENCHMARKS))  # its sibling vllm_engines.py
    spec = importlib.util.spec_from_file_location("vllm_fleet_benchmark", BENCHMARKS / "vllm_fleet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCHMARKS))


class Bodies(http.server.BaseHTTPRequestHandler):
    """GET /n answers n bytes; POST answers a small JSON body."""

    def do_GET(self):
        body = b"x" * int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"matches": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_traffic_counts_every_response_body_by_route(fleet, monkeypatch):
    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", httpx.HTTPTransport.handle_request)  # restored after
    for name in ("begin", "readinto", "read"):
        monkeypatch.setattr(http.client.HTTPResponse, name, getattr(http.client.HTTPResponse, name))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bodies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        traffic = fleet.Traffic()
        traffic.install()
        with httpx.Client() as client:
            assert len(client.get(f"{url}/300000").content) == 300_000
            client.post(f"{url}/api/v1/artifacts/0123456789abcdef0123/chunks", json={})
            with client.stream("GET", f"{url}/1000") as streamed:  # a body read in pieces counts too
                assert sum(len(piece) for piece in streamed.iter_bytes()) == 1000
        objects = ObjectReader(httpx.Client(), "test")  # the chunk GETs of the hosted backend
        assert len(objects.get(f"{url}/5000", memoryview(bytearray(5000)))) == 5000
        assert len(objects.get(f"{url}/700")) == 700
        objects.close()
        assert traffic.bytes == 300_000 + 15 + 1000 + 5000 + 700
        assert traffic.responses == 5
        assert traffic.by_route == {"chunk GET": 306_700, "POST /api/v1/artifacts/ID/chunks": 15}
        traffic.reset()
        assert (traffic.bytes, traffic.responses, traffic.by_route) == (0, 0, {})
    finally:
        server.shutdown()
        server.server_close()


def test_the_paced_link_carries_every_byte_and_no_faster_than_its_rate(fleet):
    """``--link-mb-per-s``: the proxy in front of a real HTTP server hands each body over byte for
    byte, two at once sharing the one link; the time is only checked from below (a busy machine can
    only make it slower than the link)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bodies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = services.free_port()
    try:
        with fleet.paced(f"http://127.0.0.1:{server.server_address[1]}", port, 20.0) as url:
            assert url == f"http://127.0.0.1:{port}"
            began = time.perf_counter()
            with ThreadPoolExecutor(2) as pool, httpx.Client() as client:
                bodies = list(pool.map(lambda n: client.get(f"{url}/{n}").content, (1_000_000, 1_000_000)))
                assert client.post(f"{url}/api/v1/prefix/lookup", json={}).json() == {"matches": []}
            assert bodies == [b"x" * 1_000_000] * 2
            assert time.perf_counter() - began >= 2_000_000 / 20e6  # 0.1 s: both bodies through one link
    finally:
        server.shutdown()
        server.server_close()


def test_load_figures_read_the_requests_kv_transfer_params(fleet):
    params = {
        "kvcdn_matched_tokens": 512,
        "kvcdn_loaded_tokens": 512,
        "kvcdn_chunks_memory": 1,
        "kvcdn_chunks_disk": 0,
        "kvcdn_chunks_remote": 2,
        "kvcdn_bytes_fetched": 23_592_960,
    }
    assert fleet.load_figures(params) == {
        "loaded_tokens": 512,
        "chunks_memory": 1,
        "chunks_disk": 0,
        "chunks_remote": 2,
        "bytes_fetched": 23_592_960,
    }
    assert fleet.load_figures({})["loaded_tokens"] == 0  # a request the connector loaded nothing for


def test_lookup_times_read_the_connectors_per_request_line(fleet):
    lines = [
        "kvcdn: request 1-a8bf7ef8: store lookup 45.3 ms (1.7 ms CPU here), 512 tokens matched",
        "kvcdn: request 1-a8bf7ef8 loaded 512 tokens of 'document' (chunks: 0 memory, 0 disk, 2 remote; "
        "23592960 bytes fetched)",
    ]
    assert fleet.lookup_ms(lines) == [45.3]
    assert fleet.lookup_cpu_ms(lines) == [1.7]


def run(ttft: float, fetched: int = 0, loaded: int = 0, http: int = 0) -> dict:
    return {
        "ttft_s": ttft,
        "load": {"loaded_tokens": loaded, "bytes_fetched": fetched},
        "http_body_bytes": http,
    }


def results(remote: dict) -> dict:
    return {
        "apc_hit": [run(0.2), run(0.1), run(0.3)],  # median 0.2 s
        "hosted_prefix_chunk_bytes": 1000,
        "hosted_remote": remote,
        "local_remote": run(0.4, fetched=1000, loaded=2048),
        "hosted_disk_first": run(0.21),
        "hosted_disk_later": [run(0.19), run(0.2), run(0.5)],
        "hosted_memory": [run(0.2)],
        "lookup_hosted": {"p50_ms": 4.0},
        "link_hosted": {"mb_per_s": 0.001},  # 1,000 bytes a second: 1,050 bytes take 1.05 s
        "link_local": {"mb_per_s": 0.01},
        "conversation_store": {"stored_bytes": 125, "final_own_bytes": 100},
        "conversation_save": {"median_later_s": 1.05},
        "conversation_no_connector": {"median_later_s": 1.0},
    }


def test_goals_from_a_run(fleet):
    g = fleet.goals(results(run(1.2, fetched=1050, loaded=2048, http=1200)))
    assert g["fetch_ratio"] == pytest.approx(1.05) and g["http_ratio"] == pytest.approx(1.2)
    assert g["hosted_remote_goal_s"] == pytest.approx(1.1 * 0.2 + 1.05)
    assert g["tier_first_x_apc"] == pytest.approx(1.05) and g["tier_later_x_apc"] == pytest.approx(1.0)
    assert g["stored_ratio"] == pytest.approx(1.25) and g["save_ttft_change"] == pytest.approx(0.05)
    assert g["met"] == {
        "fetch <= 1.1x prefix chunk bytes": True,
        "all HTTP bodies <= 1.1x prefix chunk bytes": False,
        "hosted lookup p50 <= 5 ms": True,
        "tier first request <= 1.1x APC": True,
        "tier later requests <= 1.0x APC": True,
        "hosted remote <= 1.1x APC + transfer": True,
        "local remote <= 1.1x APC + transfer": False,  # 0.4 s against 0.22 + 0.1 (1,000 bytes at 10,000 a second)
        "stored <= 1.3x final conversation": True,
        "save on TTFT within 10% of off": True,
    }


def test_a_request_that_loaded_nothing_does_not_meet_the_fetch_goal(fleet):
    g = fleet.goals(results(run(0.2)))  # fetched 0 bytes because nothing was loaded: no ratio of 0
    assert g["fetch_ratio"] == math.inf
    assert g["met"]["fetch <= 1.1x prefix chunk bytes"] is False


def test_the_conversation_only_report_prints_its_ratios(fleet, capsys):
    on = {"ttft_s": [2.0, 1.1, 1.1], "median_later_s": 1.1, "mean_later_s": 1.1}
    off = {"ttft_s": [2.0, 1.0, 1.0], "median_later_s": 1.0, "mean_later_s": 1.0}
    store = {"stored_bytes": 125, "final_own_bytes": 100, "final_tokens": 300, "saved_artifacts": 2, "summary": []}
    r = {"conversation_save": on, "conversation_no_connector": off, "conversation_store": store}
    r.update({"threads": 1, "load_average_start": (7.0, 0, 0), "load_average_end": (8.0, 0, 0), "profiles": {}})
    fleet.report_conversation(r, type("Args", (), {"json": None, "format": "table"})())
    assert r["goals"] == {"stored_ratio": pytest.approx(1.25), "save_ttft_change": pytest.approx(0.1)}
    out = capsys.readouterr().out
    assert "save on 1.100 s (+10.0%)" in out and "= 1.250" in out and "load 7.0 -> 8.0" in out


def test_the_cpu_meter_counts_this_process_another_and_the_machine(fleet):
    """A request's CPU: this process's spin shows in ``cpu_ms``, a child's in ``others_cpu_ms``, and
    both in the machine's busy time (lower bounds only: a busy machine adds, never takes away)."""
    import subprocess
    import time

    meter = fleet.CpuMeter()
    spin = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\nsys.stdin.read()"
    spinner = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    meter.others = [spinner.pid]
    before, began = meter.read(), time.perf_counter()
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    assert spinner.stdout.readline().strip() == "spun"
    wall = time.perf_counter() - began
    spent = fleet.CpuMeter.spent(before, meter.read(), wall)
    spinner.communicate("")
    assert spent["cpu_ms"] >= 200 and spent["others_cpu_ms"] >= 250  # the child's, in 10 ms ticks
    assert spent["cores_busy"] * wall >= 0.4  # both spins, in ticks
    assert meter.read()[1] == 0.0  # gone now: it costs nothing more
