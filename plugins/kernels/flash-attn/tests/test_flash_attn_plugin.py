"""prime-plugin-flash-attn on a CPU machine: registration, availability reasons with their fix,
``cu_seqlens`` for several packings, the kernel's argument handling against a CPU stand-in for
flash-attention (``fakes/``), and the native model selecting it through ``trainer.model.attn``."""

import importlib
import subprocess
import sys
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prime_core import PLUGIN_API_VERSION
from prime_core.errors import PluginError
from prime_core.plugins import PluginManager, set_plugin_manager
from prime_core.trainer.packing import Packing, cp_indices
from prime_plugin_flash_attn import plugin, torch_kernels, varlen
from prime_plugin_flash_attn.varlen import cu_seqlens, flash_attention_2, flash_attention_3, flash_attention_4

pytest_plugins = ["prime_core.testing"]

FAKES = Path(__file__).parent / "fakes"
FLASH_MODULES = ("flash_attn", "flash_attn_interface")


def _forget_flash_modules():
    for name in [m for m in sys.modules if m.split(".")[0] in FLASH_MODULES]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn and flash_attn_interface importable as the CPU stand-ins in ``fakes/``."""
    _forget_flash_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    importlib.invalidate_caches()
    import flash_attn

    flash_attn.calls.clear()
    yield flash_attn
    _forget_flash_modules()


@pytest.fixture
def no_flash(monkeypatch):
    """flash-attention not installed, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.split(".")[0] in FLASH_MODULES else real(name, *args))


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """Make ``name`` importable with ``body`` as its source."""
    _forget_flash_modules()
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(name: str, body: str) -> None:
        path = tmp_path / f"{name}.py"  # "pkg/sub/__init__" makes a package in a bare namespace
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        importlib.invalidate_caches()

    yield install
    _forget_flash_modules()


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_importing_the_plugin_imports_neither_torch_nor_flash_attn():
    code = ("import sys, prime_plugin_flash_attn.plugin as p; p.prime_kernels(); "
            "print(sorted(m for m in ('torch', 'flash_attn', 'flash_attn_interface') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_registers_the_attention_kernels():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["flash_attn"]
    assert (record.status, record.dist) == ("active", "prime-plugin-flash-attn")
    kernels = {spec.key: spec for spec in manager.provided_by(record)["prime_kernels"]}
    assert set(kernels) == {"attention:flash_attention_2", "attention:flash_attention_3",
                            "attention:flash_attention_4", "attention:torch_flash", "attention:torch_fused"}
    assert all(spec.reference == "prime_plugin_custom.layers.sdpa_attention" for spec in kernels.values())
    assert manager.registry("kernels")["attention:flash_attention_2"].plugin == "flash_attn"


# ------------------------------------------------------------------ cu_seqlens


@pytest.mark.parametrize("lengths", [[7], [3, 4, 1], [1, 1, 1], [5, 1, 9, 2]])
def test_cu_seqlens_marks_where_every_sample_starts(lengths):
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu, max_len = cu_seqlens(Packing.from_position_ids(positions))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, *accumulate(lengths)]
    assert max_len == max(lengths)


def test_cu_seqlens_reads_any_non_decreasing_segment_ids():
    packing = Packing(segment_ids=torch.tensor([2, 2, 5, 5, 5, 9]), index=torch.arange(6), length=6)
    cu, max_len = cu_seqlens(packing)
    assert (cu.tolist(), max_len) == ([0, 2, 5, 6], 3)


def test_cu_seqlens_takes_the_sample_starts_the_host_knows():
    """A row built on the host carries its sample starts: the device's segment ids (here
    saying one sample) are not read."""
    packing = Packing(segment_ids=torch.zeros(5, dtype=torch.long), index=torch.arange(5), length=5, starts=(0, 2))
    cu, max_len = cu_seqlens(packing)
    assert (cu.tolist(), max_len) == ([0, 2, 5], 3)


def _empty_packing():
    empty = torch.zeros(0, dtype=torch.long)
    return Packing(segment_ids=empty, index=empty, length=0)


def test_cu_seqlens_of_an_empty_row():
    cu, max_len = cu_seqlens(_empty_packing())
    assert (cu.tolist(), max_len) == ([0], 0)


def test_cu_seqlens_is_computed_once_per_packing():
    packing = Packing.from_position_ids(torch.tensor([0, 1, 0, 1, 2]))
    assert cu_seqlens(packing) is cu_seqlens(packing)


