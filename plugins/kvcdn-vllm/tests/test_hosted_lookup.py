"""The connector's lookup and chunk fetch against a real ``kvcdn serve`` (SQLite, local storage):
the backend is chosen by its declared ``prefix_lookup``; a lookup is one request to the index, whose
answer carries the hit's chunk grant (one more, to the chunks route, only when the server ranked
another match first and no kept grant serves); a worker fetches exactly
the planned chunks it lacks, nothing else; a foreign private artifact is not found; an artifact
stored whole is skipped with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from kvcdn_vllm import lookup
from kvcdn_vllm.tier import MEMORY, REMOTE, ChunkTier

from kvcdn_core import artifact
from tests.support import services
from tests.support.hosted import API, mint_key
from tests.support.storefiles import write_kinds

FINGERPRINT = {"architecture": "Qwen3ForCausalLM", "config_sha256": "c" * 64, "tokenizer_sha256": None}
ROOT = lookup.engine_root(FINGERPRINT, "float32")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One ``kvcdn serve``, an API key for each of two orgs."""
    tmp = tmp_path_factory.mktemp("hosted-lookup")
    with services.kvcdn_server(tmp / "home") as server:
        keys = {org: mint_key(server.url, server.admin_secret(), org) for org in ("acme", "beta")}
        yield server, keys, tmp


class Traffic:
    """Every response the backend received: (method, path, body bytes), from its API client (httpx)
    and from its reader of signed object URLs (the chunk GETs: :mod:`kvcdn_hosted.objects`)."""

    def __init__(self, backend):
        self.seen: list[tuple[str, str, int]] = []
        backend.client.http.event_hooks["response"].append(self._hook)
        objects = backend.client.objects
        get = objects.get

        def recorded(url: str, into=None, landed=None):
            body = get(url, into, landed)  # all the bytes the response carried (never cut to fit ``into``)
            self.seen.append(("GET", urlsplit(url).path, 0 if body is None else len(body)))
            return body

        objects.get = recorded

    def _hook(self, response: httpx.Response) -> None:
        response.read()
        self.seen.append((response.request.method, response.request.url.path, len(response.content)))

    def take(self) -> list[tuple[str, str, int]]:
        seen, self.seen = self.seen, []
        return seen


def as_org(monkeypatch, server, key: str) -> lookup.Lookup:
    for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    monkeypatch.setenv("KVCDN_API_KEY", key)
    return lookup.open_lookup("kvcdn+" + server.url, ROOT, WARNINGS.append)


WARNINGS: list[str] = []


@pytest.fixture(autouse=True)
def _warnings():
    WARNINGS.clear()
    yield


def upload(finder, tmp, name: str, tokens: int, seed: int, chunked: bool = True, visibility: str = "private"):
    path = tmp / f"{name}.kv"
    tensors = write_kinds(path, ["full_attention"] * 3, tokens, seed=seed)
    if chunked:
        artifact_id = finder.backend.upload_chunked(path, name, visibility).artifact_id
    else:
        artifact_id = finder.backend.upload(path, name, visibility).artifact_id
    return tensors, artifact_id


def put(finder, tmp, name: str, prefix, tokens: int, seed: int) -> str:
    """Upload by chunks an artifact of ``tokens`` tokens that starts with the token ids ``prefix``."""
    path = tmp / f"{name}.kv"
    write_kinds(path, ["full_attention"] * 3, tokens, seed=seed, prefix_of={artifact.TOKEN_IDS: prefix})
    return finder.backend.upload_chunked(path, name).artifact_id


