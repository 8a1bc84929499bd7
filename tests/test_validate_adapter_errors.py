"""A config whose architecture no installed plugin claims gets one clear line naming the extra."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcdn_core.errors import KvcdnError
from kvcdn_core.plugin_host import registry

FAMILY_EXTRAS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi",
    "PhiForCausalLM": "phi",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm",
    "OlmoForCausalLM": "olmo-granite",
    "Olmo2ForCausalLM": "olmo-granite",
    "GraniteForCausalLM": "olmo-granite",
    "GraniteMoeForCausalLM": "olmo-granite",
    "StableLmForCausalLM": "olmo-granite",
    "Starcoder2ForCausalLM": "olmo-granite",
}


@pytest.mark.parametrize("architecture,extra", sorted(FAMILY_EXTRAS.items()))
def test_unclaimed_architecture_names_its_extra(kvcdn_host, architecture, extra):
    with pytest.raises(KvcdnError) as info:
        registry.adapter_for(architecture)
    message = str(info.value)
    assert f"no installed kvcdn model plugin serves architecture '{architecture}'" in message
    assert "installed families: none" in message
    assert message.endswith(f"pip install 'kvcdn[{extra}]'")


def test_unknown_architecture_points_at_all(kvcdn_host):
    with pytest.raises(KvcdnError, match=r"kvcdn\[all\]"):
        registry.adapter_for("FrobnicatorForCausalLM")


def test_guess_agrees_with_every_installed_adapter(discovered_host):
    """The hint in the error must be the extra that really installs the architecture's plugin."""
    adapters = discovered_host.model_adapters()
    wrong = {
        arch: (registry._guess_extra(arch), cls.extra_name())
        for arch, cls in adapters.items()
        if registry._guess_extra(arch) != cls.extra_name()
    }
    assert not wrong, f"_guess_extra disagrees with the installed adapters (guess, real): {wrong}"


def test_validate_model_no_plugin_claims(kvcdn_host, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    from kvcdn_core.cli.app import make_cli

    result = CliRunner().invoke(make_cli(), ["validate", "--model", str(tmp_path), "-q"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: no installed kvcdn model plugin serves architecture 'Gemma2ForCausalLM'")
    assert line.endswith("pip install 'kvcdn[gemma]'")
