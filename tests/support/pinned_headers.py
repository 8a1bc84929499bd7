"""The `.kv` header of a tiny model per cache layout, with what varies between runs blanked out.

Pins the on-disk format of layer entries: ``tests/support/pinned_headers.json`` holds the headers
an earlier kvcdn wrote, and ``tests/test_pinned_headers.py`` checks that today's writer produces
the same bytes. Run ``python -m tests.support.pinned_headers`` to write the file again (only when
the format is meant to change).
"""

from __future__ import annotations

import json
import re
import struct
import sys
import tempfile
from pathlib import Path

PINNED = Path(__file__).with_suffix(".json")
CONTEXT = (
    "The lighthouse keeper kept a ledger of every ship that passed the northern cape. Each entry noted "
    "the hour, the flag, the weather and the state of the sea."
)
#: One architecture per cache layout and per family that adds its own layer fields.
ARCHITECTURES = (
    "LlamaForCausalLM",  # full attention
    "Cohere2ForCausalLM",  # sliding window: window, cumulative_length
    "DeepseekV3ForCausalLM",  # MLA latent: kv_lora_rank, qk_rope_head_dim
    "GPTNeoForCausalLM",  # kv_heads, position_encoding, attention_window
    "FalconForCausalLM",  # repeated_heads
    "Qwen3NextForCausalLM",  # linear attention: conv_kernel
    "MambaForCausalLM",  # recurrent state
)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")


def header_text(path: Path, model_dir: Path) -> str:
    """The manifest as written (its exact JSON text) and the safetensors tensor table, less the
    time, the model path and the 64-digit hex digests: the tensors' bytes depend on the CPU's float arithmetic,
    and safetensors orders its metadata keys and pads the header as it likes; the format does not."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    metadata = header.pop("__metadata__")
    manifest = metadata.pop("kvcdn.manifest").replace(json.dumps(str(model_dir))[1:-1], "MODEL")
    manifest = _TIME.sub("TIME", _SHA256.sub("SHA256", manifest))
    return json.dumps({"manifest": manifest, "metadata": metadata, "tensors": header}, sort_keys=True)


def headers(workdir: Path) -> dict[str, str]:
    from kvcdn_core import runtime
    from kvcdn_core.model.tiny import build_tiny_model
    from kvcdn_core.plugin_host.registry import adapter_classes

    adapters = adapter_classes()
    out = {}
    for architecture in ARCHITECTURES:
        model_dir = build_tiny_model(adapters[architecture], architecture, workdir / architecture)
        session = runtime.load_session(str(model_dir), device="cpu", dtype="float32")
        path, _ = runtime.generate(session, CONTEXT, workdir / f"{architecture}.kv", progress=False)
        out[architecture] = header_text(path, model_dir)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        PINNED.write_text(json.dumps(headers(Path(tmp)), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(PINNED)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
