"""kvcdn model family: state-space models (Mamba, Mamba2, FalconMamba).

Their cache is not per-token keys and values but one recurrent state per layer: the last few inputs
of the causal convolution (``conv_state``) and the SSM state (``recurrent_state``). Such a state
summarises the whole prefix, so an artifact is reusable only as that whole prefix: every layer is
``recurrent_state`` and the manifest says ``reuse: whole_prefix``.

transformers 5.24 runs a multi-token input on Mamba and FalconMamba with a scan that starts from a
zero state, dropping the cached one. :meth:`SSMAdapter.forward` seeds that scan with the cached state
instead (:mod:`kvcdn_model_ssm.scan`), or, on a mixer it does not know, feeds the tokens one at a
time through the model's own single-step path; either way chunked prefill and a multi-token question
on a restored state are exact. Mamba2's chunked scan takes the saved state itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcdn_core import ArtifactError, KvcdnError, LayerEntry, ModelAdapter, artifact, hookimpl
from kvcdn_model_ssm import scan

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__version__ = "0.1.0"

_COMMON = dict(hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4)

#: ``config.model_type`` values whose multi-token forward ignores a cached state (transformers 5.24).
STATE_DROPPING_MODEL_TYPES = ("mamba", "falcon_mamba")
#: Their mixer classes, which :func:`seed_mixers` wraps.
MIXER_CLASSES = ("MambaMixer", "FalconMambaMixer")


class SSMAdapter(ModelAdapter):
    family = "ssm"
    architectures = ("MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM")
    validation_configs = {
        # A wider time-step range keeps this one's greedy output varied on the sample text.
        "MambaForCausalLM": dict(_COMMON, time_step_max=0.5),
        # num_heads * head_dim == expand * hidden_size; chunk_size below the 64-token prefill chunk
        # so that the chunked scan crosses its own chunk boundaries with a carried state.
        "Mamba2ForCausalLM": dict(_COMMON, num_heads=8, head_dim=16, n_groups=2, chunk_size=32),
        "FalconMambaForCausalLM": dict(_COMMON),
    }

    # -- running ------------------------------------------------------------------------------

    def forward(self, model: Any, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run ``input_ids`` on ``cache``, continuing from its state.

        Only the new tokens are fed, never the cached prefix (``generate()`` would re-run it: an
        all-recurrent cache has no sequence length to skip by). On models whose multi-token path
        restarts from zeros, the mixers' scan is seeded with the cached state.
        """
        if input_ids.shape[1] == 1 or not self._restarts_from_zero(model, cache):
            return super().forward(model, input_ids, cache)
        if seed_mixers(model):
            return super().forward(model, input_ids, cache)
        return scan.step_by_step(super().forward, model, input_ids, cache)

    def _restarts_from_zero(self, model: Any, cache: Any) -> bool:
        if model.config.model_type not in STATE_DROPPING_MODEL_TYPES:
            return False
        return any(any(layer.has_previous_state.values()) for layer in self.cache_layers(cache))

    # -- export / import ------------------------------------------------------------------------

    def layer_kind(self, layer: Any) -> str:
        from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
            return artifact.RECURRENT_STATE
        raise KvcdnError(
            f"cache layer type {type(layer).__name__} is not a recurrent state; the ssm adapter "
            "serves pure state-space models only; no artifact was written"
        )

    def export_layer(self, index: int, layer: Any) -> tuple[LayerEntry, dict[str, torch.Tensor]]:
        kind = self.layer_kind(layer)
        named = self.export_linear_state(layer)
        return LayerEntry(index, kind, family_fields={"conv_kernel": int(layer.conv_kernel_size[0] or 0)}), named

    def import_layer(self, entry: LayerEntry, named: dict[str, torch.Tensor], layer: Any) -> None:
        kind = self.layer_kind(layer)
        if entry.kind != kind:
            raise ArtifactError(f"layer {entry.index} is '{entry.kind}' in the artifact but '{kind}' in the model")
        self.import_linear_state(entry, named, layer)


def seed_mixers(model: Any) -> bool:
    """Make each Mamba/FalconMamba mixer of ``model`` continue multi-token input from the cache.

    Returns False (and changes nothing) when a mixer lacks what
    :func:`kvcdn_model_ssm.scan.continue_mixer` reads.
    """
    return scan.seed_mixers(model, MIXER_CLASSES, scan.continue_mixer, scan.supports)


@hookimpl
def kvcdn_register_model_adapters() -> list[type[SSMAdapter]]:
    return [SSMAdapter]
