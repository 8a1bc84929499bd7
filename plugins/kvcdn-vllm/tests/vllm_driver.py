"""Runs vLLM engines one after another in one process and writes what each request reported.

Run with the vLLM environment's Python: ``python vllm_driver.py SPEC.json OUT.json``. SPEC holds
``runs``, each ``{"model", "connector": null | kv_connector_extra_config, "prompts": [[ids]],
"max_tokens" (one for every prompt, or a list: one per prompt), "max_model_len"}``, and
``"tensor_parallel_size"`` or ``"pipeline_parallel_size"`` when not 1, ``"together": true`` to send
every prompt in one batch (they then share the engine's steps), ``"num_gpu_blocks"`` to cap vLLM's
KV blocks (so that a batch outgrows them and vLLM preempts), ``"copy_when_asked": true`` to hold
each of the connector's layer-by-layer copies until the forward asks for that layer (so it must wait
for every one),
``"fail_layer_copy"`` (a layer index) to make the first copy of that layer fail, ``"warm_first": true``
to let the tier's warming thread (memory from disk, at start) end before the first request,
``"prefix_caching": true`` to turn vLLM's own prefix cache on, ``"fetch_in_halves": "hold"`` to make
each chunk fetched from the store land its first half, then hold the rest until the forward has asked
for a layer after the first (or ``"fail"``: the rest never comes, the fetch raises); OUT gets, per run,
per prompt: the greedy token ids, ``num_cached_tokens``, the connector's ``kv_transfer_params``,
``layer_waits`` (the forward's waits for a layer, and how many found it not yet copied) and
``halves`` (chunks that landed half, the layer the forward asked for while their rest was held, and
whether the forward let the rest through before the 120 s bound).
Engines are float32, eager, with vLLM's own prefix cache off unless asked, so any cached token was
loaded by the connector.

Engines run inside this process (no engine-core or worker subprocess, on one thread, as vLLM's CPU
binding gives a 2-core machine): each spawned process re-imports vLLM and torch, which took about
three quarters of an engine's start. An engine with tensor or pipeline parallelism runs its workers
in processes of their own (vLLM's ``mp`` executor), each bound to one core. The connector's
scheduler and worker halves still talk only through vLLM's connector metadata; ``kvcdn vllm-serve``
in the tests keeps vLLM's default process split, so that path is proven too.
"""

import gc
import json
import os
import sys
import threading
import time

#: this machine's cores, read before any engine binds this process's threads
CORES = sorted(os.sched_getaffinity(0))


#: the forward's waits for a connector layer copy: all, and those that found it not yet copied
WAITS = {"total": 0, "blocked": 0}
#: chunks that landed half (``fetch_in_halves``), and the last layer the forward asked for before
#: their rest was let through
HALVES: dict = {"landed": 0, "forward_layer": -1, "released": None}
#: the hooked methods as the connector defines them (each run hooks them afresh)
ORIGINAL: dict = {}


