"""``kvcdn search``: ranking, start tokens, the query tokenizer, the index, skips and warnings.

Artifacts here are written with :func:`artifact.write_artifact` around token ids chosen by the test
(tiny cache tensors: search never reads them), so every expected prefix is known exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from kvcdn_model_qwen import QwenAdapter

from kvcdn_core import artifact, runtime, search
from kvcdn_core.artifact.manifest import LayerEntry, reuse_of
from kvcdn_core.cli.app import make_cli
from kvcdn_core.model.files import fingerprint
from kvcdn_core.model.tiny import SAMPLE_TEXT
from kvcdn_core.search import index as search_index
from tests.support.budget import budget

ARCH = "Qwen3ForCausalLM"
PARAS = [p for p in SAMPLE_TEXT.split("\n\n") if p.strip()]


class BosQwenAdapter(QwenAdapter):
    """Qwen3 tiny config with a tokenizer that starts every context with a BOS token."""

    validation_configs = {ARCH: dict(QwenAdapter.validation_configs[ARCH], _bos=True)}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(QwenAdapter, ARCH)


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model):
    return tiny_model(BosQwenAdapter, ARCH)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_fake(path, model_dir, ids, kinds=("full_attention",), model_id=None, fp=None, context=None):
    """A valid artifact with the given token ids and layer kinds, and 1-element cache tensors."""
    import torch

    fp = fp or fingerprint(model_dir)
    layers, tensors = [], {}
    for i, kind in enumerate(kinds):
        entry = {"index": i, "kind": kind, "tensors": {"key": f"layers.{i}.key", "value": f"layers.{i}.value"}}
        if kind == artifact.SLIDING_WINDOW:
            entry.update(window=24, cumulative_length=len(ids))
        layers.append(entry)
        tensors[f"layers.{i}.key"] = torch.zeros(1, 1, 1, 1)
        tensors[f"layers.{i}.value"] = torch.zeros(1, 1, 1, 1)
    tensors[artifact.TOKEN_IDS] = torch.tensor(ids, dtype=torch.long)
    manifest = {
        "kvcdn_version": "test",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": model_id or str(model_dir), "revision": None, "family": "qwen", **fp},
        "compute_dtype": "float32",
        "layers": layers,
        "quantization": None,
    }
    if context is not None:
        manifest["context"] = context
    manifest["reuse"] = reuse_of(LayerEntry.from_dict(layer) for layer in layers)
    return artifact.write_artifact(path, manifest, tensors)


def run_cli(*args):
    return CliRunner().invoke(make_cli(), list(args), catch_exceptions=False)


def test_ranking_orders_by_usable_then_prefix_then_fraction(tmp_path, model_dir, hf_tok):
    query = PARAS[0] + "\n\n" + PARAS[1]
    q = hf_tok(query)["input_ids"]
    other = next(t for t in range(10, 300) if t not in q[40:80])
    d = tmp_path / "arts"
    write_fake(d / "exact50.kv", model_dir, q[:50])  # prefix 50, fraction 1
    write_fake(d / "longer50.kv", model_dir, q[:50] + [other] * 30)  # prefix 50, fraction 50/80
    write_fake(d / "sub" / "p60.kv", model_dir, q[:60] + [other])  # prefix 60 (in a subdirectory)
    write_fake(d / "sw70.kv", model_dir, q[:70] + [other], kinds=("sliding_window",))  # whole-prefix: unusable
    write_fake(d / "sw40.kv", model_dir, q[:40], kinds=("sliding_window",))  # whole prefix of the query: usable
    write_fake(d / "unrelated.kv", model_dir, [other] * 20)
    found = search.search(d, query, str(model_dir), warn=pytest.fail)
    got = [(m.path.name, m.prefix_tokens, m.usable_tokens) for m in found.ranking.matches]
    assert got == [
        ("p60.kv", 60, 60),
        ("exact50.kv", 50, 50),
        ("longer50.kv", 50, 50),
        ("sw40.kv", 40, 40),
        ("sw70.kv", 70, 0),
    ]
    assert found.query_ids == q and found.ranking.same_model == 6
    assert found.ranking.best_usable.path.name == "p60.kv"

    result = run_cli(
        "search", "--model", str(model_dir), "--dir", str(d), "--prompt", query, "--format", "json", "--limit", "2"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [m["path"].rsplit("/", 1)[1] for m in out["matches"]] == ["p60.kv", "exact50.kv"]
    assert out["matches"][0] == {
        **out["matches"][0],
        "prefix_tokens": 60,
        "artifact_tokens": 61,
        "usable_tokens": 60,
        "reuse": "any_prefix",
        "model": str(model_dir),
    }
    table = run_cli("search", "--model", str(model_dir), "--dir", str(d), "--prompt", query)
    assert table.exit_code == 0
    lines = table.output.splitlines()
    assert lines[0].split() == ["PATH", "PREFIX", "TOKENS", "USABLE", "REUSE", "MODEL"]
    assert lines[1].split()[:4] == [str(d / "sub" / "p60.kv"), "60", "61", "60"]


def test_usable_rule():
    # any prefix, capped one below the query so its last token is prefilled for the next logits
    assert search.usable_tokens(30, 100, 50, search.ANY_PREFIX) == 30
    assert search.usable_tokens(50, 50, 50, search.ANY_PREFIX) == 49
    # whole prefix only
    assert search.usable_tokens(30, 100, 50, search.WHOLE_PREFIX) == 0
    assert search.usable_tokens(30, 30, 50, search.WHOLE_PREFIX) == 30
    assert search.usable_tokens(50, 50, 50, search.WHOLE_PREFIX) == 0


def test_no_match_is_a_clear_message_and_exit_0(tmp_path, model_dir, hf_tok):
    write_fake(tmp_path / "a.kv", model_dir, hf_tok(PARAS[0])["input_ids"])
    result = run_cli("search", "--model", str(model_dir), "--dir", str(tmp_path), "--prompt", "zebra quantum")
    assert result.exit_code == 0
    assert result.output.startswith("no match: no artifact under")
    result = run_cli("search", "--dir", str(tmp_path), "--prompt", "zebra quantum", "--format", "json")
    assert result.exit_code == 0 and json.loads(result.output)["matches"] == []
    missing = run_cli("search", "--model", str(model_dir), "--dir", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_start_token_query_matches_saved_context(tmp_path, bos_model_dir):
    """A BOS tokenizer: the query is tokenized as a context (with its BOS), so it shares the prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bos_model_dir)
    ctx = tok(PARAS[0])["input_ids"]
    assert ctx[0] == tok.bos_token_id
    write_fake(tmp_path / "ctx.kv", bos_model_dir, ctx, context=PARAS[0])
    write_fake(tmp_path / "other.kv", bos_model_dir, tok(PARAS[2])["input_ids"], context=PARAS[2])
    found = search.search(tmp_path, PARAS[0] + "\n\nQ: why?\nA:", str(bos_model_dir), warn=pytest.fail)
    assert found.start_tokens == 1 and found.query_ids[0] == tok.bos_token_id
    assert found.tokenizer.kind == "tokenizers"  # the torch-free tokenizer reproduced the saved context
    assert [(m.path.name, m.prefix_tokens) for m in found.ranking.matches] == [("ctx.kv", len(ctx))]
    # Without the start token the same text would share nothing with the saved context.
    assert tok(PARAS[0], add_special_tokens=False)["input_ids"][0] != ctx[0]
    # Sharing only the BOS is not a match.
    assert search.search(tmp_path, "zebra", str(bos_model_dir)).ranking.matches == []


