"""``trainer.model.kernels`` on the native model: every RMSNorm, MLP and attention module
calls the registered ``rmsnorm``/``swiglu``/``rope`` kernel it names (here: probes that count
calls and compute the eager result), the model's output is unchanged; an op no kernel provides
is refused by the config check, and the transformers-only ``hf_patch`` by the build."""

import pytest
import torch

from prime_core import hookimpl
from prime_core.plugins import PluginManager, set_plugin_manager
from prime_core.specs import Kernel


class Probes:
    def __init__(self):
        self.calls = {"rmsnorm": 0, "swiglu": 0, "rope": 0}

    @hookimpl
    def prime_kernels(self):
        from prime_plugin_custom.layers import apply_rotary

        def rmsnorm(x, weight, eps):
            self.calls["rmsnorm"] += 1
            h = x.float()
            return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def swiglu(gate, up):
            self.calls["swiglu"] += 1
            return torch.nn.functional.silu(gate) * up

        def rope(q, k, cos, sin):
            self.calls["rope"] += 1
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        return [Kernel(op=op, name="probe", impl=fn) for op, fn in
                (("rmsnorm", rmsnorm), ("swiglu", swiglu), ("rope", rope))]


@pytest.fixture
def probes():
    manager = PluginManager(autoload=True, disabled=()).load()
    found = Probes()
    manager.register(found, name="probes")
    set_plugin_manager(manager)
    yield found
    set_plugin_manager(None)


def _build(folder, **kernels):
    from prime_core.trainer.config import TrainerModelConfig
    from prime_plugin_custom.build import build

    return build(TrainerModelConfig(name=str(folder), impl="custom", dtype="float32", kernels=kernels))


def test_named_kernels_replace_the_eager_ops(tmp_path, probes):
    from prime_plugin_hf.tiny import build_tiny

    folder = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    ids = torch.randint(0, 256, (1, 24))
    positions = torch.arange(24)[None]
    eager = _build(folder)(input_ids=ids, position_ids=positions).logits
    model = _build(folder, rmsnorm="probe", swiglu="probe", rope="probe")
    got = model(input_ids=ids, position_ids=positions).logits
    assert torch.allclose(eager, got, atol=1e-6)
    # 2 blocks: 2 norms + q/k norms each, plus the final norm; one MLP and one attention each.
    assert probes.calls == {"rmsnorm": 2 * 4 + 1, "swiglu": 2, "rope": 2}


def test_an_op_no_kernel_provides_is_refused(tmp_path, probes):
    from prime_core.cli.common import load_config
    from prime_core.config.checks import check
    from prime_core.errors import ConfigError
    from prime_plugin_hf.tiny import build_tiny

    config = load_config("trainer", ["--model.kernels", '{"layernorm": "probe", "rmsnorm": "probe"}'])
    problems = check(config, "trainer")
    assert any("model.kernels.layernorm = 'probe': no installed plugin provides a kernel named 'layernorm:probe'" in p
               for p in problems), problems
    assert not any("kernels.rmsnorm" in p for p in problems)
    folder = build_tiny(tmp_path / "tiny", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ConfigError, match="hf_patch: patches a transformers model"):
        _build(folder, hf_patch="probe")
