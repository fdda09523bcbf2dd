"""prime-plugin-liger on a CPU machine: registration, availability reasons naming the install
command, nothing importing liger where it cannot run, and the plugin's use of liger (argument
order, layouts, in-place behaviour, the LM head's gradient path) against a CPU stand-in for
liger-kernel (``fakes/``) compared with the eager code each kernel replaces."""

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from prime_core import PLUGIN_API_VERSION
from prime_core.errors import PluginError
from prime_core.plugins import PluginManager
from prime_plugin_liger import hf as liger_hf
from prime_plugin_liger import lm_head as liger_lm_head
from prime_plugin_liger import ops, plugin

pytest_plugins = ["prime_core.testing"]

FAKES = Path(__file__).parent / "fakes"
KEYS = {"rmsnorm:liger", "swiglu:liger", "rope:liger", "lm_head:liger", "hf_patch:liger"}


def _forget_liger():
    for name in [m for m in sys.modules if m.split(".")[0] == "liger_kernel"]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def fake_liger(monkeypatch):
    """``liger_kernel`` importable as the CPU stand-in; its call records cleared."""
    _forget_liger()
    monkeypatch.syspath_prepend(str(FAKES))
    importlib.invalidate_caches()
    from liger_kernel import transformers
    from liger_kernel.transformers import functional

    functional.calls.clear()
    transformers.calls.clear()
    yield SimpleNamespace(functional=functional, transformers=transformers)
    _forget_liger()


@pytest.fixture
def no_liger(monkeypatch):
    """liger-kernel not installed, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.split(".")[0] == "liger_kernel" else real(name, *args))


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_every_kernel_behind_one_availability_check():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["liger"]
    assert (record.status, record.dist) == ("active", "prime-plugin-liger")
    kernels = {spec.key: spec for spec in manager.provided_by(record)["prime_kernels"]}
    assert set(kernels) == KEYS
    assert all(spec.available is plugin.unavailable_reason and spec.reference for spec in kernels.values())


# ------------------------------------------------------------------ availability


def test_without_liger_the_reason_names_the_install_command(no_liger):
    assert plugin.unavailable_reason() == "liger_kernel is not installed: pip install liger-kernel"


def test_selecting_a_liger_kernel_here_fails_with_that_reason(no_liger):
    manager = PluginManager(autoload=True, disabled=()).load()
    for key in KEYS:
        with pytest.raises(PluginError, match=f"'{key}' from plugin 'liger'.*cannot run here: liger_kernel is not "
                                              "installed: pip install liger-kernel"):
            manager.select("kernels", key)


def test_without_triton(fake_liger, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    reason = plugin.unavailable_reason()
    assert reason.startswith("triton is not installed") and "pip install liger-kernel" in reason


def test_with_liger_but_no_gpu(fake_liger, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "need a CUDA GPU" in plugin.unavailable_reason()


def test_available_with_liger_triton_and_a_gpu(fake_liger, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.unavailable_reason() is None


def test_a_release_that_does_not_import_is_reported(tmp_path, monkeypatch):
    _forget_liger()
    package = tmp_path / "liger_kernel" / "transformers"
    package.mkdir(parents=True)
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "functional.py").write_text("raise ImportError(\"cannot import name 'libdevice' from 'triton'\")")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        reason = plugin.unavailable_reason()
    finally:
        _forget_liger()
    assert reason.startswith("liger_kernel is installed but does not import (ImportError: cannot import name")
    assert "pip install liger-kernel" in reason


@pytest.mark.parametrize("liger_installed", [False, True])
def test_nothing_imports_liger_or_torch_on_a_cpu_machine(liger_installed):
    """Loading the plugin and asking every kernel whether it can run (what `prime plugins list`
    and config validation do) imports neither liger nor triton, and without liger not even torch."""
    hide = ("import sys, importlib.util as u; real = u.find_spec\n"
            "u.find_spec = lambda n, *a: None if n.split('.')[0] == 'liger_kernel' else real(n, *a)\n")
    code = ("import sys, torch.cuda as c; c.is_available = lambda: False\n" if liger_installed else hide) + (
        "import prime_plugin_liger.plugin as p\n"
        "reasons = {s.unavailable_reason() for s in p.prime_kernels()}\n"
        "print(len(reasons), sorted(m for m in ('liger_kernel', 'triton', 'torch') if m in sys.modules))")
    paths = [str(FAKES)] * liger_installed + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == ("1 ['torch']" if liger_installed else "1 []")


# ------------------------------------------------------------------ the kernels (CPU stand-in)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def _same_gradients(outputs, inputs, ref_outputs, ref_inputs, **tolerance):
    probes = [torch.randn(o.shape, generator=torch.Generator().manual_seed(9)) for o in outputs]
    grads = torch.autograd.grad(sum((o.float() * p).sum() for o, p in zip(outputs, probes, strict=True)), inputs)
    ref = torch.autograd.grad(sum((o.float() * p).sum() for o, p in zip(ref_outputs, probes, strict=True)),
                              ref_inputs)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_rmsnorm_is_the_native_norm_and_leaves_the_upstream_gradient_alone(fake_liger):
    from prime_plugin_custom.layers import RMSNorm

    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(3)))
    x = _randn(5, 3, 16)
    out = ops.rmsnorm(x, norm.weight, norm.eps)
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(out, norm(x_ref))
    assert fake_liger.functional.calls == [("rms_norm", {"casting_mode": "llama", "in_place": False, "offset": 0.0})]
    _same_gradients([out], [x, norm.weight], [norm(x_ref)], [x_ref, norm.weight])


def test_swiglu_is_silu_gate_times_up(fake_liger):
    gate, up = _randn(7, 12), _randn(7, 12, seed=1)
    out = ops.swiglu(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up)
    assert [name for name, _ in fake_liger.functional.calls] == ["swiglu"]


def test_rope_matches_apply_rotary_and_leaves_q_and_k_alone(fake_liger):
    from prime_plugin_custom.layers import RotaryEmbedding, apply_rotary

    rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, 8)
    positions = torch.cat([torch.arange(5), torch.arange(4)])
    cos, sin = rotary(positions, torch.float32)
    q, k = _randn(9, 4, 8), _randn(9, 2, 8, seed=1)
    before = q.detach().clone(), k.detach().clone()
    q_rot, k_rot = ops.rope(q, k, cos, sin)
    assert fake_liger.functional.calls == [("rope", {"q": (1, 4, 9, 8), "cos": (1, 9, 8)})]
    assert torch.equal(q, before[0]) and torch.equal(k, before[1]), "liger's in-place rotation reached the inputs"
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    torch.testing.assert_close(q_rot, apply_rotary(q, cos, sin))
    torch.testing.assert_close(k_rot, apply_rotary(k, cos, sin))
    _same_gradients([q_rot, k_rot], [q, k], [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)], [q, k])


# ------------------------------------------------------------------ the LM head


def _eager_logprobs(hidden, weight, targets, temperature=1.0):
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[:, None]
    logp = torch.log_softmax((hidden.double() @ weight.double().t()) / temperature, dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7, "per-token"])
def test_lm_head_sft_loss_matches_eager_through_a_buggy_reduction_none(fake_liger, temperature):
    """The SFT loss sum(-logp * mask) * scale with mask[0] = 0: the stand-in's reduction='none'
    backward (like liger's before #1298) would make every gradient 0 here."""
    n, vocab, width = 11, 37, 16
    hidden, weight = _randn(n, width), _randn(vocab, width, seed=1)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2))
    if temperature == "per-token":
        temperature = 0.5 + torch.rand(n, generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(n) % 3 != 0).float()
    logp, entropy = liger_lm_head.liger_logprobs(hidden, weight, targets, temperature, token_chunk="auto",
                                                 with_entropy=False)
    assert entropy is None and logp.dtype == torch.float32 and logp.shape == (n,)
    ref_hidden, ref_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    ref = _eager_logprobs(ref_hidden, ref_weight, targets, temperature)
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)

    (-logp * mask).sum().mul(0.25).backward()
    (-ref * mask).sum().mul(0.25).backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_weight.grad, atol=1e-5, rtol=1e-5)
    assert [c[1] for c in fake_liger.functional.calls] == [{"reduction": "none", "grad": False},
                                                           {"reduction": "sum", "grad": True}]