@pytest.mark.parametrize("bos", [False, True])
def test_query_tokenizer_equals_transformers(tmp_path, model_dir, bos_model_dir, bos):
    from transformers import AutoTokenizer

    src = bos_model_dir if bos else model_dir
    texts = [PARAS[1], " leading space", "Numbers 3.14159 and <|endoftext|> inline", "é ü 日本"]
    for case, d in (("as saved", src), ("add_bos_token flag", tmp_path / "flag")):
        if d != src:  # transformers 5 ignores the config flag when tokenizer.json exists; so must we
            shutil.copytree(src, d)
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg.update(add_bos_token=not bos, bos_token="<|startoftext|>")
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        light, hf = search.QueryTokenizer(d), AutoTokenizer.from_pretrained(d)
        for text in texts:
            for special in (True, False):
                assert (
                    light(text, add_special_tokens=special)["input_ids"]
                    == hf(text, add_special_tokens=special)["input_ids"]
                ), (case, text, special)
        assert light.decode(hf(texts[0])["input_ids"]) == hf.decode(hf(texts[0])["input_ids"])


def test_query_tokenizer_falls_back_when_it_cannot_reproduce_a_context(tmp_path, model_dir, hf_tok):
    no_post = tmp_path / "no_post"
    shutil.copytree(model_dir, no_post)
    spec = json.loads((no_post / "tokenizer.json").read_text())
    spec["post_processor"] = None  # start tokens then come from the tokenizer class: transformers decides
    (no_post / "tokenizer.json").write_text(json.dumps(spec))
    assert search.query_tokenizer(no_post, search.load_adapter(no_post)).kind == "transformers"
    ids = hf_tok(PARAS[0])["input_ids"]
    path = write_fake(tmp_path / "a.kv", model_dir, [0] + ids, context=PARAS[0])  # ids with an unknown start token
    entry = search.scan(tmp_path)[0]
    tok = search.query_tokenizer(model_dir, search.load_adapter(model_dir), entry)
    assert tok.kind == "transformers"
    path.unlink()
    write_fake(tmp_path / "a.kv", model_dir, ids, context=PARAS[0])
    entry = search.scan(tmp_path)[0]
    assert search.query_tokenizer(model_dir, search.load_adapter(model_dir), entry).kind == "tokenizers"