def test_the_kernels_can_prepare_a_packing_ahead_of_the_layers():
    packing = Packing.from_position_ids(torch.tensor([0, 1, 2, 0]))
    varlen.flash_attention_2.prepare(packing)
    assert varlen.flash_attention_3.prepare is varlen.flash_attention_2.prepare
    assert varlen.flash_attention_4.prepare is varlen.flash_attention_2.prepare
    packing.segment_ids = None  # the layers must not look at it again
    assert cu_seqlens(packing)[0].tolist() == [0, 3, 4]


def test_cu_seqlens_refuses_a_context_parallel_subset():
    packing = Packing.from_position_ids(torch.arange(8)).select(cp_indices(8, 0, 2))
    with pytest.raises(ValueError, match="4 of its 8 tokens"):
        cu_seqlens(packing)


# ------------------------------------------------------------------ availability


def test_without_flash_attention_the_reasons_name_the_fix(no_flash):
    fa2, fa3 = plugin.flash_attention_2_unavailable(), plugin.flash_attention_3_unavailable()
    assert fa2.startswith("flash_attn is not installed (flash-attention 2): "
                          "pip install flash-attn --no-build-isolation")
    assert fa3.startswith("flash_attn_interface is not installed (flash-attention 3): build it from the hopper/")
    assert plugin.flash_attention_4_unavailable().startswith(
        "flash_attn.cute is not installed (flash-attention 4): pip install flash-attn-4")


def test_flash_attention_4_without_flash_attn_at_all(monkeypatch):
    """``flash_attn.cute``'s parent package missing too: a reason, not ModuleNotFoundError."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name.split(".")[0] in FLASH_MODULES:
            raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert plugin.flash_attention_4_unavailable().startswith("flash_attn.cute is not installed")


def test_torch_flash_without_a_gpu_names_the_fallback(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = plugin.torch_flash_unavailable()
    assert "needs a CUDA GPU" in reason and "attn = 'sdpa'" in reason


def test_torch_flash_on_a_pre_ampere_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "compute capability 8.0+), this one is 7.x" in plugin.torch_flash_unavailable()
    assert plugin.torch_fused_unavailable() == plugin.torch_flash_unavailable()


def test_torch_fused_marks_one_sample_rows_once():
    one, packed = (Packing.from_position_ids(torch.cat([torch.arange(n) for n in lengths]))
                   for lengths in ([9], [4, 5]))
    torch_kernels.torch_fused.prepare(one)
    torch_kernels.torch_fused.prepare(packed)
    assert (one.cache["single_sample"], packed.cache["single_sample"]) == (True, False)
    assert (one.single_sample(), packed.single_sample()) == (True, False)


def _cudnn_stand_in(q, k, v, bias, log_sumexp, dropout, causal, debug, scale=None):
    """cuDNN's attention op on a CPU: ``[1, H, L, D]`` in, the output first, as the op returns."""
    return (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),)


def _cudnn_cpu_kernel(q, k, v, bias, log_sumexp, dropout=0.0, causal=False, debug=False, scale=None):
    """The op's nine outputs, as its schema has them, the output computed."""
    empty = torch.empty(0)
    out = _cudnn_stand_in(q, k, v, bias, log_sumexp, dropout, causal, debug, scale=scale)[0]
    return out, torch.zeros(*q.shape[:3], 1), empty, empty, q.shape[2], q.shape[2], empty, empty, empty


def test_cudnn_rows_are_padded_exactly_and_compile_into_two_graphs(monkeypatch):
    """cuDNN builds a plan per length (an H200: 116-154 ms a new one, stop 72): a one-sample row
    goes to it padded at its end to a multiple of 256 tokens, below ``CUDNN_PADDED_BELOW``. The
    real tokens' outputs and gradients are the unpadded ones, and a compiled block over rows of
    varying length makes its static graph and one symbolic graph, none per pad. cuDNN itself is
    ``test_flash_attn_gpu.py``'s."""
    from torch._dynamo.testing import CompileCounter

    lengths_seen, copied = [], []

    def recording(q, *args, **kwargs):
        lengths_seen.append(q.shape[2])
        copied.append(q.data_ptr() != inputs[0].data_ptr())
        return _cudnn_stand_in(q, *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", recording)
    generator = torch.Generator().manual_seed(0)
    for length in (300, 512, 700):
        q, k, v = inputs = [torch.randn(length, heads, 16, generator=generator, dtype=torch.float64).requires_grad_()
                            for heads in (4, 2, 2)]
        grad = torch.randn(length, 4, 16, generator=generator, dtype=torch.float64)
        out = torch_kernels.cudnn_causal(q, k, v, 0.25)
        got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
        ref_out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.25, enable_gqa=True).transpose(0, 1)
        want = [ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad)]
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)
    assert lengths_seen == [512, 512, 768] and copied == [True, False, True]  # eager: a multiple as it is
    monkeypatch.setattr(torch_kernels, "CUDNN_PADDED_BELOW", 600)
    inputs = [torch.randn(700, h, 16) for h in (4, 2, 2)]
    torch_kernels.cudnn_causal(*inputs, 0.25)
    assert lengths_seen[-1] == 700  # at its own length

    # compiled: dynamo traces the op itself, so it gets a CPU kernel (forward only) for the test
    monkeypatch.undo()
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_cudnn_attention", _cudnn_cpu_kernel, "CPU")
    counter = CompileCounter()
    torch._dynamo.reset()
    block = torch.compile(lambda q, k, v: torch_kernels.cudnn_causal(q * 2, k, v, 0.25).sum(), backend=counter)
    try:
        for length in (300, 512, 700, 1024, 1000, 256, 2000):
            inputs = [torch.randn(length, h, 16) for h in (4, 2, 2)]
            assert torch.allclose(block(*inputs), torch_kernels.cudnn_causal(inputs[0] * 2, *inputs[1:], 0.25).sum(),
                                  atol=1e-4)
        assert counter.frame_count == 2, f"{counter.frame_count} graphs"
    finally:
        torch._dynamo.reset()
        library._destroy()


