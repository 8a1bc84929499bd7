"""kvcdn core: the plugin contract, the `.kv` artifact format and the transformers runtime.

This module is the public plugin API: a plugin imports what it needs from ``kvcdn_core`` and from
nowhere else in core (``kvcdn_core.testing`` is the public test API). Names load lazily on first
use, so importing this package stays cheap: it never imports torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

__version__ = "0.1.0"

#: The marker plugins use to implement kvcdn hooks: ``@kvcdn_core.hookimpl``.
hookimpl = pluggy.HookimplMarker("kvcdn")

#: Public name → the module that defines it (loaded on first access).
_EXPORTS = {
    # contracts
    "ModelAdapter": "kvcdn_core.contracts.adapter",
    "Quantizer": "kvcdn_core.contracts.quantizer",
    "KEY": "kvcdn_core.contracts.quantizer",
    "VALUE": "kvcdn_core.contracts.quantizer",
    "role_of": "kvcdn_core.contracts.quantizer",
    "StorageBackend": "kvcdn_core.contracts.storage",
    "ObjectInfo": "kvcdn_core.contracts.storage",
    "ObjectNotFound": "kvcdn_core.contracts.storage",
    "NotSupported": "kvcdn_core.contracts.storage",
    "safe_key": "kvcdn_core.contracts.storage",
    "check_prefix": "kvcdn_core.contracts.storage",
    # numerics shared by quantization schemes
    "round_up_param": "kvcdn_core.quant.numerics",
    "round_down_param": "kvcdn_core.quant.numerics",
    "safe_reciprocal": "kvcdn_core.quant.numerics",
    # the artifact format: layer kinds and the token-id tensor
    "FULL_ATTENTION": "kvcdn_core.artifact",
    "SLIDING_WINDOW": "kvcdn_core.artifact",
    "MLA_LATENT": "kvcdn_core.artifact",
    "MLA_INDEXED": "kvcdn_core.artifact",
    "LINEAR_ATTENTION": "kvcdn_core.artifact",
    "RECURRENT_STATE": "kvcdn_core.artifact",
    "LINEAR_AND_FULL_ATTENTION": "kvcdn_core.artifact",
    "TOKEN_IDS": "kvcdn_core.artifact",
    "layer_tensor_name": "kvcdn_core.artifact",
    # the manifest, typed: layer entries adapters build and read, and the whole manifest
    "LayerEntry": "kvcdn_core.artifact.manifest",
    "Manifest": "kvcdn_core.artifact.manifest",
    "reuse_of": "kvcdn_core.artifact.manifest",
    "manifest_of": "kvcdn_core.artifact.manifest",
    # the one text rule for every user string a listing shows (names, labels, filters)
    "text_problem": "kvcdn_core.text",
    "nfc": "kvcdn_core.text",
    # linear-attention state layers (Qwen3-Next, Qwen3.5 and other hybrids)
    "LinearAttentionLayers": "kvcdn_core.model.linear_attention",
    "is_linear_attention": "kvcdn_core.model.linear_layers",
    "set_linear_token_count": "kvcdn_core.model.linear_layers",
    # multi-head latent attention layers, with DeepSeek sparse attention's indexer (DeepSeek, GLM-MoE-DSA, Kimi Linear)
    "MlaLayers": "kvcdn_core.model.mla",
    "mla_widths": "kvcdn_core.model.mla",
    "ungroup_mla_heads": "kvcdn_core.model.mla",
    # models: files, fingerprint, tiny validation configs, the validation run
    "resolve_model_dir": "kvcdn_core.model.files",
    "fingerprint": "kvcdn_core.model.files",
    "fingerprint_differences": "kvcdn_core.model.files",
    "read_config": "kvcdn_core.model.files",
    "architecture_of": "kvcdn_core.model.files",
    "TINY_DECODER": "kvcdn_core.model.tiny",
    "TINY_MLA": "kvcdn_core.model.tiny",
    "TINY_DEEPSEEK_MOE": "kvcdn_core.model.tiny",
    "TinyDecoderFamily": "kvcdn_core.model.tiny",
    "validate_tiny": "kvcdn_core.exactness.architecture",
    # quantized artifacts
    "dequantize_tensors": "kvcdn_core.quant.codec",
    # lookup
    "adapter_for": "kvcdn_core.plugin_host.registry",
    "quantizer_for": "kvcdn_core.plugin_host.registry",
    "open_storage": "kvcdn_core.plugin_host.registry",
    # built-ins other plugins build on
    "LocalStorage": "kvcdn_core.builtin.local_storage",
    # errors (exit codes 2, 1, 2)
    "KvcdnError": "kvcdn_core.errors",
    "CheckFailed": "kvcdn_core.errors",
    "ArtifactError": "kvcdn_core.errors",
    # what library code reports while it works (a command shows it; see kvcdn_core.notices)
    "warn": "kvcdn_core.notices",
    "note": "kvcdn_core.notices",
    "KvcdnWarning": "kvcdn_core.notices",
    "KvcdnNote": "kvcdn_core.notices",
    # files, paths, progress and output
    "atomic_open": "kvcdn_core.atomic",
    "atomic_path": "kvcdn_core.atomic",
    "atomic_write_stream": "kvcdn_core.atomic",
    "write_json_atomic": "kvcdn_core.atomic",
    "fsync_dir": "kvcdn_core.atomic",
    "config_home": "kvcdn_core.paths",
    "cache_home": "kvcdn_core.paths",
    "data_home": "kvcdn_core.paths",
    "ensure_kv_suffix": "kvcdn_core.paths",
    "check_output": "kvcdn_core.paths",
    "input_artifact": "kvcdn_core.paths",
    # composition's defaults, shared by `continue` and the hosted `infer`
    "DEFAULT_RECOMPUTE": "kvcdn_core.model.defaults",
    "DEFAULT_COMPOSE_RULE": "kvcdn_core.model.defaults",
    "COMPOSE_RULES": "kvcdn_core.model.defaults",
    "Progress": "kvcdn_core.progress",
    "human_bytes": "kvcdn_core.progress",
    "emit_json": "kvcdn_core.cli.render",
    "format_option": "kvcdn_core.cli.commands.common",
    "render": "kvcdn_core.cli.render",
    "print_table": "kvcdn_core.cli.render",
}

#: Public modules, and the modules inside them: the `.kv` format (read, write, validate), model
#: sessions (load, prefill, decode), prefix search (index, rank, reuse), declared settings, the
#: chunk store (keys, records, packing, its prefix index) and composition of several artifacts.
_MODULES = ("artifact", "compose", "runtime", "search", "settings", "store")

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and editors (tests/test_public_api.py keeps it in step)
    from kvcdn_core import artifact as artifact, runtime as runtime, search as search, settings as settings
    from kvcdn_core import compose as compose, store as store
    from kvcdn_core.contracts.adapter import ModelAdapter as ModelAdapter
    from kvcdn_core.contracts.quantizer import Quantizer as Quantizer, KEY as KEY, VALUE as VALUE, role_of as role_of
    from kvcdn_core.contracts.storage import (
        StorageBackend as StorageBackend,
        ObjectInfo as ObjectInfo,
        ObjectNotFound as ObjectNotFound,
        NotSupported as NotSupported,
        safe_key as safe_key,
        check_prefix as check_prefix,
    )
    from kvcdn_core.quant.numerics import (
        round_up_param as round_up_param,
        round_down_param as round_down_param,
        safe_reciprocal as safe_reciprocal,
    )
    from kvcdn_core.artifact import (
        FULL_ATTENTION as FULL_ATTENTION,
        SLIDING_WINDOW as SLIDING_WINDOW,
        MLA_LATENT as MLA_LATENT,
        MLA_INDEXED as MLA_INDEXED,
        LINEAR_ATTENTION as LINEAR_ATTENTION,
        RECURRENT_STATE as RECURRENT_STATE,
        LINEAR_AND_FULL_ATTENTION as LINEAR_AND_FULL_ATTENTION,
        TOKEN_IDS as TOKEN_IDS,
        layer_tensor_name as layer_tensor_name,
    )
    from kvcdn_core.text import text_problem as text_problem, nfc as nfc
    from kvcdn_core.artifact.manifest import (
        LayerEntry as LayerEntry,
        Manifest as Manifest,
        reuse_of as reuse_of,
        manifest_of as manifest_of,
    )
    from kvcdn_core.model.linear_attention import (
        LinearAttentionLayers as LinearAttentionLayers,
    )
    from kvcdn_core.model.linear_layers import (
        is_linear_attention as is_linear_attention,
        set_linear_token_count as set_linear_token_count,
    )
    from kvcdn_core.model.mla import (
        MlaLayers as MlaLayers,
        mla_widths as mla_widths,
        ungroup_mla_heads as ungroup_mla_heads,
    )
    from kvcdn_core.model.files import (
        resolve_model_dir as resolve_model_dir,
        fingerprint as fingerprint,
        fingerprint_differences as fingerprint_differences,
        read_config as read_config,
        architecture_of as architecture_of,
    )
    from kvcdn_core.model.tiny import (
        TINY_DECODER as TINY_DECODER,
        TINY_MLA as TINY_MLA,
        TINY_DEEPSEEK_MOE as TINY_DEEPSEEK_MOE,
        TinyDecoderFamily as TinyDecoderFamily,
    )
    from kvcdn_core.exactness.architecture import validate_tiny as validate_tiny
    from kvcdn_core.quant.codec import dequantize_tensors as dequantize_tensors
    from kvcdn_core.plugin_host.registry import (
        adapter_for as adapter_for,
        quantizer_for as quantizer_for,
        open_storage as open_storage,
    )
    from kvcdn_core.builtin.local_storage import LocalStorage as LocalStorage
    from kvcdn_core.errors import KvcdnError as KvcdnError, CheckFailed as CheckFailed, ArtifactError as ArtifactError
    from kvcdn_core.notices import warn as warn, note as note, KvcdnWarning as KvcdnWarning, KvcdnNote as KvcdnNote
    from kvcdn_core.atomic import (
        atomic_open as atomic_open,
        atomic_path as atomic_path,
        atomic_write_stream as atomic_write_stream,
        write_json_atomic as write_json_atomic,
        fsync_dir as fsync_dir,
    )
    from kvcdn_core.paths import (
        config_home as config_home,
        cache_home as cache_home,
        data_home as data_home,
        ensure_kv_suffix as ensure_kv_suffix,
        check_output as check_output,
        input_artifact as input_artifact,
    )
    from kvcdn_core.progress import Progress as Progress, human_bytes as human_bytes
    from kvcdn_core.model.defaults import (
        DEFAULT_RECOMPUTE as DEFAULT_RECOMPUTE,
        DEFAULT_COMPOSE_RULE as DEFAULT_COMPOSE_RULE,
        COMPOSE_RULES as COMPOSE_RULES,
    )
    from kvcdn_core.cli.render import emit_json as emit_json, render as render, print_table as print_table
    from kvcdn_core.cli.commands.common import format_option as format_option

__all__ = ["__version__", "hookimpl", *_MODULES, *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"kvcdn_core.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcdn_core' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
