"""Model sessions: load a model through its adapter, prefill, continue greedily, save and load caches.

Everything here imports torch lazily: command modules import this file at call time only.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvcdn_core
from kvcdn_core import artifact
from kvcdn_core.artifact.manifest import COMPUTE_DTYPES, LayerEntry, Manifest, ModelInfo, manifest_of, reuse_of
from kvcdn_core.errors import ArtifactError, KvcdnError, interruption
from kvcdn_core.model.defaults import DEFAULT_CHUNK, DEFAULT_MODEL, DEFAULT_QUESTION  # noqa: F401
from kvcdn_core.model.files import architecture_of, fingerprint, fingerprint_differences, read_config, resolve_model_dir
from kvcdn_core.plugin_host.registry import adapter_for, claim_note
from kvcdn_core.progress import Progress

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvcdn_core.contracts.adapter import ModelAdapter


@dataclasses.dataclass
class Session:
    """A loaded model, its tokenizer, the adapter that drives it and its fingerprint."""

    adapter: ModelAdapter
    model: Any
    tokenizer: Any
    model_ref: str
    revision: str | None
    model_dir: Path
    fingerprint: dict
    device: str
    dtype: str


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise KvcdnError("--device cuda asked for, but torch sees no CUDA device")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise KvcdnError("--device mps asked for, but torch sees no MPS device")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """auto: float32 on CPU (several times faster than bfloat16 without AMX), bfloat16 on CUDA."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def load_session(
    model_ref: str, revision: str | None = None, device: str = "auto", dtype: str = "auto", adapter_cls=None
) -> Session:
    """Load a model through the adapter that claims it (or ``adapter_cls``, for contract tests)."""
    model_dir = resolve_model_dir(model_ref, revision)
    config = read_config(model_dir)
    architecture = architecture_of(config)
    adapter = (adapter_cls or adapter_for(architecture, config))()
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    try:
        model, tokenizer = adapter.load(model_dir, device, dtype)
    except KvcdnError as exc:
        # an architecture two family plugins claim: the refusal says whose adapter was used
        note = "" if adapter_cls else claim_note("architectures", architecture)
        if not note:
            raise
        raise KvcdnError(f"{exc}{note}") from None
    except Exception as exc:
        interrupted = interruption(exc)
        if interrupted is not None:  # a Ctrl-C during the load is an interrupt, whatever wraps it
            raise interrupted from None
        note = "" if adapter_cls else claim_note("architectures", architecture)
        raise KvcdnError(f"cannot load model '{model_ref}': {type(exc).__name__}: {exc}{note}") from None
    local = Path(model_ref).expanduser()
    ref = str(local.resolve()) if local.is_dir() else model_ref
    return Session(adapter, model, tokenizer, ref, revision, model_dir, fingerprint(model_dir), device, dtype)


