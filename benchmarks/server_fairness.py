"""Tenant B's inference latency on `kvcdn serve`, idle and while tenant A floods it.

Starts ``kvcdn serve`` (real process, real HTTP) with ``--infer-concurrency 2`` on a small
Qwen3-architecture model built from config (random weights, kvcdn's tiny trained tokenizer: the
Hugging Face hub is not needed), uploads one artifact per tenant, then measures:

- ``idle``: B sends ``--reps`` requests of ``--b-n`` tokens, one at a time with ``--pause`` seconds
  between them (an interactive user), and nothing else runs;
- ``flood``: the same, while A keeps ``--flood`` requests of ``--a-n`` tokens in flight at once,
  each thread sending its next one as soon as the last is answered (after ``--a-retry`` seconds
  when it was ``429 busy``: a client that does not wait the ``Retry-After`` it was given).

It prints both medians of B and their ratio (the goal: at most 1.5), how many requests of A were
computed and refused meanwhile, and that every answer of B was the same tokens.

    python benchmarks/server_fairness.py --threads 1 [--reps 30] [--flood 6] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

API = "/api/v1"
QUESTION = " What did the keeper write during the storm?"


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A Qwen3-architecture model of ``hidden`` width and ``layers`` layers, random weights, saved."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvcdn_core.contracts.adapter import quiet_transformers
    from kvcdn_core.model.tiny import train_tokenizer

    if (out / "config.json").exists():
        return out
    quiet_transformers()
    tokenizer = train_tokenizer()
    heads = max(1, hidden // 64)
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def kvcdn() -> list[str]:
    """The ``kvcdn`` console script of this interpreter's environment, or the module."""
    script = Path(sys.executable).with_name("kvcdn")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvcdn_core.cli.app"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(work: Path, model: Path, threads: int, seed: str):
    """``kvcdn serve`` with two inference slots and orgs ``acme`` (A) and ``beta`` (B); yields its URL."""
    import httpx

    port = free_port()
    env = dict(
        os.environ,
        XDG_DATA_HOME=str(work / "data"),
        OMP_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        KVCDN_API_KEY_ORGS="acme,beta",
        KVCDN_API_KEY_SEED=seed,
        KVCDN_INFER_DEVICE="cpu",
        KVCDN_GC_INTERVAL="3600",
    )
    cmd = [*kvcdn(), "serve", "--host", "127.0.0.1", "--port", str(port), "--models", str(model)]
    cmd += ["--infer-concurrency", "2", "--infer-timeout", "600"]
    log = open(work / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"kvcdn serve exited with {proc.returncode}; see {work / 'server.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"kvcdn serve did not become healthy; see {work / 'server.log'}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def upload(url: str, key: str, path: Path) -> str:
    import httpx

    data = path.read_bytes()
    auth = {"Authorization": f"Bearer {key}"}
    body = {"name": path.name, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    plan = httpx.post(f"{url}{API}/artifacts/upload-url", headers=auth, json=body).raise_for_status().json()
    httpx.put(plan["url"], content=data, headers=plan["headers"]).raise_for_status()
    httpx.post(f"{url}{API}/artifacts/{plan['artifact_id']}/confirm-upload", headers=auth).raise_for_status()
    return plan["artifact_id"]


def infer(client, url: str, key: str, artifact_id: str, n: int):
    """``(seconds, response)`` of one infer request."""
    start = time.perf_counter()
    r = client.post(
        f"{url}{API}/artifacts/{artifact_id}/infer",
        headers={"Authorization": f"Bearer {key}"},
        json={"question": QUESTION, "n": n},
        timeout=600,
    )
    return time.perf_counter() - start, r


def tenant_b(url: str, key: str, artifact_id: str, args) -> tuple[list[float], set]:
    """B's latencies (seconds) and the distinct token lists it got."""
    import httpx

    latencies, answers = [], set()
    with httpx.Client() as client:
        for _ in range(args.reps):
            seconds, r = infer(client, url, key, artifact_id, args.b_n)
            if r.status_code != 200:
                raise SystemExit(f"tenant B got {r.status_code}: {r.text}")
            latencies.append(seconds)
            answers.add(tuple(r.json()["tokens"]))
            time.sleep(args.pause)
    return latencies, answers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    parser.add_argument("--reps", type=int, default=30, help="requests of B in each phase")
    parser.add_argument("--b-n", type=int, default=16, help="tokens B asks for")
    parser.add_argument("--a-n", type=int, default=256, help="tokens each request of A asks for")
    parser.add_argument("--flood", type=int, default=6, help="requests A keeps in flight")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds B waits between its requests")
    parser.add_argument("--a-retry", type=float, default=0.05, help="seconds A waits after a 429")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=3, help="copies of the sample text in the artifact")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)

    import httpx

    from kvcdn_core.model.tiny import SAMPLE_TEXT
    from kvcdn_server.apikeys import derive_key

    load = os.getloadavg()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvcdn-fairness-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work / f"qwen3-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    doc, artifact_path = work / "doc.txt", work / "doc.kv"
    doc.write_text(SAMPLE_TEXT * args.context)
    generate = [*kvcdn(), "generate", "--model", str(model), "--context-file", str(doc), "--output", str(artifact_path)]
    subprocess.run([*generate, "--device", "cpu", "--force"], check=True, capture_output=True, env=dict(os.environ))
    seed = secrets.token_hex(32)
    keys = {org: derive_key(seed.encode(), org) for org in ("acme", "beta")}

    with serve(work, model, args.threads, seed) as url:
        a_id, b_id = upload(url, keys["acme"], artifact_path), upload(url, keys["beta"], artifact_path)
        with httpx.Client() as client:  # warm-up: model and artifact caches resident
            for key, artifact_id in ((keys["acme"], a_id), (keys["beta"], b_id)):
                infer(client, url, key, artifact_id, 1)[1].raise_for_status()
        idle, idle_answers = tenant_b(url, keys["beta"], b_id, args)

        stop = threading.Event()
        counts = {"computed": 0, "refused": 0}
        lock = threading.Lock()

        def flood():
            with httpx.Client() as client:
                while not stop.is_set():
                    _, r = infer(client, url, keys["acme"], a_id, args.a_n)
                    with lock:
                        counts["computed" if r.status_code == 200 else "refused"] += 1
                    if r.status_code == 429:
                        time.sleep(args.a_retry)
                    elif r.status_code != 200:
                        raise SystemExit(f"tenant A got {r.status_code}: {r.text}")

        flooders = [threading.Thread(target=flood, daemon=True) for _ in range(args.flood)]
        for thread in flooders:
            thread.start()
        time.sleep(2.0)  # the flood is under way
        busy, busy_answers = tenant_b(url, keys["beta"], b_id, args)
        stop.set()
        for thread in flooders:
            thread.join()

    idle_median, busy_median = statistics.median(idle), statistics.median(busy)
    print(f"model: Qwen3 architecture, hidden {args.hidden}, {args.layers} layers, random weights")
    print(f"server: kvcdn serve --infer-concurrency 2, OMP_NUM_THREADS={args.threads}, {os.cpu_count()} CPUs")
    print(f"load average of the machine at the start and the end: {load[0]:.1f}, {os.getloadavg()[0]:.1f}")
    print(f"B: {args.reps} requests of n={args.b_n}, {args.pause} s apart; A: {args.flood} in flight, n={args.a_n}")
    print()
    print("| phase | B median (s) | B p90 (s) | A computed | A refused (429) |")
    print("|---|---|---|---|---|")
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
    print(f"| idle | {idle_median:.3f} | {p90(idle):.3f} | 0 | 0 |")
    print(f"| A floods | {busy_median:.3f} | {p90(busy):.3f} | {counts['computed']} | {counts['refused']} |")
    print()
    print(f"B's median while A floods / idle: {busy_median / idle_median:.2f} (goal: at most 1.5)")
    same = len(idle_answers | busy_answers) == 1
    print(f"same tokens in every answer of B: {'yes' if same else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
