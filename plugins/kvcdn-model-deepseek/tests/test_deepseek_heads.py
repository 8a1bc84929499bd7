"""A DeepSeek config whose num_key_value_heads differs from num_attention_heads generates and verifies.

transformers 5.24 itself crashes on such a config (it repeats MLA's per-head keys by the GQA ratio);
the adapter loads it with one key-value head per attention head, which is what the weights compute.
"""

import json
import subprocess
import sys

import pytest
from kvcdn_model_deepseek import DeepseekAdapter

from kvcdn_core.model.tiny import SAMPLE_TEXT, build_tiny_model, config_variants

UNEQUAL = [
    (arch, name)
    for arch in DeepseekAdapter.architectures
    for name, cfg in config_variants(DeepseekAdapter, arch).items()
    if cfg.get("num_key_value_heads") != cfg.get("num_attention_heads")
]


def test_unequal_head_counts_are_validated():
    assert {arch for arch, _ in UNEQUAL} == set(DeepseekAdapter.architectures)


@pytest.mark.parametrize("architecture,variant", UNEQUAL)
def test_generate_and_verify_are_token_exact(architecture, variant, tmp_path):
    model = build_tiny_model(DeepseekAdapter, architecture, tmp_path / "model", variant=variant)
    context = tmp_path / "context.txt"
    context.write_text(SAMPLE_TEXT, encoding="utf-8")
    kv = tmp_path / "doc.kv"

    def kvcdn(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "kvcdn_core", *map(str, args)], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    kvcdn("generate", "--model", model, "--context-file", context, "-o", kv, "-q")
    out = json.loads(
        kvcdn(
            "verify",
            "--model",
            model,
            "--kv-path",
            kv,
            "--question",
            "\nQ: Why?\nA:",
            "--n",
            32,
            "--format",
            "json",
            "-q",
        )
    )
    assert out["matches"] == 32, out
