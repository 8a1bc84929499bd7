"""Inference from an uploaded artifact: token-exact with local ``kvcdn continue``, bounded
concurrency (429), the per-request timeout (504), and the model allow-list."""

from __future__ import annotations

import json
import threading

import httpx

from tests.support.budget import budget
from tests.support.hosted import API, bearer, upload, write_synthetic_kv

QUESTION = " What did the keeper write during the storm?"


def local_continue(cli, artifact, question: str, n: int) -> list[int]:
    result = cli(
        "continue", "--kv-path", artifact, "--question", question, "--n", n, "--format", "json", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["token_ids"]


def test_infer_equals_local_continue(local_server, org_key, alice_token, qwen3_artifact, cli):
    expected = local_continue(cli, qwen3_artifact, QUESTION, 24)
    for token in (org_key("infer"), alice_token):
        art = upload(local_server.url, token, qwen3_artifact)
        r = httpx.post(
            f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer",
            headers=bearer(token),
            json={"question": QUESTION, "n": 24},
            timeout=budget(120),
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == expected and body["token_count"] == 24
        assert body["reused_tokens"] == art["manifest"]["tokens"] and body["artifact_id"] == art["artifact_id"]
        assert body["text"]
    # The route of older clients gives the same answer; its org/project never pick the tenant.
    r = httpx.post(
        f"{local_server.url}{API}/orgs/legacy/projects/p/artifacts/{art['artifact_id']}/infer",
        headers=bearer(alice_token),
        json={"question": QUESTION, "n": 24},
        timeout=budget(120),
    )
    assert r.status_code == 200 and r.json()["tokens"] == expected


def test_infer_input_limits(local_server, org_key, qwen3_artifact):
    key = org_key("limits")
    art = upload(local_server.url, key, qwen3_artifact)
    url = f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer"
    for body in (
        {"question": "x", "n": 0},
        {"question": "x", "n": 257},
        {"question": "", "n": 1},
        {"question": "x"},
        {"question": "x", "n": 1, "model": "/etc"},
    ):
        r = httpx.post(url, headers=bearer(key), json=body)
        assert r.status_code == 422 and r.json()["error"] == "validation_error", body


def test_concurrent_requests_are_exact_or_refused(local_server, org_key, qwen3_artifact, cli):
    """16 requests at once on 2 slots: each is 200 with the exact tokens or 429, nothing else."""
    n = 48
    expected = local_continue(cli, qwen3_artifact, QUESTION, n)
    key = org_key("burst")
    art = upload(local_server.url, key, qwen3_artifact)
    url = f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer"
    warm = httpx.post(url, headers=bearer(key), json={"question": QUESTION, "n": 1}, timeout=budget(120))
    assert warm.status_code == 200  # model and artifact resident before the burst
    barrier = threading.Barrier(16)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one():
        with httpx.Client(timeout=budget(120)) as client:
            barrier.wait()
            r = client.post(url, headers=bearer(key), json={"question": QUESTION, "n": n})
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    for r in results:
        if r.status_code == 200:
            assert r.json()["tokens"] == expected
        else:
            assert r.json()["error"] == "busy" and r.headers["retry-after"] == "1"


def test_model_outside_the_allow_list_is_refused(local_server, org_key, tmp_path):
    key = org_key("model")
    art = upload(local_server.url, key, write_synthetic_kv(tmp_path / "foreign.kv", model_id="/etc"))
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer",
        headers=bearer(key),
        json={"question": "x", "n": 1},
    )
    assert r.status_code == 422 and r.json()["error"] == "model_not_available"
    art = upload(local_server.url, key, write_synthetic_kv(tmp_path / "hub.kv", model_id="example/not-cached"))
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer",
        headers=bearer(key),
        json={"question": "x", "n": 1},
    )
    assert r.status_code == 422 and r.json()["error"] == "model_not_available"


def test_artifact_that_does_not_fit_its_model_is_422(local_server, org_key, hosted_model, tmp_path):
    """A synthetic artifact naming the allowed model but with the wrong fingerprint."""
    key = org_key("mismatch")
    art = upload(local_server.url, key, write_synthetic_kv(tmp_path / "wrong.kv", model_id=str(hosted_model)))
    r = httpx.post(
        f"{local_server.url}{API}/artifacts/{art['artifact_id']}/infer",
        headers=bearer(key),
        json={"question": "x", "n": 1},
        timeout=budget(120),
    )
    assert r.status_code == 422 and r.json()["error"] == "artifact_incompatible", r.text
    assert str(hosted_model) not in r.json()["message"] or "<path>" in r.json()["message"]