def test_lookup_and_fetch_move_only_the_planned_chunks(served, monkeypatch):
    server, keys, tmp = served
    finder = as_org(monkeypatch, server, keys["acme"])
    assert isinstance(finder, lookup.IndexLookup)  # chosen by the declared capability
    tensors, doc_id = upload(finder, tmp, "doc", 700, seed=1)
    prompt = tensors[artifact.TOKEN_IDS].tolist()[:600] + [7, 8, 9]

    traffic = Traffic(finder.backend)
    match = finder.lookup(prompt)
    assert match is not None and (match.name, match.prefix_tokens) == ("doc", 600)
    seen = traffic.take()
    # one request: the index (chain keys), its answer carrying the hit's chunk record and URLs
    assert [(m, p) for m, p, _ in seen] == [("POST", f"{API}/prefix/lookup")]
    # again: the lookup names the grant it holds, and the answer names it back without the record
    again = finder.lookup(prompt)
    assert again is not None and (again.record, again.locations) == (match.record, match.locations)
    seen_again = traffic.take()
    assert [(m, p) for m, p, _ in seen_again] == [("POST", f"{API}/prefix/lookup")]
    assert seen_again[0][2] < seen[0][2] - len(match.record.to_json())

    plan = lookup.plan(match.record, 128, 512, match.locations)
    assert [(p.start, p.tokens) for p in plan.parts] == [(0, 256), (256, 256)]
    assert {d for d, _ in plan.locations} == {p.digest for p in plan.parts}

    # a worker: its own backend, told the plan's locations; only the two planned objects move
    worker = as_org(monkeypatch, server, keys["acme"])
    assert isinstance(worker, lookup.IndexLookup)
    moved = Traffic(worker.backend)
    worker.locate(plan)
    tier = ChunkTier(worker.fetch, 1 << 20, 0, None, WARNINGS.append)
    got = [(p, tier.get(p.digest, p.bytes)) for p in plan.parts]
    assert [where for _, (_, where) in got] == [REMOTE, REMOTE]
    fetched = moved.take()
    assert [m for m, _, _ in fetched] == ["GET", "GET"]
    assert sum(size for _, _, size in fetched) == sum(p.bytes for p in plan.parts)
    out = lookup.slices(plan, [(p, data) for p, (data, _) in got], 128, 512)
    for i in range(3):
        for role in ("key", "value"):
            name = f"layers.{i}.{role}"
            assert torch.equal(out[name], tensors[name][0, :, 128:512])
    # the same plan again: from memory, no request at all
    assert [tier.get(p.digest, p.bytes)[1] for p in plan.parts] == [MEMORY, MEMORY]
    assert moved.take() == []
    assert WARNINGS == []


def test_a_foreign_private_artifact_is_not_found(served, monkeypatch):
    server, keys, tmp = served
    beta = as_org(monkeypatch, server, keys["beta"])
    tensors, _ = upload(beta, tmp, "secret", 600, seed=2)
    prompt = tensors[artifact.TOKEN_IDS].tolist()[:520] + [1, 2]
    found = beta.lookup(prompt)
    assert found is not None and found.name == "secret"  # its owner finds it
    acme = as_org(monkeypatch, server, keys["acme"])
    assert acme.lookup(prompt) is None
    assert WARNINGS == []


def test_an_artifact_stored_whole_is_skipped_with_one_line(served, monkeypatch):
    server, keys, tmp = served
    finder = as_org(monkeypatch, server, keys["acme"])
    tensors, _ = upload(finder, tmp, "whole", 600, seed=3, chunked=False)
    prompt = tensors[artifact.TOKEN_IDS].tolist()[:520] + [1, 2]
    traffic = Traffic(finder.backend)
    assert finder.lookup(prompt) is None and finder.lookup(prompt) is None
    assert WARNINGS == ["skipping stored artifact 'whole': it is stored whole, not by chunks"]
    assert not any("download" in path or m == "GET" for m, path, _ in traffic.take())  # never downloaded


def test_an_unreachable_service_is_a_miss_with_one_line(monkeypatch):
    monkeypatch.setenv("KVCDN_API_KEY", "kv_" + "0" * 64)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    finder = lookup.open_lookup(f"kvcdn+http://127.0.0.1:{services.free_port()}", ROOT, WARNINGS.append)
    assert finder.lookup([1, 2, 3] * 200) is None and finder.lookup([1, 2, 3] * 200) is None
    assert len(WARNINGS) == 1 and WARNINGS[0].startswith("prefix lookup in the store failed: ")