def test_lm_head_with_a_frozen_head_or_everything_masked(fake_liger):
    hidden, weight = _randn(6, 8), _randn(20, 8, seed=1).detach()
    targets = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(2))
    logp, _ = liger_lm_head.liger_logprobs(hidden, weight, targets, with_entropy=False)
    (grad,) = torch.autograd.grad(-logp.sum(), hidden)
    ref_hidden = hidden.detach().clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(-_eager_logprobs(ref_hidden, weight, targets).sum(), ref_hidden)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)

    logp, _ = liger_lm_head.liger_logprobs(hidden, weight, targets, with_entropy=False)
    (grad,) = torch.autograd.grad((logp * 0).sum(), hidden)
    assert torch.equal(grad, torch.zeros_like(hidden))


def test_lm_head_refuses_what_liger_cannot_give(fake_liger):
    hidden, weight = _randn(4, 8), _randn(10, 8, seed=1)
    targets = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="no entropy.*lm_head:fused"):
        liger_lm_head.liger_logprobs(hidden, weight, targets, with_entropy=True)
    logp, _ = liger_lm_head.liger_logprobs(hidden, weight, targets, with_entropy=False)
    advantages = torch.tensor([0.5, -1.0, 0.0, 2.0])
    with pytest.raises(RuntimeError, match="weights tokens unequally.*lm_head:fused"):
        (logp * advantages).sum().backward()
    with pytest.raises(ValueError, match="targets must be int64"):
        liger_lm_head.liger_logprobs(hidden, weight, targets.int(), with_entropy=False)


def test_lm_head_on_no_tokens(fake_liger):
    hidden, weight = _randn(0, 8), _randn(10, 8, seed=1)
    logp, _ = liger_lm_head.liger_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=False)
    assert logp.shape == (0,) and fake_liger.functional.calls == []
    logp.sum().backward()


# ------------------------------------------------------------------ Hugging Face models


def _hf_model(model_type):
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type))


def test_hf_patch_calls_liger_for_the_model_type_without_its_loss(fake_liger):
    model = _hf_model("qwen3")
    assert liger_hf.apply_to_hf(model) is model
    assert fake_liger.transformers.calls == [("qwen3", {
        "rope": True, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True, "swiglu": True,
        "model": model})]


def test_hf_patch_passes_only_what_the_release_accepts(fake_liger):
    model = _hf_model("llama")
    liger_hf.apply_to_hf(model, rope=False)
    [(name, kwargs)] = fake_liger.transformers.calls
    assert name == "llama" and "swiglu" not in kwargs and kwargs["rope"] is False and kwargs["model"] is model


def test_hf_patch_refuses_what_it_cannot_patch(fake_liger):
    with pytest.raises(ValueError, match="no patch for model type 'gpt2'; supported: llama, qwen2, qwen3, qwen3_moe"):
        liger_hf.apply_to_hf(_hf_model("gpt2"))
    with pytest.raises(ValueError, match="has no apply_liger_kernel_to_qwen2: pip install -U liger-kernel"):
        liger_hf.apply_to_hf(_hf_model("qwen2"))
    assert fake_liger.transformers.calls == []
