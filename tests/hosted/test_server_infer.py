"""Inference from an uploaded artifact: token-exact with local ``kvcdn continue``, bounded
concurrency (429), the per-request timeout (504), and the model allow-list."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

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


# -- composing several artifacts (issue 28): the hosted answer is local continue's ---------------

DOCUMENTS = (
    "The lighthouse keeper kept a ledger of every ship that passed the cape.",
    "In 1887 the cape saw its worst storm; one schooner did not turn back.",
    "The missing ship was found in spring, beached and empty, forty miles south.",
)


@pytest.fixture(scope="module")
def documents(qwen3_dir, tmp_path_factory):
    """Three artifacts of the tiny Qwen3, one document each, and their token ids."""
    from kvcdn_core import runtime

    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    folder = tmp_path_factory.mktemp("docs")
    return [runtime.generate(session, text, folder / f"doc{i}.kv", progress=False) for i, text in enumerate(DOCUMENTS)]


def _compose(url, token, first, more, **knobs):
    return httpx.post(
        f"{url}{API}/artifacts/{first}/infer",
        headers=bearer(token),
        json={"question": QUESTION, "n": 12, "compose": more, **knobs},
        timeout=budget(120),
    )


def local_compose(cli, paths, *knobs) -> dict:
    args = [a for p in paths for a in ("--kv-path", p)]
    result = cli("continue", *args, "--question", QUESTION, "--n", 12, *knobs, "--format", "json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_composed_infer_equals_local_continue(local_server, org_key, documents, cli):
    key = org_key("compose")
    ids = [upload(local_server.url, key, path)["artifact_id"] for path, _ in documents]
    order = [1, 0, 2]  # not the order of upload: the request's order is the prompt's
    paths = [documents[i][0] for i in order]
    for knobs, flags in (
        ({}, []),  # the local defaults
        ({"recompute": 0, "select": "doc-start"}, ["--recompute", "0", "--select", "doc-start"]),
        ({"recompute": 0.5, "select": "deviation"}, ["--recompute", "0.5", "--select", "deviation"]),
        ({"recompute": 1}, ["--recompute", "1"]),
    ):
        r = _compose(local_server.url, key, ids[order[0]], [ids[i] for i in order[1:]], **knobs)
        assert r.status_code == 200, r.text
        body, local = r.json(), local_compose(cli, paths, *flags)
        assert body["tokens"] == local["token_ids"], knobs
        assert body["reused_tokens"] == local["context_tokens"]
        c = body["composition"]
        assert c["artifact_ids"] == [ids[i] for i in order] and c["offsets"] == local["offsets"]
        assert (c["recompute"], c["rule"]) == (local["recompute"], local["rule"])
        assert c["recomputed_tokens"] == local["recomputed_tokens"]


def test_composed_infer_at_recompute_1_is_the_full_prefill(local_server, org_key, documents, qwen3_dir):
    from kvcdn_core import runtime

    session = runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")
    every = [i for _, ids in documents for i in ids]
    cache, _ = runtime.prefill(session, every, progress=False)
    expected, _ = runtime.greedy(session, cache, session.adapter.encode_continuation(session.tokenizer, QUESTION), 12)
    key = org_key("full")
    ids = [upload(local_server.url, key, path)["artifact_id"] for path, _ in documents]
    r = _compose(local_server.url, key, ids[0], ids[1:], recompute=1)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected and r.json()["reused_tokens"] == len(every)


def test_a_foreign_private_artifact_is_not_found_like_an_unknown_one(local_server, org_key, documents):
    mine, theirs = org_key("mine"), org_key("theirs")
    first = upload(local_server.url, mine, documents[0][0])["artifact_id"]
    private = upload(local_server.url, theirs, documents[1][0])["artifact_id"]
    public = upload(local_server.url, theirs, documents[2][0], visibility="public")["artifact_id"]
    unknown = _compose(local_server.url, mine, first, ["00000000-0000-4000-8000-000000000000"])
    foreign = _compose(local_server.url, mine, first, [private])
    assert unknown.status_code == foreign.status_code == 404
    assert unknown.json() == foreign.json() and foreign.json()["error"] == "not_found"
    # the same private artifact as the route's first is not found either; a public one composes
    assert _compose(local_server.url, mine, private, [first]).json() == foreign.json()
    assert _compose(local_server.url, mine, first, [public]).status_code == 200


def test_composition_fields_are_validated(local_server, org_key, documents):
    key = org_key("knobs")
    a, b = (upload(local_server.url, key, path)["artifact_id"] for path, _ in documents[:2])
    url = f"{local_server.url}{API}/artifacts/{a}/infer"
    for extra in (
        {"recompute": 0.3},  # the knobs need a composition
        {"select": "deviation"},
        {"compose": []},
        {"compose": [b], "recompute": 1.5},
        {"compose": [b], "recompute": -0.1},
        {"compose": [b], "select": "random"},
        {"compose": b},
        {"compose": [b] * 16},
    ):
        r = httpx.post(url, headers=bearer(key), json={"question": "x", "n": 1, **extra})
        assert r.status_code == 422 and r.json()["error"] == "validation_error", extra
    # a plain request's answer has no composition field: the old shape, unchanged
    r = httpx.post(url, headers=bearer(key), json={"question": "x", "n": 1}, timeout=budget(120))
    assert r.status_code == 200 and "composition" not in r.json()
