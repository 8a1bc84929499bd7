"""``kvcdn serve --infer-engine URL``: what the server does before and around the vLLM server it
hands ``infer`` to. The engine here is a recording HTTP server (the real vLLM engine answering
through this path is proven in plugins/kvcdn-vllm/tests/test_vllm_engine.py, part 6): it records
what it was sent and refuses it, so each test sees exactly which requests reached it.

- limits (``n``, the question's bytes and tokens) and a foreign private artifact are refused
  before any request reaches the engine, with the codes the in-process engine gives;
- what reaches it: the artifact's token ids then the question's, ``n`` tokens exactly, and a grant
  holding this artifact's record and one working signed URL per object of it, nothing else;
- an artifact computed in another dtype than the server's (the engine's) is the in-process
  engine's ``422 dtype_mismatch`` before the engine is asked; a quantized one, which the engine's
  connector cannot load, is answered by the in-process engine, as without the option;
- an engine that refuses is a 502 ``engine_unavailable``, one that is down too, never a 500;
- a client that leaves while the engine still computes the prompt closes the engine's request.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

import httpx
import pytest

from kvcdn_core import artifact
from kvcdn_core.store.pack import digest_of
from tests.support import services
from tests.support.budget import budget
from tests.support.hosted import API, bearer, mint_key

pytestmark = pytest.mark.hosted
QUESTION = " What did the keeper write during the storm?"


class Recorder(http.server.ThreadingHTTPServer):
    """Records each POST body, answers 503 with an OpenAI-style error."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.streaming = threading.Event()  # a request for 3 tokens is being "computed"
        self.closed = threading.Event()  # ... and the service closed its connection

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 - the handler's own self
                length = int(handler.headers.get("Content-Length") or 0)
                self.bodies.append(json.loads(handler.rfile.read(length)))
                if self.bodies[-1]["max_tokens"] == 3:  # an engine still on the prompt: no token yet
                    handler.send_response(200)
                    handler.send_header("Content-Type", "text/event-stream")
                    handler.end_headers()
                    handler.wfile.flush()
                    self.streaming.set()
                    if handler.connection.recv(1) == b"":
                        self.closed.set()
                    return
                reply = json.dumps({"error": {"message": "engine overloaded\nsecond line"}}).encode()
                handler.send_response(503)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(reply)))
                handler.end_headers()
                handler.wfile.write(reply)

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture(scope="module")
def engine_setup(tmp_path_factory, qwen3_dir, qwen3_artifact):
    recorder = Recorder()
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    tmp = tmp_path_factory.mktemp("infer-engine")
    engine = f"http://127.0.0.1:{recorder.server_address[1]}"
    args = ["--models", str(qwen3_dir), "--infer-engine", engine]
    env = {"KVCDN_INFER_MAX_NEW_TOKENS": "16", "KVCDN_INFER_MAX_QUESTION_TOKENS": "32", "KVCDN_ISSUER_URL": ""}
    try:
        with services.kvcdn_server(tmp / "home", args, env) as server, pytest.MonkeyPatch.context() as mp:
            mp.delenv("KVCDN_ISSUER_URL", raising=False)
            mp.setenv("KVCDN_TELEMETRY", "0")
            keys = {org: mint_key(server.url, server.admin_secret(), org) for org in ("mine", "other")}
            from kvcdn_hosted.storage import HostedStorage

            ids = {}
            for org, key in keys.items():
                mp.setenv("KVCDN_API_KEY", key)
                backend = HostedStorage.from_uri("kvcdn+" + server.url)
                ids[org] = backend.upload_chunked(qwen3_artifact, "sample").artifact_id
                backend.close()
            yield server, recorder, keys, ids
    finally:
        recorder.shutdown()
        recorder.server_close()


def infer(server, key: str, artifact_id: str, question: str = QUESTION, n: int = 4) -> httpx.Response:
    url = f"{server.url}{API}/artifacts/{artifact_id}/infer"
    return httpx.post(url, headers=bearer(key), json={"question": question, "n": n}, timeout=300)


def test_limits_and_foreign_artifacts_never_reach_the_engine(engine_setup):
    server, recorder, keys, ids = engine_setup
    before = len(recorder.bodies)
    refused = [
        (infer(server, keys["mine"], ids["mine"], n=17), 422, "too_many_tokens"),
        (infer(server, keys["mine"], ids["mine"], question="x" * 600), 413, "question_too_long"),
        (infer(server, keys["mine"], ids["mine"], question=" storm" * 40), 413, "question_too_long"),
    ]
    for reply, status, code in refused:
        assert (reply.status_code, reply.json()["error"]) == (status, code), reply.text
    foreign = infer(server, keys["mine"], ids["other"])
    missing = infer(server, keys["mine"], "00000000-0000-4000-8000-000000000000")
    assert foreign.status_code == missing.status_code == 404 and foreign.json() == missing.json()
    assert len(recorder.bodies) == before


