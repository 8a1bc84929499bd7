"""The quantizer contract suite: what :mod:`kvcdn_core.contracts.quantizer` promises, checked."""

from __future__ import annotations

import json
from typing import Any

from kvcdn_core import artifact
from kvcdn_core.contracts.quantizer import KEY, VALUE, Quantizer, role_of
from kvcdn_core.errors import KvcdnError

#: Layer kinds a scheme may declare.
LAYER_KINDS = artifact.LAYER_KINDS


def _tensors() -> list[tuple[str, Any]]:
    """Cache-shaped tensors with awkward content: ``[batch, heads, tokens, channels]``."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    normal = torch.randn(1, 2, 37, 24, generator=gen)
    outliers = normal.clone()
    outliers[..., 3] *= 80  # an outlier channel, as rotary dimensions of real keys have
    outliers[0, 1, 5, 7] = 4e3
    return [
        ("normal", normal),
        ("outliers", outliers),
        ("zeros", torch.zeros(1, 2, 9, 16)),
        ("constant", torch.full((1, 1, 6, 10), -0.75)),
        ("tiny", torch.randn(1, 2, 11, 8, generator=gen) * 1e-6),
        ("offset", torch.randn(1, 2, 13, 12, generator=gen) * 1e-3 + 20.0),
        ("one token", torch.randn(1, 2, 1, 33, generator=gen)),
        ("one channel", torch.randn(1, 1, 17, 1, generator=gen)),
        ("float16", (torch.randn(1, 2, 21, 16, generator=gen) * 4).to(torch.float16)),
        ("bfloat16", (torch.randn(1, 2, 21, 16, generator=gen) * 4).to(torch.bfloat16)),
        ("no tokens", torch.zeros(1, 2, 0, 16)),
    ]


def assert_quantizer_contract(cls: type[Quantizer]) -> None:
    """Check a quantizer class against the quantizer contract.

    Class attributes are well formed; parameters are checked; for keys and values of many shapes,
    dtypes and contents, :meth:`Quantizer.quantize` gives JSON-serializable records and tensor parts,
    and :meth:`Quantizer.dequantize` (also from a record that went through JSON, as it does in an
    artifact) restores shape and dtype within :meth:`Quantizer.error_bound`; the residual window is
    kept bitwise. Dequantizing leaves its parts unchanged and gives the same tensors when several
    threads dequantize at once (a streamed load does both).
    """
    import torch

    assert isinstance(cls, type) and issubclass(cls, Quantizer), f"{cls!r} is not a Quantizer subclass"
    assert cls.scheme and isinstance(cls.scheme, str), f"{cls.__name__}.scheme must name the scheme"
    assert cls.description, f"{cls.__name__}.description is empty (kvcdn quant --help shows it)"
    assert cls.supported_kinds and set(cls.supported_kinds) <= set(LAYER_KINDS), (
        f"{cls.__name__}.supported_kinds must be layer kinds of {LAYER_KINDS}"
    )
    assert cls.storage_dtype in artifact.DTYPES, (
        f"{cls.__name__}.storage_dtype {cls.storage_dtype!r} is no safetensors dtype"
    )
    assert all(isinstance(v, int) for v in cls.default_params.values()), "default_params must be integers"
    assert cls.default_output_suffix(), "default_output_suffix() is empty"
    try:
        cls(no_such_parameter=1)
    except KvcdnError:
        pass
    else:
        raise AssertionError(f"{cls.__name__} accepted an unknown parameter")

    residual = 4 if "residual" in cls.default_params else 0
    for quantizer in (cls(), cls(residual=residual) if residual else None):
        if quantizer is None:
            continue
        for label, x in _tensors():
            for role in (KEY, VALUE):
                _check_one(quantizer, role, x, f"{cls.scheme} {role} {label} residual={quantizer.residual}")
    x = torch.randn(1, 2, 9, 8)
    parts, record = cls().quantize(KEY, x)
    assert cls().dequantize(parts, record, torch.bfloat16).dtype == torch.bfloat16, "dequantize ignored dtype"
    _check_concurrent(cls)
    _check_artifact_roundtrip(cls)


def _check_artifact_roundtrip(cls: type[Quantizer]) -> None:
    """A record must survive the artifact it is written into: quantize a one-layer cache with core's
    quantizer workflow, write it with core's writer, read it back through the strict reader, and
    dequantize from what the file holds. A record key that collides with core's fields fails here
    (and in :meth:`Quantizer.quantize`), not on a user's first load."""
    import tempfile
    from pathlib import Path

    import torch

    from kvcdn_core.quant.codec import quantize_cache

    gen = torch.Generator().manual_seed(7)
    tokens = 19
    cache = {"layers.0.key": torch.randn(1, 2, tokens, 16, generator=gen)}
    cache["layers.0.value"] = torch.randn(1, 2, tokens, 16, generator=gen)
    ids = torch.arange(tokens, dtype=torch.long)
    manifest = {
        "kvcdn_version": "contract",
        "created_at": "2026-01-01T00:00:00+00:00",
        "model": {"id": "contract", "architecture": "ContractForCausalLM"},
        "compute_dtype": "float32",
        "token_count": tokens,
        "layers": [
            {"index": 0, "kind": artifact.FULL_ATTENTION, "tensors": {"key": "layers.0.key", "value": "layers.0.value"}}
        ],
    }
    quantizer = cls()
    if not quantizer.supports(artifact.FULL_ATTENTION):
        return
    result = quantize_cache(manifest, {**cache, artifact.TOKEN_IDS: ids}, quantizer)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = artifact.write_artifact(Path(tmp) / "contract.kv", result.manifest, result.tensors)
            header = artifact.read_header(path)
        except KvcdnError as exc:
            raise AssertionError(f"{cls.scheme}: an artifact it quantized is refused by the reader: {exc}") from exc
        stored = artifact.load_tensors(header)
        records = header.manifest["quantization"]["layers"][0]["tensors"]
        for local, full in (("key", "layers.0.key"), ("value", "layers.0.value")):
            rec = records[local]
            parts = {p: stored[f"{full}.{p}" if p else full] for p in rec["parts"]}
            back = quantizer.dequantize(parts, rec, torch.float32)
            x = cache[full]
            assert list(back.shape) == list(x.shape), f"{cls.scheme}: {local} read back as {list(back.shape)}"
            over = (back - x).abs() > quantizer.error_bound(role_of(local), x)
            assert not bool(over.any()), f"{cls.scheme}: {local} read back from an artifact outside the error bound"