def test_foreign_models_skipped_by_fingerprint_not_name(tmp_path, model_dir, hf_tok):
    ids = hf_tok(PARAS[0])["input_ids"]
    fp = fingerprint(model_dir)
    write_fake(tmp_path / "mine.kv", model_dir, ids)
    write_fake(tmp_path / "same_name_other_config.kv", model_dir, ids, fp={**fp, "config_sha256": "0" * 64})
    write_fake(tmp_path / "other_tokenizer.kv", model_dir, ids, fp={**fp, "tokenizer_sha256": "1" * 64})
    write_fake(tmp_path / "renamed_same_model.kv", model_dir, ids[:30], model_id="someone/else")
    found = search.search(tmp_path, PARAS[0], str(model_dir), warn=pytest.fail)
    assert sorted(m.path.name for m in found.ranking.matches) == ["mine.kv", "renamed_same_model.kv"]
    assert (found.ranking.same_model, found.ranking.foreign) == (2, 2)
    result = run_cli("search", "--model", str(model_dir), "--dir", str(tmp_path), "--prompt", PARAS[0])
    assert "skipped 2 of other models" in result.output


def test_unreadable_files_warn_once_each(tmp_path, model_dir, hf_tok):
    ids = hf_tok(PARAS[0])["input_ids"]
    good = write_fake(tmp_path / "good.kv", model_dir, ids)
    (tmp_path / "garbage.kv").write_bytes(b"not an artifact at all")
    data = good.read_bytes()
    (tmp_path / "truncated.kv").write_bytes(data[:-10])
    (tmp_path / "notes.txt").write_text("not a .kv file, not looked at")
    (tmp_path / "dir.kv").mkdir()
    for _ in range(2):  # unreadable files are not cached: each search warns again, once per file
        warnings = []
        found = search.search(tmp_path, PARAS[0], str(model_dir), warn=warnings.append)
        assert [m.path.name for m in found.ranking.matches] == ["good.kv"]
        assert len(warnings) == 2, warnings
        assert any("garbage.kv" in w and "not a kvcdn artifact" in w for w in warnings)
        assert any("truncated.kv" in w and "truncated" in w for w in warnings)
    result = CliRunner().invoke(
        make_cli(), ["search", "--model", str(model_dir), "--dir", str(tmp_path), "--prompt", PARAS[0]]
    )
    assert result.exit_code == 0
    assert result.output.count("warning: skipping") == 2 and "Traceback" not in result.output


def test_index_reused_and_rebuilt_on_change(tmp_path, model_dir, hf_tok, monkeypatch):
    q = hf_tok(PARAS[0] + PARAS[1])["input_ids"]
    for i in range(4):
        write_fake(tmp_path / f"a{i}.kv", model_dir, q[: 20 + 10 * i])
    reads = []
    real = search_index._entry_from_file
    monkeypatch.setattr(search_index, "_entry_from_file", lambda p, st: reads.append(p.name) or real(p, st))
    first = search.scan(tmp_path)
    assert sorted(reads) == ["a0.kv", "a1.kv", "a2.kv", "a3.kv"]
    index = tmp_path / search.INDEX_NAME
    assert index.is_file() and oct(index.stat().st_mode & 0o777) == "0o600"
    stamp = index.stat().st_mtime_ns

    reads.clear()
    again = search.scan(tmp_path)
    assert reads == [] and index.stat().st_mtime_ns == stamp  # nothing read, nothing rewritten
    assert [e.ids.tolist() for e in again] == [e.ids.tolist() for e in first]

    write_fake(tmp_path / "a1.kv", model_dir, q[:5] + [7, 7, 7])  # changed size and mtime
    (tmp_path / "a3.kv").unlink()
    write_fake(tmp_path / "new.kv", model_dir, q[:90])
    reads.clear()
    entries = {e.path.name: e.ids.tolist() for e in search.scan(tmp_path)}
    assert sorted(reads) == ["a1.kv", "new.kv"]
    assert sorted(entries) == ["a0.kv", "a1.kv", "a2.kv", "new.kv"] and entries["a1.kv"] == q[:5] + [7, 7, 7]
    ranking = search.rank(search.scan(tmp_path), fingerprint(model_dir), q)
    assert [(m.path.name, m.prefix_tokens) for m in ranking.matches][:2] == [("new.kv", 90), ("a2.kv", 40)]

    index.write_bytes(b"KVCDNIX1garbage")  # a damaged index is rebuilt, never trusted
    reads.clear()
    assert len(search.scan(tmp_path)) == 4 and len(reads) == 4