def session_for_artifact(
    manifest: Manifest | None,
    model: str | None = None,
    revision: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> Session:
    """The session to continue an artifact: the model its manifest names, at its compute dtype.

    ``model`` overrides the named model (then only ``revision`` picks its revision); ``dtype`` other
    than ``auto`` overrides the compute dtype. Without a manifest, ``model`` or the default model.
    """
    named = manifest.model if manifest else ModelInfo()
    if dtype == "auto" and manifest and manifest.compute_dtype in COMPUTE_DTYPES:
        dtype = manifest.compute_dtype
    if model is None and revision is None:
        revision = named.revision
    return load_session(model or named.id or DEFAULT_MODEL, revision, device, dtype)


def _ids_tensor(session: Session, ids: list[int]):
    import torch

    return torch.tensor([ids], dtype=torch.long, device=session.device)


def prefill(
    session: Session,
    ids: list[int],
    chunk: int = DEFAULT_CHUNK,
    progress: bool = True,
    cache=None,
    label: str = "prefill",
):
    """Run ``ids`` through the model in chunks; return ``(cache, logits of the last token)``."""
    import torch

    if not ids:
        raise KvcdnError("nothing to prefill: the context has no tokens")
    cache = session.adapter.new_cache(session.model) if cache is None else cache
    logits = None
    with torch.inference_mode(), Progress(len(ids), label, enabled=progress) as bar:
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            logits, cache = session.adapter.last_logits(session.model, _ids_tensor(session, piece), cache)
            bar.update(len(piece))
    return cache, logits


def greedy(session: Session, cache, prompt_ids: list[int], n: int, forced: list[int] | None = None):
    """Feed ``prompt_ids`` on ``cache``, then decode ``n`` tokens greedily.

    Returns ``(token ids, per-step logits)``. With ``forced``, step i feeds ``forced[i]`` instead of
    the argmax (teacher forcing), so two paths can be compared logit by logit.
    """
    import torch

    if not prompt_ids:
        raise KvcdnError("the question has no tokens")
    with torch.inference_mode():
        logits, cache = session.adapter.last_logits(session.model, _ids_tensor(session, prompt_ids), cache)
    return decode_from(session, cache, logits, n, forced)


def decode_from(session: Session, cache, logits, n: int, forced: list[int] | None = None):
    """Decode ``n`` tokens greedily from the logits of the last fed token: ``(ids, step logits)``."""
    import torch

    tokens, step_logits = [], []
    with torch.inference_mode():
        for i in range(n):
            step_logits.append(logits.cpu())
            nxt = int(torch.argmax(logits))
            tokens.append(nxt)
            if i == n - 1:
                break
            feed = forced[i] if forced is not None else nxt
            logits, cache = session.adapter.last_logits(session.model, _ids_tensor(session, [feed]), cache)
    return tokens, step_logits


def decode(session: Session, ids: list[int]) -> str:
    return session.tokenizer.decode(ids, skip_special_tokens=False)


def build_manifest(session: Session, layers: list[LayerEntry], context: str) -> dict:
    return model_manifest(
        session.model_ref, session.revision, session.adapter.family, session.fingerprint, session.dtype, layers, context
    )


def model_manifest(
    model_ref: str,
    revision: str | None,
    family: str | None,
    fingerprint: dict,
    dtype: str,
    layers: list[LayerEntry],
    context: str | None,
) -> dict:
    """The manifest of an unquantized cache, for writers without a :class:`Session` (serving engines)."""
    return {
        "kvcdn_version": kvcdn_core.__version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "id": model_ref,
            "revision": revision,
            "family": family,
            **fingerprint,
        },
        "compute_dtype": dtype,
        "context": context,
        "layers": [layer.to_dict() for layer in layers],
        "reuse": reuse_of(layers),
        "quantization": None,
    }


def save_cache(session: Session, cache, ids: list[int], context: str, path: Path) -> Path:
    import torch

    layers, tensors = session.adapter.export_cache(session.model, cache)
    manifest = build_manifest(session, layers, context)
    tensors[artifact.TOKEN_IDS] = torch.tensor(ids, dtype=torch.long)
    return artifact.write_artifact(path, manifest, tensors)


def generate(
    session: Session, context: str, path: Path, chunk: int = DEFAULT_CHUNK, progress: bool = True
) -> tuple[Path, list[int]]:
    """Prefill a document and save its cache as an artifact."""
    ids = session.adapter.encode_context(session.tokenizer, context)
    cache, _ = prefill(session, ids, chunk=chunk, progress=progress)
    return save_cache(session, cache, ids, context, path), ids


def check_model(session: Session, typed: Manifest, force: bool = False) -> None:
    """Refuse an artifact made with another model (by fingerprint), unless ``force``."""
    want = typed.model
    problems = [f"{part} differs" for part in fingerprint_differences(dataclasses.asdict(want), session.fingerprint)]
    if problems and not force:
        raise ArtifactError(
            f"artifact was made with model '{want.id}' ({want.architecture}), "
            f"not the loaded '{session.model_ref}': {', '.join(problems)}; pass --force to use it anyway"
        )
    dtype = typed.compute_dtype
    if dtype != session.dtype and not force:
        raise ArtifactError(
            f"artifact was computed in {dtype}, the model is loaded in {session.dtype}; "
            f"pass --dtype {dtype} (or --force to convert)"
        )


