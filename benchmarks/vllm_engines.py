"""The vLLM engine set-up the vLLM benchmarks share (``vllm_ttft.py``, ``vllm_fleet.py``).

Engines are float32 and eager, so timings compare like with like; vLLM's own prefix cache is off
unless asked for, so a reused token comes from the connector under test. A prompt is a long
SmolLM2 document built from the sample text, cut to a token count. Imported only by scripts that
run with the vLLM environment's Python.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path


def engine(model: str, connector: dict | None, prefix_caching: bool = False, in_process: bool = False):
    """A vLLM engine; ``connector`` is a ``KVTransferConfig``'s fields (None: no connector).
    ``in_process``: engine core and worker in this process (set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    before vLLM is imported), so several engines start one after another without re-importing."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_role="kv_both", **connector)
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(
        model=model,
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        seed=0,
        **kwargs,
    )


def kvcdn(extra: dict) -> dict:
    """The kvcdn connector's ``KVTransferConfig`` fields with ``extra`` as its own settings."""
    return {
        "kv_connector": "KvcdnConnector",
        "kv_connector_module_path": "kvcdn_vllm",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def ttft(llm, prompt: list[int], reps: int) -> tuple[list[float], object]:
    """Wall time of ``reps`` requests of ``prompt`` with ``max_tokens=1``, and the last output."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    times, out = [], None
    for _ in range(reps):
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        times.append(time.perf_counter() - started)
    return times, out


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def document_ids(session, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of the sample text repeated (a long SmolLM2 document)."""
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    context = SAMPLE_TEXT
    while len(session.adapter.encode_context(session.tokenizer, context)) < tokens:
        context += "\n" + SAMPLE_TEXT
    return session.adapter.encode_context(session.tokenizer, context)[:tokens]
