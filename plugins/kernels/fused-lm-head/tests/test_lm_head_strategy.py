"""The ``fused_lm_head`` strategy inside the trainer's build: with
``trainer.model.fused_lm_head_token_chunk_size`` a native model returns log-probabilities and
entropies computed without the full logits, equal (float32) to the vanilla logits path in value
and gradient; a model that computes its own logits is refused with the fix."""

import pytest
import torch

from prime_core.config.checks import section_model
from prime_core.distributed import World
from prime_core.parity import TINY
from prime_core.plugins import PluginManager
from prime_core.trainer.build import build_policy
from prime_core.trainer.model import predicted_logprobs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("m") / "tiny", **TINY)


def _build(tiny, impl, chunk):
    manager = PluginManager(autoload=True, disabled=()).load()
    config = section_model("trainer", "model", manager)(name=str(tiny), impl=impl, dtype="float32",
                                                       fused_lm_head_token_chunk_size=chunk)
    policy = build_policy(config, manager, World())
    assert ("fused_lm_head" in policy.applied) == (chunk != "disabled")
    return policy.model


@pytest.mark.parametrize("chunk", [5, "auto"])
def test_fused_head_matches_the_logits_path(tiny, chunk):
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (1, 40))
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]  # two packed samples
    targets = torch.roll(ids[0], -1)
    upstream = torch.randn(40)
    results = []
    for setting in ("disabled", chunk):
        model = _build(tiny, "custom", setting)
        logp, entropy = predicted_logprobs(model, ids, positions, targets, temperature=0.7)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ea, ga), (b, eb, gb) = results
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-5, rtol=1e-4), name


def test_a_model_with_its_own_head_is_refused(tiny):
    from prime_core.errors import PluginError

    with pytest.raises(PluginError, match="impl = 'custom'"):
        _build(tiny, "hf", 8)