def test_the_engine_gets_the_prompt_and_a_grant_for_this_artifact_only(engine_setup, qwen3_dir, qwen3_artifact):
    from transformers import AutoTokenizer

    server, recorder, keys, ids = engine_setup
    before = len(recorder.bodies)
    reply = infer(server, keys["mine"], ids["mine"], n=5)
    assert reply.status_code == 502 and reply.json()["error"] == "engine_unavailable", reply.text
    assert reply.json()["message"] == "the inference engine refused the request (HTTP 503: engine overloaded)"
    (sent,) = recorder.bodies[before:]
    question = AutoTokenizer.from_pretrained(qwen3_dir)(QUESTION, add_special_tokens=False)["input_ids"]
    assert sent["prompt"] == artifact.read_token_ids(qwen3_artifact) + question
    assert (sent["max_tokens"], sent["temperature"], sent["ignore_eos"], sent["stream"]) == (5, 0, True, True)
    grant = sent["kv_transfer_params"]["kvcdn_grant"]
    chunks = httpx.post(f"{server.url}{API}/artifacts/{ids['mine']}/chunks", headers=bearer(keys["mine"])).json()
    assert grant["record"] == chunks["record"]
    assert set(grant["urls"]) == {o["digest"] for o in chunks["objects"]}
    for digest, url in grant["urls"].items():  # each URL reads its object, with no credential
        got = httpx.get(url)
        assert got.status_code == 200 and digest_of(got.content) == digest


def upload_chunked(server, key: str, path, monkeypatch) -> str:
    from kvcdn_hosted.storage import HostedStorage

    monkeypatch.delenv("KVCDN_ISSUER_URL", raising=False)
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    monkeypatch.setenv("KVCDN_API_KEY", key)
    backend = HostedStorage.from_uri("kvcdn+" + server.url)
    try:
        return backend.upload_chunked(path, path.stem).artifact_id
    finally:
        backend.close()


def test_an_artifact_in_another_dtype_is_refused_before_the_engine(engine_setup, qwen3_dir, tmp_path, monkeypatch):
    """Before, the engine was asked, its connector skipped the record and vLLM recomputed it all."""
    from kvcdn_core import runtime
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    server, recorder, keys, _ = engine_setup
    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="bfloat16")
    runtime.generate(session, SAMPLE_TEXT, tmp_path / "bf16.kv", chunk=100, progress=False)
    artifact_id = upload_chunked(server, keys["mine"], tmp_path / "bf16.kv", monkeypatch)
    before = len(recorder.bodies)
    reply = infer(server, keys["mine"], artifact_id)
    assert (reply.status_code, reply.json()["error"]) == (422, "dtype_mismatch"), reply.text
    assert reply.json()["message"] == "the artifact was computed in bfloat16; this server computes in float32"
    assert len(recorder.bodies) == before


def test_a_quantized_artifact_is_answered_by_the_in_process_engine(
    engine_setup, qwen3_artifact, tmp_path, cli, monkeypatch
):
    """The engine's connector loads unquantized records only; the in-process engine dequantizes."""
    server, recorder, keys, _ = engine_setup
    quantized = tmp_path / "int8.kv"
    assert cli("quant", "--kv-path", qwen3_artifact, "--scheme", "int8", "-o", quantized).exit_code == 0
    artifact_id = upload_chunked(server, keys["mine"], quantized, monkeypatch)
    before = len(recorder.bodies)
    reply = infer(server, keys["mine"], artifact_id)
    assert reply.status_code == 200, reply.text
    local = cli(
        *("continue", "--kv-path", quantized, "--question", QUESTION, "--n", "4"),
        *("--device", "cpu", "--dtype", "float32", "--format", "json", "-q"),
    )
    assert local.exit_code == 0, local.output
    assert reply.json()["tokens"] == json.loads(local.stdout)["token_ids"]
    assert len(recorder.bodies) == before


def test_an_engine_that_is_down_is_a_502(tmp_path, qwen3_dir, qwen3_artifact, monkeypatch):
    nobody = f"http://127.0.0.1:{services.free_port()}"
    with services.kvcdn_server(tmp_path, ["--models", str(qwen3_dir), "--infer-engine", nobody]) as server:
        key = mint_key(server.url, server.admin_secret(), "down")
        monkeypatch.delenv("KVCDN_ISSUER_URL", raising=False)
        monkeypatch.setenv("KVCDN_TELEMETRY", "0")
        monkeypatch.setenv("KVCDN_API_KEY", key)
        from kvcdn_hosted.storage import HostedStorage

        backend = HostedStorage.from_uri("kvcdn+" + server.url)
        artifact_id = backend.upload_chunked(qwen3_artifact, "sample").artifact_id
        backend.close()
        reply = infer(server, key, artifact_id)
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"] == "engine_unavailable"
        assert reply.json()["message"] == "the inference engine did not answer (ConnectError)"
        assert "Traceback" not in "".join(server.log)


def test_a_client_that_leaves_closes_the_engine_request_before_any_token(engine_setup):
    server, recorder, keys, ids = engine_setup
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"question": QUESTION, "n": 3}).encode()
    request = (
        f"POST {API}/artifacts/{ids['mine']}/infer HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {keys['mine']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request)
        assert recorder.streaming.wait(budget(120)), "the request never reached the engine"
    # the service notices the client left and closes the engine's stream, with no token sent
    assert recorder.closed.wait(budget(60)), "the engine's request was not closed"
    assert "Traceback" not in "".join(server.log)
