"""Inference under a busy or hostile tenant (issue 13, item 3), over real HTTP.

The app runs in a uvicorn thread of the test process, so a test can slow the model's forward pass
down (each decode step then takes a known time, as on a big model) and watch the computation: a
request that times out or whose client disconnects must stop within a decode step, one tenant
cannot hold every slot, limits are in tokens and refused before any model work, and only the
server's allow-list and dtype decide what loads.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time

import httpx
import pytest

from tests.support.budget import budget
from tests.support.hosted import API, bearer, sha256_of, write_synthetic_kv

STEP = 0.05  # seconds per forward pass once slowed down
QUESTION = " What did the keeper write during the storm?"


@pytest.fixture
def forward_calls(monkeypatch):
    """Slow every forward pass of every model adapter to STEP seconds; record when each ran."""
    from kvcdn_core import ModelAdapter

    calls: list[float] = []
    real = ModelAdapter.forward

    def slow(self, model, input_ids, cache):
        calls.append(time.monotonic())
        time.sleep(STEP)
        return real(self, model, input_ids, cache)

    monkeypatch.setattr(ModelAdapter, "forward", slow)
    return calls


@pytest.fixture
def serve(monkeypatch, tmp_path, hosted_model):
    """``serve(**env) -> (base_url, app, {org: key})``: a live server on loopback with two orgs."""
    import uvicorn

    from kvcdn_server.apikeys import derive_key
    from kvcdn_server.app import create_app
    from kvcdn_server.command import bind_socket
    from kvcdn_server.config import load_config

    running = []

    def start(**env):
        for name, value in {
            "KVCDN_MODELS": str(hosted_model),
            "KVCDN_INFER_DEVICE": "cpu",
            "KVCDN_API_KEY_ORGS": "acme,beta",
            **env,
        }.items():
            monkeypatch.setenv(name, str(value))
        sock = bind_socket("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setenv("KVCDN_PUBLIC_URL", url)  # signed URLs name the address it listens on
        config = load_config(storage=str(tmp_path / "objects"))
        app = create_app(config)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        running.append((server, thread))
        return url, app, {org: derive_key(config.api_key_seed, org) for org in ("acme", "beta")}

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=budget(10))


def _upload(url: str, key: str, path) -> str:
    r = httpx.post(
        f"{url}{API}/artifacts/upload-url",
        headers=bearer(key),
        json={"name": path.name, "size_bytes": path.stat().st_size, "sha256": sha256_of(path)},
    )
    assert r.status_code == 200, r.text
    plan = r.json()
    assert httpx.put(plan["url"], content=path.read_bytes()).status_code == 200
    r = httpx.post(f"{url}{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=bearer(key))
    assert r.status_code == 200, r.text
    return plan["artifact_id"]


def _infer(url, key, artifact_id, n, question=QUESTION, timeout=None):
    timeout = budget(60.0) if timeout is None else timeout
    return httpx.post(
        f"{url}{API}/artifacts/{artifact_id}/infer",
        headers=bearer(key),
        json={"question": question, "n": n},
        timeout=timeout,
    )


def _wait(condition, limit: float) -> float:
    """Seconds until ``condition()`` held; fails after ``limit``."""
    start, limit = time.monotonic(), budget(limit)
    while not condition():
        assert time.monotonic() - start < limit, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - start


def _assert_stopped(calls: list[float]) -> None:
    """No forward pass starts any more (one already running may finish)."""
    time.sleep(2 * STEP)
    settled = len(calls)
    time.sleep(10 * STEP)
    assert len(calls) == settled, f"{len(calls) - settled} decode steps ran after the cancellation"


def test_a_timed_out_request_stops_and_frees_its_slot(serve, forward_calls, qwen3_artifact):
    url, app, keys = serve(KVCDN_INFER_TIMEOUT="1.5", KVCDN_INFER_CONCURRENCY="1", KVCDN_INFER_PER_TENANT="1")
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    assert _infer(url, keys["acme"], artifact_id, 1).status_code == 200  # model and cache resident
    r = _infer(url, keys["acme"], artifact_id, 256)  # 256 steps: 13 s if nothing stopped it
    answered = time.monotonic()
    assert r.status_code == 504 and r.json()["error"] == "timeout"
    # The cancellation is set before the 504 is sent: at most the step already past its check runs.
    _wait(lambda: app.state.services.inference.slots.in_use() == 0, 5.0)
    _assert_stopped(forward_calls)
    late = [t for t in forward_calls if t > answered]
    assert len(late) <= 1, f"{len(late)} decode steps started after the 504"
    assert _infer(url, keys["acme"], artifact_id, 2).status_code == 200


def test_a_disconnected_client_stops_its_computation(serve, forward_calls, qwen3_artifact):
    url, app, keys = serve(KVCDN_INFER_TIMEOUT="60", KVCDN_INFER_CONCURRENCY="2")
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    assert _infer(url, keys["acme"], artifact_id, 1).status_code == 200
    before = len(forward_calls)
    with pytest.raises(httpx.ReadTimeout):
        _infer(url, keys["acme"], artifact_id, 256, timeout=1.0)  # the client gives up and closes
    _wait(lambda: app.state.services.inference.slots.in_use() == 0, 5.0)  # noticed within a poll (0.2 s) and a step
    _assert_stopped(forward_calls)
    ran = len(forward_calls) - before
    assert ran < 128, f"{ran} of the 256 decode steps ran although the client left after 1 s"


def test_one_tenant_cannot_hold_every_slot(serve, forward_calls, qwen3_artifact, tmp_path):
    url, app, keys = serve(KVCDN_INFER_TIMEOUT="60", KVCDN_INFER_CONCURRENCY="2")  # 1 slot per tenant
    public = shutil.copy(qwen3_artifact, tmp_path / "doc.kv")
    a_id, b_id = _upload(url, keys["acme"], public), _upload(url, keys["beta"], public)
    for key, artifact_id in ((keys["acme"], a_id), (keys["beta"], b_id)):
        assert _infer(url, key, artifact_id, 1).status_code == 200
    engine = app.state.services.inference

    def hog():  # a long request (13 s at least), abandoned after 3 s (more on a busy machine)
        with contextlib.suppress(httpx.ReadTimeout):
            _infer(url, keys["acme"], a_id, 256, timeout=min(budget(3.0), 10.0))

    hogging = threading.Thread(target=hog)
    hogging.start()
    try:
        _wait(lambda: engine.slots.in_use() == 1, 2.5)
        second = _infer(url, keys["acme"], a_id, 4)
        assert second.status_code == 429 and second.json()["error"] == "busy", second.text
        assert "your 1 inference slot" in second.json()["message"]
        other = _infer(url, keys["beta"], b_id, 4)
        assert other.status_code == 200, other.text  # the other tenant still gets the free slot
    finally:
        hogging.join()
    _wait(lambda: engine.slots.in_use() == 0, 5.0)


def test_limits_are_in_tokens_and_refused_before_any_model_work(serve, forward_calls, qwen3_artifact):
    from kvcdn_core import artifact

    tokens = artifact.read_header(qwen3_artifact).token_count
    url, app, keys = serve(
        KVCDN_INFER_MAX_QUESTION_TOKENS="8",
        KVCDN_INFER_MAX_NEW_TOKENS="16",
        KVCDN_INFER_MAX_CONTEXT_TOKENS=str(tokens - 1),
    )
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    r = _infer(url, keys["acme"], artifact_id, 17)
    assert r.status_code == 422 and r.json()["error"] == "too_many_tokens", r.text
    r = _infer(url, keys["acme"], artifact_id, 4)
    assert r.status_code == 422 and r.json()["error"] == "context_too_long", r.text
    assert f"holds {tokens} context tokens" in r.json()["message"]
    assert app.state.services.inference.models.items == {} and forward_calls == []  # no model was even loaded

    url, app, keys = serve(KVCDN_INFER_MAX_QUESTION_TOKENS="8", KVCDN_INFER_MAX_CONTEXT_TOKENS="32768")
    artifact_id = _upload(url, keys["beta"], qwen3_artifact)
    # 36 characters, 9 tokens: the limit counts tokens
    r = _infer(url, keys["beta"], artifact_id, 4, question=" the" * 9)
    assert r.status_code == 413 and r.json()["error"] == "question_too_long", r.text
    assert forward_calls == []
    assert _infer(url, keys["beta"], artifact_id, 4, question=" the" * 2).status_code == 200


def test_the_server_chooses_the_dtype(serve, qwen3_artifact):
    url, app, keys = serve(KVCDN_INFER_DTYPE="bfloat16")
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)  # computed in float32
    r = _infer(url, keys["acme"], artifact_id, 2)
    assert r.status_code == 422 and r.json()["error"] == "dtype_mismatch", r.text
    assert "computed in float32; this server computes in bfloat16" in r.json()["message"]


def test_a_model_in_the_hub_cache_but_not_allowed_is_refused(serve, monkeypatch, tmp_path, hosted_model):
    """Before, any model already in the server's hub cache loaded; now only --models does."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--example--cached" / "snapshots" / ("0" * 40)
    shutil.copytree(hosted_model, snapshot)
    (hub / "models--example--cached" / "refs").mkdir()
    (hub / "models--example--cached" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, app, keys = serve()
    artifact_id = _upload(url, keys["acme"], write_synthetic_kv(tmp_path / "cached.kv", model_id="example/cached"))
    r = _infer(url, keys["acme"], artifact_id, 1)
    assert r.status_code == 422 and r.json()["error"] == "model_not_available", r.text
    assert app.state.services.inference.models.items == {}


def test_resident_caches_stay_within_their_byte_budget(serve, qwen3_artifact, tmp_path):
    from kvcdn_server.inference import tensor_bytes

    url, app, keys = serve()
    first = _upload(url, keys["acme"], qwen3_artifact)
    assert _infer(url, keys["acme"], first, 1).status_code == 200
    ((_, cache, _, _),) = [entry for entry, _ in app.state.services.inference.artifacts.items.values()]
    one = tensor_bytes(cache)
    assert one > 0

    # room for one cache: a second artifact evicts the first
    url, app, keys = serve(KVCDN_INFER_CACHE_BYTES=str(one + one // 2))
    a = _upload(url, keys["acme"], qwen3_artifact)
    b = _upload(url, keys["acme"], shutil.copy(qwen3_artifact, tmp_path / "copy.kv"))
    for artifact_id in (a, b, a):
        assert _infer(url, keys["acme"], artifact_id, 1).status_code == 200
        assert app.state.services.inference.artifacts.resident_bytes() <= one + one // 2
    # a cache larger than the whole budget is refused rather than held per request
    url, app, keys = serve(KVCDN_INFER_CACHE_BYTES=str(one - 1))
    artifact_id = _upload(url, keys["beta"], qwen3_artifact)
    r = _infer(url, keys["beta"], artifact_id, 1)
    assert r.status_code == 413 and r.json()["error"] == "artifact_too_large", r.text


def test_a_quantization_block_that_trips_the_loader_is_422_not_500(serve, qwen3_artifact, tmp_path, cli):
    """The header is valid, but a scheme's own field is not: whatever the loader raises is a 422."""
    import json
    import struct

    from kvcdn_core import artifact
    from tests.support.kvfiles import frame

    quantized = tmp_path / "q.kv"
    assert cli("quant", "--kv-path", qwen3_artifact, "--scheme", "int8", "-o", quantized).exit_code == 0
    raw = quantized.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"][artifact.META_MANIFEST])
    record = manifest["quantization"]["layers"][0]["tensors"]["key"]
    record.update(empty=True, quantized_tokens="many")  # a TypeError deep in the dequantizer
    header["__metadata__"][artifact.META_MANIFEST] = json.dumps(manifest)
    broken = tmp_path / "broken.kv"
    broken.write_bytes(frame(json.dumps(header).encode(), raw[8 + n :]))
    artifact.check_file(broken)  # structurally valid, every hash right
    url, app, keys = serve()
    artifact_id = _upload(url, keys["acme"], broken)
    r = _infer(url, keys["acme"], artifact_id, 2)
    assert r.status_code == 422 and r.json()["error"] == "artifact_incompatible", r.text


def test_the_lru_keeps_within_its_budget_and_keeps_the_newest():
    from kvcdn_server.lru import Lru

    lru = Lru(budget=100, max_items=3)
    for key, cost in (("a", 40), ("b", 40), ("c", 10)):
        lru.put(key, key, cost)
    assert lru.get("a") == "a"  # a is now the most recently used
    lru.put("d", "d", 30)  # 120 > 100: b, the least recently used, goes
    assert list(lru.items) == ["c", "a", "d"] and lru.resident_bytes() == 80
    lru.put("e", "e", 5)  # 4 items > 3: c goes
    assert list(lru.items) == ["a", "d", "e"]
    lru.put("huge", "huge", 500)  # alone over the budget: it stays, everything else goes
    assert list(lru.items) == ["huge"]


# -- issue 26, item 5: limits before any model work, the slot freed with the 504 ------------------


def test_an_over_long_question_is_refused_before_any_model_loads(serve, forward_calls, qwen3_artifact, database_url):
    """Before, a 32,768-character question got 413 only after the model (and artifact) loaded."""
    url, app, keys = serve(KVCDN_DATABASE_URL=database_url)  # default limits: 1024 question tokens: 16 KiB
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    engine = app.state.services.inference
    for question in ("x" * 32768, "é" * 8193):  # 32,768 bytes; 16,386 bytes in 8,193 characters
        r = _infer(url, keys["acme"], artifact_id, 4, question=question)
        assert r.status_code == 413 and r.json()["error"] == "question_too_long", r.text
        assert f"the question is {len(question.encode())} bytes" in r.json()["message"]
    assert engine.models.items == {} and engine.artifacts.items == {} and forward_calls == []
    assert engine.slots.in_use() == 0

    url, app, keys = serve(KVCDN_INFER_MAX_QUESTION_BYTES="24")
    artifact_id = _upload(url, keys["beta"], qwen3_artifact)
    r = _infer(url, keys["beta"], artifact_id, 4, question=" the" * 7)  # 28 bytes
    assert r.status_code == 413 and "at most 24" in r.json()["message"], r.text
    assert app.state.services.inference.models.items == {}
    assert _infer(url, keys["beta"], artifact_id, 4, question=" the" * 6).status_code == 200


@pytest.fixture
def blocked_loads(monkeypatch):
    """Model loads wait for ``release`` (set it to let them finish); ``started`` counts them."""
    from kvcdn_core import runtime

    real = runtime.load_session
    state = {"started": 0, "release": threading.Event()}

    def slow_load(*args, **kwargs):
        state["started"] += 1
        assert state["release"].wait(60), "the test never released the load"
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "load_session", slow_load)
    yield state
    state["release"].set()


def test_a_timeout_during_a_model_load_frees_the_tenants_slot_at_once(
    serve, blocked_loads, qwen3_artifact, database_url
):
    """Before, the 504 came, but the slot stayed taken until the load ended (4.4 s in the audit)."""
    url, app, keys = serve(
        KVCDN_INFER_TIMEOUT="60",
        KVCDN_INFER_CONCURRENCY="1",
        KVCDN_INFER_PER_TENANT="1",
        KVCDN_DATABASE_URL=database_url,
    )
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    engine = app.state.services.inference
    engine.timeout = 0.5  # the load below never ends by itself: this request must time out
    r = _infer(url, keys["acme"], artifact_id, 2)
    assert r.status_code == 504 and r.json()["error"] == "timeout", r.text
    assert engine.slots.in_use() == 0  # at once, while the load goes on
    assert blocked_loads["started"] == 1 and engine.models.items == {}

    engine.timeout = 60.0
    second: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: second.append(_infer(url, keys["acme"], artifact_id, 2)))
    waiting.start()
    try:
        _wait(lambda: engine.slots.in_use() == 1 or second, 10.0)
        assert not second, second[0].text  # admitted: not answered 429
    finally:
        blocked_loads["release"].set()  # the first request's load finishes for the cache
        waiting.join()
    assert second[0].status_code == 200, second[0].text
    assert blocked_loads["started"] == 1  # the second request used the model the first one loaded


# -- issue 26, item 6: fair turns on the model ------------------------------------------------------


def test_a_light_tenant_computes_between_the_steps_of_a_long_request(
    serve, forward_calls, monkeypatch, qwen3_artifact, tmp_path
):
    """B's request takes every turn from the moment it waits, until it is done; A's long one yields.

    Each turn is charged one STEP on a clock that only the forward passes move, so who used more is
    exact, however busy the machine is.
    """
    from kvcdn_core import ModelAdapter

    url, app, keys = serve(KVCDN_INFER_TIMEOUT="60", KVCDN_INFER_CONCURRENCY="2")
    engine = app.state.services.inference
    now = [0.0]
    engine.turns.clock = lambda: now[0]
    threads: list[int] = []
    stop_a = threading.Event()
    slowed = ModelAdapter.forward

    def counted(self, model, input_ids, cache):
        if stop_a.is_set() and threading.get_ident() == threads[0]:
            raise RuntimeError("the test ends A's request here")  # answered 422; A's slot freed
        threads.append(threading.get_ident())
        now[0] += STEP
        return slowed(self, model, input_ids, cache)

    monkeypatch.setattr(ModelAdapter, "forward", counted)
    public = shutil.copy(qwen3_artifact, tmp_path / "doc.kv")
    a_id, b_id = _upload(url, keys["acme"], public), _upload(url, keys["beta"], public)
    for key, artifact_id in ((keys["acme"], a_id), (keys["beta"], b_id)):
        assert _infer(url, key, artifact_id, 1).status_code == 200  # loaded; each tenant used one turn
    del threads[:]
    answers: list[httpx.Response] = []
    flood = threading.Thread(target=lambda: answers.append(_infer(url, keys["acme"], a_id, 256)))
    flood.start()
    try:
        _wait(lambda: len(threads) >= 10, 20.0)  # A's long request is well under way
        assert _infer(url, keys["beta"], b_id, 4).status_code == 200  # 4 forward passes
        after_b = len(threads)
        _wait(lambda: len(threads) > after_b, 20.0)  # and A goes on
    finally:
        stop_a.set()
        flood.join()
    assert answers[0].status_code == 422, answers[0].text
    a = threads[0]
    b_steps = [i for i, ident in enumerate(threads) if ident != a]
    assert len(b_steps) == 4 and b_steps[0] >= 10, threads
    assert b_steps == list(range(b_steps[0], b_steps[0] + 4)), f"A computed between B's steps: {threads}"
    _wait(lambda: engine.slots.in_use() == 0, 5.0)


# -- a composition of several artifacts (issue 28): the same limits, on the sum; the same turns ----


def _compose(url, key, first, more, n=1, **knobs):
    return httpx.post(
        f"{url}{API}/artifacts/{first}/infer",
        headers=bearer(key),
        json={"question": QUESTION, "n": n, "compose": more, **knobs},
        timeout=budget(60.0),
    )


def test_a_composition_counts_the_sum_of_its_tokens_before_any_model_work(serve, forward_calls, qwen3_artifact):
    from kvcdn_core import artifact

    tokens = artifact.read_header(qwen3_artifact).token_count
    url, app, keys = serve(KVCDN_INFER_MAX_CONTEXT_TOKENS=str(2 * tokens - 1))
    artifact_id = _upload(url, keys["acme"], qwen3_artifact)
    r = _compose(url, keys["acme"], artifact_id, [artifact_id])  # each alone fits, the two do not
    assert r.status_code == 422 and r.json()["error"] == "context_too_long", r.text
    assert f"the composed artifacts hold {2 * tokens} context tokens" in r.json()["message"]
    assert app.state.services.inference.models.items == {} and forward_calls == []
    assert _infer(url, keys["acme"], artifact_id, 1).status_code == 200  # one alone is within the limit


def test_a_composition_counts_the_sum_of_its_caches_bytes(serve, qwen3_artifact, tmp_path):
    from kvcdn_server.inference import tensor_bytes

    url, app, keys = serve()
    first = _upload(url, keys["acme"], qwen3_artifact)
    assert _infer(url, keys["acme"], first, 1).status_code == 200
    ((_, cache, _, _),) = [entry for entry, _ in app.state.services.inference.artifacts.items.values()]
    one = tensor_bytes(cache)
    url, app, keys = serve(KVCDN_INFER_CACHE_BYTES=str(2 * one - 1))
    a = _upload(url, keys["acme"], qwen3_artifact)
    b = _upload(url, keys["acme"], shutil.copy(qwen3_artifact, tmp_path / "copy.kv"))
    r = _compose(url, keys["acme"], a, [b])
    assert r.status_code == 413 and r.json()["error"] == "artifact_too_large", r.text
    assert f"the composed artifacts' caches take {2 * one} bytes" in r.json()["message"]
    for artifact_id in (a, b):
        assert _infer(url, keys["acme"], artifact_id, 1).status_code == 200


def test_artifacts_of_different_models_are_not_composed(serve, qwen3_artifact, qwen2_dir, hosted_model, tmp_path):
    from kvcdn_core import runtime

    session = runtime.load_session(str(qwen2_dir), device="cpu", dtype="float32")
    other, _ = runtime.generate(session, "A ledger of ships.", tmp_path / "qwen2.kv", progress=False)
    url, app, keys = serve(KVCDN_MODELS=f"{hosted_model},{qwen2_dir}")
    a, b = _upload(url, keys["acme"], qwen3_artifact), _upload(url, keys["acme"], other)
    for first, more in ((a, b), (b, a)):
        r = _compose(url, keys["acme"], first, [more])
        assert r.status_code == 422 and r.json()["error"] == "models_differ", r.text
        assert f"cannot compose artifact {more} after the first" in r.json()["message"]
        assert str(tmp_path) not in r.json()["message"]


def test_the_passes_of_a_composition_take_turns(serve, monkeypatch, qwen3_artifact, tmp_path):
    """Every forward pass of a composition (the deviation probe, the recomputation, a prefill)
    takes a turn on the model like a decode step, so fair share and cancellation reach it."""
    from kvcdn_core import artifact
    from kvcdn_core.model.defaults import DEFAULT_CHUNK
    from kvcdn_server.turns import Turns

    chunks = -(-artifact.read_header(qwen3_artifact).token_count // DEFAULT_CHUNK)
    url, app, keys = serve()
    steps: list[str] = []
    real = Turns.step

    def counted(self, ticket, cancel=None):
        steps.append(self._running[ticket])
        return real(self, ticket, cancel)

    monkeypatch.setattr(Turns, "step", counted)
    a = _upload(url, keys["acme"], qwen3_artifact)
    b = _upload(url, keys["acme"], shutil.copy(qwen3_artifact, tmp_path / "copy.kv"))
    assert _infer(url, keys["acme"], a, 4).status_code == 200
    plain = len(steps)
    for knobs, more in (
        ({"recompute": 0}, 0),
        ({"recompute": 0.3, "select": "doc-start"}, 1),  # the recomputation
        ({"recompute": 0.3, "select": "deviation"}, 2),  # the probe, then the recomputation
        ({"recompute": 1}, chunks),  # the prefill of the later document, chunk by chunk
    ):
        del steps[:]
        r = _compose(url, keys["acme"], a, [b], n=4, **knobs)
        assert r.status_code == 200, r.text
        assert len(steps) == plain + more, (knobs, steps)


def test_a_cancelled_request_runs_no_composition_pass(qwen3_dir, qwen3_artifact):
    """Cancelled before a composition pass: the turn refuses it, and the model never runs."""
    import dataclasses

    from kvcdn_core import artifact, compose, runtime
    from kvcdn_server.inference import Cancelled, _StopBetweenSteps
    from kvcdn_server.turns import Turns

    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    header = artifact.read_header(qwen3_artifact)
    parts = compose.load_parts(session, [header, header])
    turns, cancel, calls = Turns(), threading.Event(), []
    hook = session.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with turns.request("acme") as ticket:
            stoppable = dataclasses.replace(session, adapter=_StopBetweenSteps(session.adapter, cancel, turns, ticket))
            cancel.set()
            for recompute, rule in ((0.3, "deviation"), (0.3, "doc-start"), (1.0, "deviation")):
                with pytest.raises(Cancelled):
                    compose.compose(stoppable, [header, header], recompute, rule, parts=parts)
    finally:
        hook.remove()
    assert calls == []
