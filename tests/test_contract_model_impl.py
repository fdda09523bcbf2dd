"""The model-implementation contract suite fails on implementations that break the contract.
(The hf and custom implementations run it in plugins/models/*/tests/test_contract.py.)"""

import pytest
import torch
from transformers import AutoConfig, Qwen3ForCausalLM

from prime_core.specs import ModelImpl
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import model_impl as contract


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return contract.tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def config(folder):
    return contract.model_config(folder, "auto")


def transformers_build(model_class=Qwen3ForCausalLM, edit=None):
    """A build as the hf implementation does it, with ``model_class`` and an ``edit`` of the model."""

    def build(model_config, *, device="cpu"):
        if device == "meta":
            with torch.device("meta"):
                model = model_class._from_config(AutoConfig.from_pretrained(model_config.name), dtype=torch.float32)
        else:
            model = model_class.from_pretrained(model_config.name, dtype=torch.float32)
        return edit(model, device) or model if edit else model

    return build


def impl(build, adapter=None):
    return ModelImpl(name="broken", build=build, state_dict_adapter=adapter)


def test_a_correct_implementation_passes(config, folder, tmp_path):
    spec = impl(transformers_build())
    contract.check_meta_build(spec, config)
    errors = contract.check_parity(spec, config, folder, tmp_path)
    assert max(errors.values()) < 1e-5  # transformers against itself: float32 rounding only
    contract.check_state_dict_names(spec, config, folder, tmp_path / "names")
    contract.check_publishes(spec, config, folder, tmp_path / "published")


class Unpacked(Qwen3ForCausalLM):
    """Ignores position_ids and the mask: a packed row attends across its samples."""

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


class Detached(Qwen3ForCausalLM):
    """Computes the hidden states without gradients: only the LM head learns."""

    def forward(self, input_ids=None, **kwargs):
        with torch.no_grad():
            hidden = self.model(input_ids=input_ids, position_ids=kwargs.get("position_ids"),
                                attention_mask=kwargs.get("attention_mask")).last_hidden_state
        return type("Out", (), {"logits": self.lm_head(hidden)})


class KeepsItsOwnWeights(Qwen3ForCausalLM):
    """Ignores the state_dict it is asked to save (a sharded model would publish garbage)."""

    def save_pretrained(self, path, state_dict=None, **kwargs):
        return super().save_pretrained(path, **kwargs)


def halve_the_head(model, device):
    if device != "meta":
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)


def one_layer_less_on_meta(model, device):
    if device == "meta":
        model.model.layers = model.model.layers[:-1]


@pytest.mark.parametrize(("build", "message"), [
    (transformers_build(Unpacked), "packed row: logp = "),
    (transformers_build(Detached), "one sample: grad model.layers.0"),
    (transformers_build(KeepsItsOwnWeights), "one sample: grad "),
    (transformers_build(edit=halve_the_head), "one sample: logp = "),
])
def test_parity_violations(config, folder, tmp_path, build, message):
    with pytest.raises(ContractError, match=message):
        contract.check_parity(impl(build), config, folder, tmp_path)


def test_a_meta_build_of_another_structure_fails(config):
    with pytest.raises(ContractError, match="the meta build's parameters differ from the CPU build's"):
        contract.check_meta_build(impl(transformers_build(edit=one_layer_less_on_meta)), config)


def test_wrong_weights_fail_the_state_dict_check(config, folder, tmp_path):
    with pytest.raises(ContractError, match="tensors that differ from the checkpoint: \\['model.embed_tokens"):
        contract.check_state_dict_names(impl(transformers_build(edit=halve_the_head)), config, folder, tmp_path)


class DropsThePrefix:
    """An adapter that forgets to put ``model.`` back."""

    def to_hf(self, state):
        return dict(state)

    def from_hf(self, state):
        return {k.removeprefix("model."): v for k, v in state.items()}


class Renames:
    def to_hf(self, state):
        return {k.replace("self_attn", "attn"): v for k, v in state.items()}

    def from_hf(self, state):
        return {k.replace("attn", "self_attn"): v for k, v in state.items()}


@pytest.mark.parametrize(("adapter", "message"), [
    (DropsThePrefix(), "from_hf\\(to_hf\\(state\\)\\) is not the state dict"),
    (Renames(), "to_hf gives other names than the checkpoint's"),
])
def test_adapter_violations(config, folder, tmp_path, adapter, message):
    with pytest.raises(ContractError, match=message):
        contract.check_state_dict_names(impl(transformers_build(), adapter), config, folder, tmp_path)


def test_a_folder_transformers_loads_differently_fails(config, folder, tmp_path):
    class HalfPrecision(Qwen3ForCausalLM):
        def save_pretrained(self, path, state_dict=None, **kwargs):
            state_dict = {k: v.half() for k, v in (state_dict or self.state_dict()).items()}
            return super().save_pretrained(path, state_dict=state_dict, **kwargs)

    with pytest.raises(ContractError, match="loads into a different model"):
        contract.check_publishes(impl(transformers_build(HalfPrecision)), config, folder, tmp_path / "out")
