"""``search --store kvcdn+http://...`` and ``continue --store``: the hosted backend declares
``prefix_lookup``, so core asks the server's index by chain keys; the hits equal those of a chunk
store holding the same `.kv` files, and continuing fetches only the chosen artifact."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcdn_core import runtime
from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.cli.app import make_cli
from kvcdn_core.model.tiny import SAMPLE_TEXT
from kvcdn_core.search.store import search_store
from kvcdn_core.store.chunkstore import ChunkStore

PARAS = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]
LONG = "\n\n".join(PARAS)
QUESTION = "\n\nQ: What did the keeper write down?\nA:"


@pytest.fixture(scope="module")
def session(qwen3_dir):
    return runtime.load_session(str(qwen3_dir), device="cpu", dtype="float32")


@pytest.fixture
def hosted_env(monkeypatch, local_server, org_key):
    monkeypatch.setenv("KVCDN_TELEMETRY", "0")
    monkeypatch.setenv("KVCDN_API_URL", local_server.url)
    monkeypatch.setenv("KVCDN_API_KEY", org_key("search"))
    return "kvcdn://"


def test_search_and_continue_through_the_hosted_lookup(session, qwen3_dir, hosted_env, tmp_path, monkeypatch):
    from kvcdn_core.plugin_host.registry import open_storage

    texts = {
        "long": LONG,
        "two-thirds": LONG[: len(LONG) * 2 // 3],
        "branch": LONG[: len(LONG) // 3] + "\n\nAn entirely different ending, told another way.",
    }  # the shared test server's quota is 3 artifacts per org
    made, local = tmp_path / "made", tmp_path / "store"
    hosted = open_storage(hosted_env)
    for name, text in texts.items():
        path = made / f"{name}.kv"
        runtime.generate(session, text, path, progress=False)
        ChunkStore(LocalStorage(local)).put(path, name)
        hosted.put_file(name, path)
    prompts = [
        LONG[: len(LONG) * 2 // 3] + QUESTION,
        LONG[: len(LONG) // 3] + "\n\nAn entirely different" + QUESTION,
        LONG + QUESTION,
        PARAS[-1][:40],
        "Nothing like any of them at all." + QUESTION,
    ]
    for prompt in prompts:
        by_hosted = search_store(hosted_env, prompt, str(qwen3_dir))
        by_store = search_store(str(local), prompt, str(qwen3_dir))
        assert by_hosted.as_dict(10)["matches"] == by_store.as_dict(10)["matches"], prompt
        assert by_hosted.roots == by_store.roots == 1

    # continue --store over the hosted endpoint: the same artifact, prefix and tokens as the chunk store
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompts[0])
    outs = []
    for store in (hosted_env, local):
        result = CliRunner().invoke(
            make_cli(),
            ["continue", "--store", str(store), "--model", str(qwen3_dir), "--prompt-file", str(prompt_file)]
            + ["--n", "6", "-q", "--format", "json"],
        )
        assert result.exit_code == 0, result.output
        outs.append(json.loads(result.output))
    assert outs[0]["artifact"] == outs[1]["artifact"] == "two-thirds"
    assert outs[0]["reused_tokens"] == outs[1]["reused_tokens"] and outs[0]["token_ids"] == outs[1]["token_ids"]
