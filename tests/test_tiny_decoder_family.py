"""The shared base of the thin family plugins: a family names what its tiny configs change, and
gets complete ``validation_configs`` (what ``kvcdn validate`` and the contract suite build)."""

from __future__ import annotations

import pytest

from kvcdn_core import TINY_DECODER, ModelAdapter, TinyDecoderFamily
from kvcdn_core.plugin_host.registry import adapter_classes


def test_the_configs_are_the_base_with_each_architectures_changes():
    class Toy(TinyDecoderFamily):
        family = "toy"
        tiny_changes = {"ToyForCausalLM": {}, "Toy2ForCausalLM": dict(sliding_window=16, head_dim=32)}

    assert issubclass(Toy, ModelAdapter)
    assert Toy.architectures == ("ToyForCausalLM", "Toy2ForCausalLM")
    assert Toy.validation_configs == {
        "ToyForCausalLM": TINY_DECODER,
        "Toy2ForCausalLM": {**TINY_DECODER, "sliding_window": 16, "head_dim": 32},
    }
    Toy.validation_configs["ToyForCausalLM"]["hidden_size"] = 1  # each config is its own dict
    assert TINY_DECODER["hidden_size"] == 64


def test_a_family_may_name_its_base_and_its_architectures():
    class Toy(TinyDecoderFamily):
        family = "toy"
        tiny_base = dict(TINY_DECODER, _bos=True)
        architectures = ("ToyForCausalLM", "ToyMoeForCausalLM")
        tiny_changes = {"ToyMoeForCausalLM": dict(num_local_experts=4), "ToyForCausalLM": {}}

    assert Toy.architectures == ("ToyForCausalLM", "ToyMoeForCausalLM")
    assert Toy.validation_configs["ToyMoeForCausalLM"] == {**TINY_DECODER, "_bos": True, "num_local_experts": 4}


@pytest.mark.parametrize("family", ["helium", "ernie", "cohere", "llama", "qwen", "mistral", "olmo-granite"])
def test_the_thin_shipped_families_use_the_shared_base(family):
    classes = {cls for cls in adapter_classes().values() if cls.family == family}
    assert classes and all(issubclass(cls, TinyDecoderFamily) for cls in classes), classes
    for cls in classes:
        assert set(cls.architectures) == set(cls.validation_configs)
