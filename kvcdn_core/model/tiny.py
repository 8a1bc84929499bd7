"""Tiny offline models for validation and tests: a byte-level BPE tokenizer and random weights.

The Hugging Face hub is not always reachable (CI, air-gapped hosts), so every adapter ships a tiny
config per architecture; this module turns one into a saved model directory that loads by path.
Weights use a wide init so greedy decoding does not sit on near-ties and its output varies.

Run ``python -m kvcdn_core.model.tiny ARCH OUT_DIR`` to build one by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from kvcdn_core.contracts.adapter import ModelAdapter

SAMPLE_TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed the northern cape. Each entry noted
the hour, the flag, the weather and the state of the sea. Over forty years the ledger grew to nine
volumes, and the harbour office came to trust it more than its own records.

Reuse is the whole point of a cache. A long document is read once, its attention keys and values
are stored, and every later question about the same document starts where the reading stopped.
The saving grows with the length of the document and with the number of questions asked of it.

In 1887 the cape saw its worst storm. Waves broke over the gallery, the lamp failed twice, and the
keeper wrote by candlelight that three schooners had turned back and one had not. The missing ship
was found in spring, beached and empty, forty miles to the south.

Engineers who run retrieval services know the pattern: the same manuals, contracts and code files
are sent to the model again and again. Prefill dominates the bill. Numbers, dates and names such as
0.25, 2048, 3.14159, March 12th and Amundsen must survive the round trip without a single change.
"""

TOKENIZER_VOCAB = 384
EOS = "<|endoftext|>"
BOS = "<|startoftext|>"


def train_tokenizer(bos: bool = False, vocab_size: int = TOKENIZER_VOCAB):
    """A small byte-level BPE trained on :data:`SAMPLE_TEXT`; any UTF-8 text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT] * 4, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    kwargs = {"bos_token": BOS} if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, **kwargs)


def model_class(architecture: str):
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture}")
    return cls


DEFAULT_VARIANT = "default"

#: The tiny decoder shape most family configs start from: 2 layers, hidden 64, 4 query heads on 2
#: key-value heads of width 16, untied output embedding (tied, a random model repeats one token).
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


#: :data:`TINY_DECODER` for multi-head latent attention (DeepSeek's MLA, GLM-MoE-DSA): a 32-wide
#: latent, an 8-wide rotary key and 16-wide plain key and value heads. Without ``head_dim``: an MLA
#: head is ``qk_nope_head_dim + qk_rope_head_dim`` wide and transformers derives ``head_dim`` (the
#: rotary width) from ``qk_rope_head_dim`` unless a config gives one (DeepSeek-V3's then wins).
#: ``num_key_value_heads`` equals the head count: MLA has no key-value groups.
TINY_MLA = dict(
    {key: value for key, value in TINY_DECODER.items() if key != "head_dim"},
    num_key_value_heads=TINY_DECODER["num_attention_heads"],
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)

#: The tiny mixture of experts of DeepSeek-lineage configs: 4 routed experts (2 per token), one
#: shared, and a dense first layer.
TINY_DEEPSEEK_MOE = dict(
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1
)


class TinyDecoderFamily(ModelAdapter):
    """The base of a family validated on one shared tiny config with a few changes per architecture.

    A family names only what differs: ``tiny_changes`` maps each architecture to the config keys it
    changes from ``tiny_base`` (:data:`kvcdn_core.TINY_DECODER` unless the family sets another), and
    the class gets the complete ``validation_configs`` built from the two and, unless it names them
    itself, ``architectures`` in the same order. Everything else is :class:`ModelAdapter`'s.
    """

    #: The config every architecture of the family starts from.
    tiny_base: ClassVar[dict[str, Any]] = TINY_DECODER
    #: architecture → the keys its tiny config changes (``{}``: the base as it is).
    tiny_changes: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tiny_changes" in vars(cls):
            cls.validation_configs = {arch: {**cls.tiny_base, **changes} for arch, changes in cls.tiny_changes.items()}
            if "architectures" not in vars(cls):
                cls.architectures = tuple(cls.tiny_changes)


def config_variants(adapter_cls, architecture: str) -> dict[str, dict]:
    """Variant name → tiny config kwargs of ``architecture``: ``default`` first, then the extras.

    ``validation_configs[arch]`` is the default shape; ``validation_variants[arch]`` (optional) lists
    more, each naming itself with a ``_variant`` key and holding only what it changes: head counts,
    GQA ratios, head widths, tied embeddings, RoPE scalings... so that no architecture is validated
    on one lucky shape.
    """
    base = dict(adapter_cls.validation_configs[architecture])
    variants = {DEFAULT_VARIANT: base}
    for extra in getattr(adapter_cls, "validation_variants", {}).get(architecture, ()):
        extra = dict(extra)
        name = extra.pop("_variant")
        if name in variants:
            raise ValueError(f"{adapter_cls.__name__}: {architecture} has two variants named {name!r}")
        variants[name] = {**base, **extra}
    return variants


def build_tiny_model(
    adapter_cls,
    architecture: str,
    out_dir: str | Path,
    seed: int = 0,
    init_std: float = 0.3,
    variant: str | None = None,
) -> Path:
    """Build one tiny config of ``architecture`` (the first variant by default) and save it."""
    import torch

    from kvcdn_core.contracts.adapter import quiet_transformers

    quiet_transformers()
    out = Path(out_dir)
    variants = config_variants(adapter_cls, architecture)
    kwargs = dict(variants[variant or DEFAULT_VARIANT])
    bos = kwargs.pop("_bos", False)
    tokenizer = train_tokenizer(bos=bos)
    cls = model_class(architecture)
    kwargs.setdefault("vocab_size", len(tokenizer))
    kwargs.setdefault("initializer_range", init_std)
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    if bos:
        kwargs.setdefault("bos_token_id", tokenizer.bos_token_id)
    config = cls.config_class(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def teach_tiny_model(
    model_dir: Path, out_dir: Path, text: str = SAMPLE_TEXT, steps: int = 120, lr: float = 3e-3
) -> float:
    """Train a saved tiny model on ``text`` (whole, or in windows of its position limit); save it.

    Random weights decode through near-ties that any lossy cache may flip; a few seconds of training
    gives decisive logits, as trained models have. Returns the last loss.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tok(text)["input_ids"]])
    limit = int(getattr(model.config, "n_positions", 0) or getattr(model.config, "max_position_embeddings", 4096))
    windows = [ids[:, :limit], ids[:, -limit:]] if ids.shape[1] > limit else [ids]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = None
    for step in range(steps):
        w = windows[step % len(windows)]
        loss = model(input_ids=w, labels=w).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    assert loss is not None, "no training step ran"
    return float(loss.detach())


def main(argv=None) -> int:
    import argparse

    from kvcdn_core.plugin_host.registry import adapter_classes

    parser = argparse.ArgumentParser(prog="python -m kvcdn_core.model.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("architecture", help="e.g. Qwen3ForCausalLM")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    adapters = adapter_classes()
    if args.architecture not in adapters:
        print(f"error: no installed adapter serves {args.architecture}", file=sys.stderr)
        return 2
    print(build_tiny_model(adapters[args.architecture], args.architecture, args.out_dir))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