def hook_layer_copies(run: dict) -> None:
    """The run's ``copy_when_asked`` and ``fail_layer_copy``, and the count of waits (WAITS)."""
    from kvcdn_vllm import connector, layers

    if not ORIGINAL:
        ORIGINAL.update(
            start=layers.LayerLoader.start,
            wait=layers.LayerLoader.wait,
            part=layers.LayerCopies.copy_part,
            grouped=layers._copy_grouped,
        )
    real_start, real_wait, real_part = ORIGINAL["start"], ORIGINAL["wait"], ORIGINAL["part"]
    real_grouped = ORIGINAL["grouped"]
    held, fail = bool(run.get("copy_when_asked")), run.get("fail_layer_copy")
    failed = []
    asked: dict[str, dict[str, threading.Event]] = {}  # "step": this step's layer → asked

    def start(self, names, copy, then=None):
        step = asked["step"] = {name: threading.Event() for name in names}

        def when_asked(name):
            step[name].wait(120)  # a bound only a forward that never asks reaches
            copy(name)

        real_start(self, names, when_asked if held else copy, then)

    def wait(self, layer):
        if not rest.is_set() and HALVES["landed"]:
            HALVES["forward_layer"] = max(HALVES["forward_layer"], connector._layer_index(layer))
            if HALVES["forward_layer"] >= 1:  # past layer 0, which needed every chunk's front
                rest.set()
        event = self._ready.get(layer)
        WAITS["total"] += event is not None
        WAITS["blocked"] += event is not None and not event.is_set()
        step = asked.get("step", {})
        if layer in step:
            step[layer].set()
        real_wait(self, layer)

    def copy_part(self, copy, name, kv, index):  # a part copied on its own (every part's first layer)
        if fail is not None and not failed and index == fail:
            failed.append(name)
            raise RuntimeError(f"injected copy failure of {name}")
        real_part(self, copy, name, kv, index)

    def copy_grouped(kv, layout, index, parts):  # every grouped part of a layer, in one call
        if fail is not None and not failed and index == fail:
            failed.append(index)
            raise RuntimeError(f"injected copy failure of layer {index}")
        real_grouped(kv, layout, index, parts)

    layers.LayerLoader.start, layers.LayerLoader.wait = start, wait
    layers.LayerCopies.copy_part = copy_part
    layers._copy_grouped = copy_grouped

    from kvcdn_vllm import lookup

    real_fetch = ORIGINAL.setdefault("fetch", lookup.StoreLookup.fetch)
    halves, rest = run.get("fetch_in_halves"), threading.Event()

    def fetch(self, digest, into, landed=None):
        data = real_fetch(self, digest, into)  # read whole, then told in two halves
        if landed is None or data is not into:
            return data
        landed(len(into) // 2)
        HALVES["landed"] += 1
        if halves == "fail":
            raise OSError("injected: the connection dropped halfway through the chunk")
        # False only when the bound passed: a forward that waits for every byte before it starts
        HALVES["released"] = rest.wait(120) and HALVES["released"] is not False
        landed(len(into))
        return data

    lookup.StoreLookup.fetch = fetch if halves else real_fetch

    from kvcdn_vllm import tier

    real_warming = ORIGINAL.setdefault("warming", tier.ChunkTier.start_warming)

    def start_warming(self):
        real_warming(self)
        if run.get("warm_first") and self._warming is not None:
            self._warming.join()  # the real thread, let finish before the engine takes requests

    tier.ChunkTier.start_warming = start_warming


def run_engine(run: dict) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if run.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvcdnConnector",
            kv_connector_module_path="kvcdn_vllm",
            kv_role="kv_both",
            kv_connector_extra_config=run["connector"],
            kv_load_failure_policy="recompute",
        )
    tp, pp = run.get("tensor_parallel_size", 1), run.get("pipeline_parallel_size", 1)
    if run.get("connector") is not None and tp * pp == 1:
        hook_layer_copies(run)
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if tp * pp > 1:
        # vLLM's CPU workers bind to NUMA nodes unless told which cores; a small machine has one node
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(CORES[i % len(CORES)]) for i in range(tp * pp))
    llm = LLM(
        model=run["model"],
        dtype="float32",
        max_model_len=run.get("max_model_len", 2048),
        enforce_eager=True,
        enable_prefix_caching=bool(run.get("prefix_caching")),
        seed=0,
        distributed_executor_backend="uni" if tp * pp == 1 else "mp",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_gpu_blocks_override=run.get("num_gpu_blocks"),
        **kwargs,
    )
    try:
        max_tokens = run.get("max_tokens", 8)
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(run["prompts"])
        if run.get("together"):
            params = [SamplingParams(max_tokens=most, temperature=0.0) for most in max_tokens]
            outs = llm.generate([{"prompt_token_ids": ids} for ids in run["prompts"]], params, use_tqdm=False)
            return [
                {
                    "ids": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ]
        results = []
        for ids, most in zip(run["prompts"], max_tokens):  # one at a time: each request's load is its own step
            params = SamplingParams(max_tokens=most, temperature=0.0)
            started, waits = time.perf_counter(), dict(WAITS)
            HALVES.update(landed=0, forward_layer=-1, released=None)
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            results.append(
                {
                    "ids": list(out.outputs[0].token_ids),
                    "cached": out.num_cached_tokens,
                    "kv_transfer_params": out.kv_transfer_params,
                    "seconds": time.perf_counter() - started,
                    "layer_waits": {k: WAITS[k] - waits[k] for k in WAITS},
                    "halves": dict(HALVES),
                }
            )
        return results
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import torch

    torch.set_num_threads(1)  # before vLLM's CPU worker disables set_num_threads
    out = {"runs": [run_engine(run) for run in spec["runs"]]}
    with open(sys.argv[2], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