def test_a_refused_lookup_is_one_attempt_with_no_backoff(monkeypatch):
    """The lookup runs on the scheduler's step: a service that refuses connections costs one
    attempt and no backoff wait (the hosted client's default is four attempts with backoff)."""
    from kvcdn_hosted import client

    waits: list[float] = []
    monkeypatch.setattr(client.time, "sleep", waits.append)
    monkeypatch.setenv("KVCDN_API_KEY", "kv_" + "0" * 64)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    finder = lookup.open_lookup(f"kvcdn+http://127.0.0.1:{services.free_port()}", ROOT, WARNINGS.append)
    assert finder.lookup([1, 2, 3] * 200) is None and finder.lookup([1, 2, 3] * 200) is None
    assert waits == [] and len(WARNINGS) == 1


def test_a_service_that_does_not_answer_pauses_lookups_doubling(monkeypatch):
    """A service that takes connections and never answers: the lookup times out once, then the
    scheduler asks nothing until the pause (1 s, then 2 s: an injected clock) has passed."""
    import socket
    import threading

    from kvcdn_hosted import client

    monkeypatch.setattr(client, "IMPATIENT_TIMEOUT_S", 0.3)
    monkeypatch.setenv("KVCDN_API_KEY", "kv_" + "0" * 64)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(8)], daemon=True).start()
    now = [0.0]
    backend = lookup.open_lookup(f"kvcdn+http://127.0.0.1:{silent.getsockname()[1]}", ROOT, WARNINGS.append).backend
    finder = lookup.IndexLookup(backend, ROOT, WARNINGS.append, clock=lambda: now[0])
    prompt = [1, 2, 3] * 200
    try:
        seen = []
        for t in (0.0, 0.5, 1.5, 3.0, 3.6):
            now[0] = t
            assert finder.lookup(prompt) is None
            seen.append(len(held))
        # asked at 0 (pause to 1), skipped at 0.5, asked at 1.5 (pause to 3.5), skipped at 3.0, asked at 3.6
        assert seen == [1, 1, 2, 2, 3]
        assert len(WARNINGS) == 1 and "lookups pause after each timeout" in WARNINGS[0]
    finally:
        silent.close()
        for s in held:
            s.close()


def test_a_grant_the_client_would_not_pick_costs_one_more_request_then_is_kept(served, monkeypatch):
    """Two artifacts share the query's first chunk and the first 16 tokens of its second; the
    shorter shares 20 tokens of it, the longer 30. To 16 tokens they tie, so the server grants the
    shorter (fewest tokens first), and the client, whose refinement to the token picks the longer,
    asks the chunks route for it: two requests. The same prompt again: its grant is kept, one
    request, until its URLs near expiry (an injected clock)."""
    import time

    from tests.support.clock import ManualClock

    server, keys, tmp = served
    opened = as_org(monkeypatch, server, keys["acme"])
    clock = ManualClock(time.time())
    finder = lookup.IndexLookup(opened.backend, ROOT, WARNINGS.append, clock=clock)
    ids = write_kinds(tmp / "tie.kv", ["full_attention"], 256 + 30, seed=5)[artifact.TOKEN_IDS]
    put(finder, tmp, "short", ids[:276], 256 + 100, seed=6)
    long_id = put(finder, tmp, "long", ids[:286], 256 + 200, seed=7)
    prompt = ids[:286].tolist() + [3] * 20
    traffic = Traffic(finder.backend)
    chunks_route = ("POST", f"{API}/artifacts/{long_id}/chunks")

    first = finder.lookup(prompt)
    assert first is not None and (first.name, first.prefix_tokens) == ("long", 286)
    assert [(m, p) for m, p, _ in traffic.take()] == [("POST", f"{API}/prefix/lookup"), chunks_route]
    again = finder.lookup(prompt)
    assert again is not None and again.record == first.record and again.locations == first.locations
    assert [(m, p) for m, p, _ in traffic.take()] == [("POST", f"{API}/prefix/lookup")]
    clock.advance(3600 - lookup.GRANT_MARGIN_S + 1)
    assert finder.lookup(prompt) is not None
    assert [(m, p) for m, p, _ in traffic.take()] == [("POST", f"{API}/prefix/lookup"), chunks_route]
    assert WARNINGS == []