def test_with_flash_attention_but_no_gpu(fake_flash, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for reason in (plugin.flash_attention_2_unavailable(), plugin.flash_attention_3_unavailable(),
                   plugin.flash_attention_4_unavailable()):
        assert "needs a CUDA GPU" in reason and "attn = 'sdpa'" in reason


def test_available_with_flash_attention_and_a_gpu(fake_flash, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.flash_attention_2_unavailable() is None
    assert plugin.flash_attention_3_unavailable() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert plugin.flash_attention_4_unavailable() is None


def test_flash_attention_4_before_hopper_names_the_fallback(fake_flash, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    reason = plugin.flash_attention_4_unavailable()
    assert "compute capability 9.0+), this one is 8.x" in reason and "attn = 'torch_fused'" in reason


def test_a_broken_build_is_reported_with_the_fix(fake_module, monkeypatch):
    fake_module("flash_attn", "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = plugin.flash_attention_2_unavailable()
    assert reason.startswith("flash_attn is installed but does not import (ImportError: flash_attn_2_cuda.so")
    assert "pip install flash-attn" in reason


def test_flash_attention_1_lacks_the_varlen_api(fake_module, monkeypatch):
    fake_module("flash_attn", "__version__ = '1.0.9'\ndef flash_attn_unpadded_func(*a): pass\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.flash_attention_2_unavailable().startswith("flash_attn 1.0.9 has no flash_attn_varlen_func")


def test_flash_attention_4_s_namespace_is_not_flash_attention_2(fake_module, monkeypatch):
    """flash-attn-4 installs ``flash_attn/cute/`` with no ``flash_attn/__init__.py``: ``flash_attn``
    imports, as a bare namespace."""
    fake_module("flash_attn/cute/__init__", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = plugin.flash_attention_2_unavailable()
    assert reason.startswith("flash-attention 2 is not installed: flash_attn here is only a namespace"), reason
    assert "flash_attn.cute" in reason and "pip install flash-attn" in reason


def test_plugins_list_shows_it_unavailable_with_the_reason(no_flash):
    manager = PluginManager(autoload=True, disabled=()).load()
    record = next(r for r in manager.status() if r.name == "flash_attn")
    assert (record.status, record.reason) == ("unavailable", plugin.flash_attention_2_unavailable())


# ------------------------------------------------------------------ the kernel (CPU stand-in)


def _qkv(length, heads=4, kv_heads=2, dim=8, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(length, h, dim, generator=generator).to(dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kernel", [flash_attention_2, flash_attention_3, flash_attention_4])
def test_kernel_passes_the_samples_and_matches_sdpa_attention(fake_flash, kernel):
    from prime_plugin_custom.layers import sdpa_attention

    lengths = [5, 9, 2]
    positions = torch.cat([torch.arange(n) for n in lengths])
    q, k, v = _qkv(len(positions), dim=32)  # a head dim every kernel takes
    out = kernel(q, k, v, Packing.from_position_ids(positions), 0.3)
    assert fake_flash.calls == [{"cu": [0, 5, 14, 16], "max": 9, "scale": 0.3, "causal": True}]
    assert out.shape == q.shape and out.dtype == torch.bfloat16

    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sdpa_attention(*ref_inputs, Packing.from_position_ids(positions), 0.3)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out.float() * probe).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * probe).sum(), ref_inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_flash_attention_4_runs_a_row_of_one_sample_as_a_batch_of_one(fake_flash):
    from prime_plugin_custom.layers import sdpa_attention

    q, k, v = _qkv(11, dim=32)
    packing = Packing.from_position_ids(torch.arange(11))
    out = flash_attention_4(q, k, v, packing, 0.3)
    assert fake_flash.calls == [{"cu": [0, 11], "max": 11, "scale": 0.3, "causal": True}]
    ref = sdpa_attention(*(t.detach().float() for t in (q, k, v)), packing, 0.3)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_kernel_refuses_float32_and_context_parallel_subsets(fake_flash):
    positions = torch.arange(8)
    q, k, v = _qkv(8, dtype=torch.float32)
    with pytest.raises(TypeError, match="bfloat16 or float16, got q torch.float32.*attn = 'sdpa'"):
        flash_attention_2(q, k, v, Packing.from_position_ids(positions), 0.3)
    local = cp_indices(8, 1, 2)
    q, k, v = (t.detach().bfloat16()[local] for t in (q, k, v))
    with pytest.raises(ValueError, match="context-parallel subset.*cp_style = 'ulysses'"):
        flash_attention_2(q, k, v, Packing.from_position_ids(positions).select(local), 0.3)
    assert fake_flash.calls == []


def test_kernel_refuses_heads_that_do_not_group(fake_flash):
    q, k, v = _qkv(4, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        flash_attention_2(q, k, v, Packing.from_position_ids(torch.arange(4)), 0.3)


def test_an_empty_row_gives_an_empty_output(fake_flash):
    q, k, v = _qkv(0)
    out = flash_attention_2(q, k, v, _empty_packing(), 0.3)
    assert out.shape == (0, 4, 8) and fake_flash.calls == []


# ------------------------------------------------------------------ the native model selecting it


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from prime_plugin_custom.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "qwen3", "Qwen3ForCausalLM")


@pytest.fixture
def installed_plugins():
    manager = PluginManager(autoload=True, disabled=()).load()
    set_plugin_manager(manager)
    yield manager
    set_plugin_manager(None)


def _model_config(folder, attn):
    return SimpleNamespace(name=str(folder), dtype="bfloat16", attn=attn, trust_remote_code=False)


def test_selecting_it_where_it_cannot_run_names_the_fix(tiny_qwen3, installed_plugins, no_flash):
    from prime_plugin_custom.build import build

    with pytest.raises(PluginError) as info:
        build(_model_config(tiny_qwen3, "flash_attention_2"))
    message = str(info.value)
    assert message.startswith("trainer.model.attn = 'flash_attention_2': the kernel 'attention:flash_attention_2' "
                              "from plugin 'flash_attn' (prime-plugin-flash-attn")
    assert "cannot run here: flash_attn is not installed" in message and "pip install flash-attn" in message


def test_the_native_model_runs_on_it(tiny_qwen3, installed_plugins, fake_flash, monkeypatch):
    from prime_plugin_custom.build import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flash, sdpa = build(_model_config(tiny_qwen3, "flash_attention_2")), build(_model_config(tiny_qwen3, "sdpa"))
    assert flash.model.layers[0].self_attn.attention_fn is varlen.flash_attention_2
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None]
    ids = torch.randint(0, 256, positions.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = (model(input_ids=ids, position_ids=positions).logits.float() for model in (flash, sdpa))
    # one flash call per layer, the row's boundaries computed once
    assert [c["cu"] for c in fake_flash.calls] == [[0, 6, 16]] * len(flash.model.layers)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------ attn = "auto"


def _auto(head_dim, planning):
    from prime_core.trainer.defaults import Context

    hf_config = SimpleNamespace(head_dim=head_dim, hidden_size=2048, num_attention_heads=16)
    context = Context(device="cuda", role="trainer", impl="custom", hf_config=hf_config, planning=planning)
    choices = plugin.prime_trainer_defaults(SimpleNamespace(attn="auto"), context)
    return {choice.key: choice.value for choice in choices}


@pytest.mark.parametrize("planning", [True, False])
def test_auto_takes_flash_attention_4_where_installed_at_a_checked_head_dim(fake_flash, monkeypatch, planning):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(plugin, "torch_fused_unavailable", lambda: None)
    assert _auto(128, planning) == {"attn": "flash_attention_4"}
    assert _auto(16, planning) == {"attn": "torch_fused"}  # not checked there: the other kernels


def test_auto_takes_torch_fused_without_flash_attention_4(no_flash):
    assert _auto(128, planning=True) == {"attn": "torch_fused"}


def test_flash_attention_4_refuses_head_dims_it_was_not_checked_at(fake_flash):
    q, k, v = _qkv(6, dim=16)
    with pytest.raises(ValueError, match="checked at head dims 32, 64, 128; this model's is 16.*'torch_fused'"):
        flash_attention_4(q, k, v, Packing.from_position_ids(torch.arange(6)), 0.3)