def load_cache(
    session: Session, header: artifact.Header, force: bool = False, verify_hashes: bool = True, stream: bool = False
):
    """Load an artifact's cache into tensors for the session's model; return ``(cache, token ids)``.

    With ``stream`` the cache comes back at once and fills layer by layer in the background
    (:mod:`kvcdn_core.artifact.layer_stream`): the model may start its forward pass while later layers are
    still read (and dequantized, for a quantized artifact), and meets each layer only once it is
    verified. Used where the adapter allows it (:meth:`ModelAdapter.streams_layers`) and a core is
    free for the loader next to torch's threads (:func:`kvcdn_core.cores.stream_workers`; without
    one, streaming measured slower than loading first); otherwise a full load. Both give the same
    tensors bit for bit.
    """
    typed = manifest_of(header)
    check_model(session, typed, force)
    layers = typed.layers
    convert = _converter(session, typed.compute_dtype, layers)
    if stream and session.adapter.streams_layers(layers):
        import torch

        from kvcdn_core.cores import stream_workers

        workers = stream_workers(torch.get_num_threads())
        if workers:
            source = _layer_source(session, header, layers, convert)
            return _stream_cache(session, header, source, layers, verify_hashes, workers)
    if typed.quantization:
        from kvcdn_core.quant.codec import dequantize_tensors

        tensors = dequantize_tensors(header, session.device, verify_hashes)
    else:
        tensors = artifact.load_tensors(header, verify_hashes=verify_hashes)
    ids = tensors.pop(artifact.TOKEN_IDS).tolist()
    tensors = {name: convert(name, t) for name, t in tensors.items()}
    cache = session.adapter.import_cache(session.model, layers, tensors, session.device)
    return cache, ids


def _converter(session: Session, compute_dtype: str, layers: tuple[LayerEntry, ...]):
    """``convert(name, tensor)``: a floating tensor in the session's dtype, unless it must stay wider.

    Linear-attention and recurrent layers keep their state wider than the compute dtype (float32
    under bfloat16) on purpose; narrowing it on load would make the restored state inexact. A tensor
    already in the target dtype is returned as is (no copy).
    """
    import torch

    target, computed = getattr(torch, session.dtype), getattr(torch, compute_dtype)
    kept = {name for layer in layers if layer.keeps_state for name in layer.tensors.values()}

    def convert(name: str, t):
        if t.is_floating_point() and t.dtype != target and (name not in kept or t.dtype == computed):
            return t.to(target)
        return t

    return convert


def _layer_source(session: Session, header: artifact.Header, layers: tuple[LayerEntry, ...], convert):
    """What the streamed load builds each layer from: its stored tensors, or for a quantized
    artifact its parts dequantized on the device (the same steps as the whole load, per layer)."""
    from kvcdn_core.artifact.layer_stream import LayerSource

    device = session.device
    if not header.manifest.get("quantization"):
        return LayerSource(
            stored_names=lambda i: list(layers[i].tensors.values()),
            build=lambda i, stored: {
                local: convert(full, stored(full)).to(device) for local, full in layers[i].tensors.items()
            },
        )
    from kvcdn_core.quant.codec import QuantizedLayers

    quantized = QuantizedLayers(header)

    def build(i: int, stored) -> dict:
        full = quantized.dequantize_layer(i, lambda name: stored(name).to(device))
        return {local: convert(name, full[name]) for local, name in layers[i].tensors.items()}

    return LayerSource(stored_names=quantized.stored_names, build=build)


def _stream_cache(
    session: Session, header: artifact.Header, source, layers: tuple[LayerEntry, ...], verify_hashes: bool, workers: int
):
    from kvcdn_core.artifact import tensor_io
    from kvcdn_core.artifact.layer_stream import LayerStream

    reader = tensor_io.TensorReader(header)
    reader.fetch(*reader.span(artifact.TOKEN_IDS))
    if verify_hashes and not reader.hash_matches(artifact.TOKEN_IDS):
        reader.close()
        raise ArtifactError(f"{header.path}: corrupted: {header.digest} mismatch in '{artifact.TOKEN_IDS}'")
    ids = tensor_io.as_tensor(reader, artifact.TOKEN_IDS).tolist()
    cache = session.adapter.new_cache(session.model)
    targets = session.adapter.cache_layers(cache)
    if len(targets) != len(layers):
        reader.close()
        raise ArtifactError(f"artifact has {len(layers)} cache layers, the loaded model has {len(targets)}")
    LayerStream(session.adapter, reader, cache, targets, layers, source, verify_hashes, workers)
    return cache, ids