def test_the_server_ranks_by_the_query_steps_and_grants_the_longer_match(served, monkeypatch):
    """The longer of two artifacts shares 40 tokens of the query's second chunk (two 16-token
    steps), the shorter 20 (one): the server's grant is the longer one, though it has more tokens,
    so the lookup is one request."""
    server, keys, tmp = served
    finder = as_org(monkeypatch, server, keys["acme"])
    ids = write_kinds(tmp / "step.kv", ["full_attention"], 256 + 40, seed=8)[artifact.TOKEN_IDS]
    put(finder, tmp, "s20", ids[:276], 256 + 100, seed=9)
    put(finder, tmp, "l40", ids[:296], 256 + 200, seed=10)
    traffic = Traffic(finder.backend)
    match = finder.lookup(ids[:296].tolist() + [6] * 10)
    assert match is not None and (match.name, match.prefix_tokens) == ("l40", 296)
    assert [(m, p) for m, p, _ in traffic.take()] == [("POST", f"{API}/prefix/lookup")]
    assert WARNINGS == []


def test_a_backend_without_the_grant_in_its_lookup_costs_two_requests(served, monkeypatch):
    """A backend that answers prefix lookups but cannot put the grant in the answer (a third-party
    one written before it could): the lookup, then the hit's chunks route, as before."""
    server, keys, tmp = served
    opened = as_org(monkeypatch, server, keys["acme"])

    class Plain:
        def prefix_lookup(self, *args):
            return opened.backend.prefix_lookup(*args)

        def hit_chunks(self, hit):
            return opened.backend.hit_chunks(hit)

    finder = lookup.IndexLookup(Plain(), ROOT, WARNINGS.append)  # type: ignore[arg-type]
    tensors, doc_id = upload(opened, tmp, "plain", 600, seed=11)
    traffic = Traffic(opened.backend)
    match = finder.lookup(tensors[artifact.TOKEN_IDS].tolist()[:520] + [5, 6])
    assert match is not None and (match.name, match.prefix_tokens) == ("plain", 520)
    assert [(m, p) for m, p, _ in traffic.take()] == [
        ("POST", f"{API}/prefix/lookup"),
        ("POST", f"{API}/artifacts/{doc_id}/chunks"),
    ]
    assert WARNINGS == []


def test_the_object_get_benchmark_runs_both_readers_on_a_real_server():
    """benchmarks/object_get.py on a small artifact: both readers fetch every chunk into place."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "object_get.py"
    args = ["--tokens", "512", "--layers", "4", "--reps", "1"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| httpx", "| ObjectReader"))]
    assert [r.split("|")[1:3] for r in rows] == [
        [" httpx ", " 1 "],
        [" ObjectReader ", " 1 "],
        [" httpx ", " 4 "],
        [" ObjectReader ", " 4 "],
    ]


def test_a_read_chunk_written_before_landed_existed_still_serves_loads():
    """A prefix-lookup backend whose ``read_chunk(location, into=None)`` predates ``landed`` is called
    as it was (its chunk then read whole); one that takes ``landed`` is told as bytes land."""
    digest, url = "d" * 64, "http://objects.example/o"

    class Before:
        def read_chunk(self, location, into=None):
            into[:] = b"x" * len(into)
            return into

    class After(Before):
        def read_chunk(self, location, into=None, landed=None):
            super().read_chunk(location, into)
            landed(len(into))
            return into

    for backend, told in ((Before(), []), (After(), [4])):
        finder = lookup.IndexLookup(backend, "r" * 64, [].append)
        finder.locate(lookup.ChunkPlan("doc", (), (), ((digest, url),)))
        calls: list[int] = []
        into = memoryview(bytearray(4))
        assert finder.fetch(digest, into, calls.append) is into and bytes(into) == b"xxxx"
        assert calls == told