def _check_concurrent(cls: type[Quantizer], threads: int = 4) -> None:
    """One quantizer dequantizing many tensors from several threads at once, as the loader's
    workers do: every result equals the one-thread result."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    quantizer = cls()
    encoded = [quantizer.quantize(role, x) for _, x in _tensors() for role in (KEY, VALUE)]
    alone = [quantizer.dequantize(parts, record, torch.float32) for parts, record in encoded]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(3):
            try:
                together = list(pool.map(lambda pr: quantizer.dequantize(pr[0], pr[1], torch.float32), encoded))
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                raise AssertionError(f"{cls.scheme}: dequantize failed from several threads: {exc}") from exc
            for i, (a, b) in enumerate(zip(alone, together)):
                assert a.shape == b.shape and torch.equal(a, b), (
                    f"{cls.scheme}: tensor {i} dequantized differently from several threads"
                )


def _check_one(quantizer: Quantizer, role: str, x: Any, what: str) -> None:
    import torch

    parts, record = quantizer.quantize(role, x)
    assert "" in parts, f"{what}: the codes part '' is missing"
    assert all(isinstance(k, str) and "." not in k for k in parts), f"{what}: part names must be plain strings"
    assert all(isinstance(v, torch.Tensor) for v in parts.values()), f"{what}: parts must be tensors"
    stored = json.loads(json.dumps(record))  # the manifest keeps records as JSON
    assert stored == record, f"{what}: the record does not survive JSON"
    kept = {name: part.clone() for name, part in parts.items()}
    for rec in (record, stored):
        back = quantizer.dequantize(parts, rec)
        for name, part in parts.items():
            assert torch.equal(part, kept[name]), f"{what}: dequantize changed part '{name}' in place"
        assert list(back.shape) == list(x.shape), f"{what}: dequantized shape {list(back.shape)}"
        assert back.dtype == x.dtype, f"{what}: dequantized dtype {back.dtype}, expected {x.dtype}"
    if x.shape[-2] == 0:
        return
    exact = x.to(torch.float32)
    error = (exact - quantizer.dequantize(parts, record, torch.float32)).abs()
    bound = quantizer.error_bound(role, x)
    if x.dtype != torch.float32:  # the comparison is made after rounding back to the input dtype
        error = (exact - back.to(torch.float32)).abs()
        bound = bound + exact.abs() * (2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10)
    over = error > bound
    assert not bool(over.any()), (
        f"{what}: {int(over.sum())} elements outside the error bound (worst {float((error - bound).max()):.3g})"
    )
    keep = min(quantizer.residual, x.shape[-2])
    if keep:
        tail = back.narrow(-2, x.shape[-2] - keep, keep)
        assert torch.equal(tail, x.narrow(-2, x.shape[-2] - keep, keep)), f"{what}: residual tokens changed"