def test_read_only_directory_indexes_into_the_user_cache(tmp_path, model_dir, hf_tok, monkeypatch):
    d = tmp_path / "shared"
    write_fake(d / "a.kv", model_dir, hf_tok(PARAS[0])["input_ids"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(search_index.os, "access", lambda path, mode: False)
    assert search.index_path(d).parent == tmp_path / "cache" / "kvcdn" / "search-index"
    assert len(search.scan(d)) == 1
    assert not (d / search.INDEX_NAME).exists() and search.index_path(d).is_file()


def test_search_does_not_import_torch(tmp_path, model_dir, hf_tok):
    write_fake(tmp_path / "a.kv", model_dir, hf_tok(PARAS[0])["input_ids"], context=PARAS[0])
    code = (
        "import sys; from kvcdn_core.cli.app import make_cli\n"
        f"make_cli().main(args=['search', '--model', {str(model_dir)!r}, '--dir', {str(tmp_path)!r},"
        f" '--prompt', {PARAS[0]!r}, '--format', 'json'], standalone_mode=False)\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', 'transformers' in sys.modules)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=budget(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH False"
    assert '"tokenizer": "tokenizers"' in out.stdout


def test_model_inferred_from_the_directory(tmp_path, model_dir, hf_tok):
    write_fake(tmp_path / "a.kv", model_dir, hf_tok(PARAS[0])["input_ids"])
    result = run_cli("search", "--dir", str(tmp_path), "--prompt", PARAS[0], "--format", "json")
    assert result.exit_code == 0 and json.loads(result.output)["model"] == str(model_dir)
    write_fake(tmp_path / "b.kv", model_dir, [1, 2], model_id="other/model")
    result = run_cli("search", "--dir", str(tmp_path), "--prompt", PARAS[0])
    assert result.exit_code == 2 and "pass --model" in result.output


def test_bos_model_continue_reuses_the_saved_context(tmp_path, bos_model_dir):
    """End to end with a start token: generate, then continue a longer prompt from the directory."""
    session = runtime.load_session(str(bos_model_dir), device="cpu", dtype="float32")
    runtime.generate(session, PARAS[0], tmp_path / "arts" / "ctx.kv", progress=False)
    prompt = PARAS[0] + "\n\nQ: What did the keeper note?\nA:"
    (tmp_path / "prompt.txt").write_text(prompt)
    result = run_cli(
        "continue",
        "--dir",
        str(tmp_path / "arts"),
        "--prompt-file",
        str(tmp_path / "prompt.txt"),
        "--n",
        "8",
        "--format",
        "json",
        "-q",
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    ids = session.adapter.encode_context(session.tokenizer, prompt)
    ctx = artifact.read_token_ids(tmp_path / "arts" / "ctx.kv")
    assert ids[0] == session.tokenizer.bos_token_id and ids[: len(ctx)] == ctx
    assert out["reused_tokens"] == len(ctx) and out["prompt_tokens"] == len(ids)
    reference, _ = runtime.greedy(session, session.adapter.new_cache(session.model), ids, 8)
    assert out["token_ids"] == reference


def test_default_directory_is_where_generate_writes(tmp_path, model_dir, hf_tok, monkeypatch):
    from kvcdn_core.paths import data_home

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    write_fake(data_home() / "generate" / "generate-1-x.kv", model_dir, hf_tok(PARAS[0])["input_ids"])
    result = run_cli("search", "--prompt", PARAS[0] + " more", "--format", "json")
    assert result.exit_code == 0, result.output
    [match] = json.loads(result.output)["matches"]
    assert match["path"] == str(data_home() / "generate" / "generate-1-x.kv")


def test_the_old_query_names_work_one_release_with_a_warning(tmp_path, model_dir):
    """search takes --prompt/--prompt-file, as continue does; --query/--query-file still work, with a warning."""
    old = run_cli("search", "--model", str(model_dir), "--dir", str(tmp_path), "--query", "zebra quantum")
    assert old.exit_code == 0, old.stderr
    assert "warning: search --query/--query-file are deprecated; use --prompt/--prompt-file" in old.stderr
    both = run_cli("search", "--model", str(model_dir), "--dir", str(tmp_path))
    assert both.exit_code == 2 and "pass exactly one of --prompt and --prompt-file" in both.stderr
