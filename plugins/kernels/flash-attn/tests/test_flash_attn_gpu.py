"""The flash-attention kernels on a GPU against the default kernel (``sdpa_attention``) in
float32, forward and backward, on packed bf16 rows with grouped kv heads. Each test skips with
the plugin's own reason where its package is missing (or there is no GPU)."""

import pytest
import torch

from prime_core.trainer.packing import Packing
from prime_plugin_flash_attn import plugin

pytestmark = pytest.mark.gpu

FA2 = pytest.mark.skipif(plugin.flash_attention_2_unavailable() is not None,
                         reason=str(plugin.flash_attention_2_unavailable()))
FA3 = pytest.mark.skipif(plugin.flash_attention_3_unavailable() is not None,
                         reason=str(plugin.flash_attention_3_unavailable()))
FA4 = pytest.mark.skipif(plugin.flash_attention_4_unavailable() is not None,
                         reason=str(plugin.flash_attention_4_unavailable()))
ROWS = [([1000, 37, 500, 1], 16, 4, 128), ([2048], 8, 8, 64), ([3, 300, 65], 32, 8, 128)]


def _kernel(name):
    from prime_plugin_flash_attn import varlen

    return getattr(varlen, name)


def _check_against_sdpa(kernel, lengths, heads, kv_heads, dim, dtype):
    from prime_plugin_custom.layers import sdpa_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    total = positions.numel()
    q, k, v = (torch.randn(total, h, dim, device="cuda", generator=generator, dtype=dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    out = kernel(q, k, v, Packing.from_position_ids(positions), scale)
    assert out.dtype == dtype and out.shape == q.shape

    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sdpa_attention(*ref_inputs, Packing.from_position_ids(positions), scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    probe = torch.randn(ref.shape, device="cuda", generator=generator)
    grads = torch.autograd.grad((out.float() * probe).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * probe).sum(), ref_inputs)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        scale_of = want.abs().max().clamp_min(1.0)
        error = (got.float() - want).abs().max() / scale_of
        assert error < 3e-2, f"d{name}: max error {error:.3g} relative to {scale_of:.3g}"


@FA2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"), ROWS)
def test_flash_attention_2_matches_sdpa(lengths, heads, kv_heads, dim, dtype):
    _check_against_sdpa(_kernel("flash_attention_2"), lengths, heads, kv_heads, dim, dtype)


@FA3
@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"), ROWS)
def test_flash_attention_3_matches_sdpa(lengths, heads, kv_heads, dim):
    _check_against_sdpa(_kernel("flash_attention_3"), lengths, heads, kv_heads, dim, torch.bfloat16)


@FA4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"), [*ROWS, ([4096], 32, 4, 128)])
def test_flash_attention_4_matches_sdpa(lengths, heads, kv_heads, dim, dtype):
    _check_against_sdpa(_kernel("flash_attention_4"), lengths, heads, kv_heads, dim, dtype)


@pytest.mark.parametrize("attn", [pytest.param("flash_attention_2", marks=FA2),
                                  pytest.param("flash_attention_4", marks=FA4)])
def test_native_model_on_flash_attention_matches_sdpa(tmp_path, attn):
    from types import SimpleNamespace

    from prime_core.plugins import PluginManager, set_plugin_manager
    from prime_plugin_custom.build import build
    from prime_plugin_custom.tiny import save_tiny

    folder = save_tiny(tmp_path / "qwen3", "Qwen3ForCausalLM", head_dim=64)
    set_plugin_manager(PluginManager(autoload=True, disabled=()).load())
    try:
        models = [build(SimpleNamespace(name=str(folder), dtype="bfloat16", attn=kernel, trust_remote_code=False),
                        device="cuda") for kernel in (attn, "sdpa")]
    finally:
        set_plugin_manager(None)
    positions = torch.cat([torch.arange(n) for n in (40, 7, 81)])[None].cuda()
    ids = torch.randint(0, 256, positions.shape, device="cuda")
    logits = [model(input_ids=ids, position_ids=positions).logits.float() for model in models]
    torch.testing.assert_close(logits[0], logits[1], atol=5e-2, rtol=5e-2)
    for out in logits:
        out.logsumexp(-1).sum().backward()
    for (name, fast), slow in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        error = (fast.grad.float() - slow.grad.float()).abs().max() / slow.grad.float().abs().max().clamp_min(1e-3)
        assert error < 5e-2, f"{name}: gradient differs by {error:.3g} (relative)"


TORCH_FLASH = pytest.mark.skipif(plugin.torch_flash_unavailable() is not None,
                                 reason=str(plugin.torch_flash_unavailable()))
TORCH_FUSED = pytest.mark.skipif(plugin.torch_fused_unavailable() is not None,
                                 reason=str(plugin.torch_fused_unavailable()))


def _torch_kernel(name):
    from prime_plugin_flash_attn import torch_kernels

    return getattr(torch_kernels, name)


@TORCH_FLASH
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"), ROWS)
def test_torch_flash_matches_sdpa(lengths, heads, kv_heads, dim, dtype):
    _check_against_sdpa(_torch_kernel("torch_flash"), lengths, heads, kv_heads, dim, dtype)


@TORCH_FUSED
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lengths", "heads", "kv_heads", "dim"),
                         ROWS + [([4096], 16, 8, 128), ([1, 4095], 16, 8, 128), ([2048], 32, 4, 128),
                                 ([1000], 16, 8, 128), ([4097], 16, 8, 128), ([3], 8, 8, 64)])
def test_torch_fused_matches_sdpa(lengths, heads, kv_heads, dim, dtype):
    _check_against_sdpa(_torch_kernel("torch_fused"), lengths, heads, kv_heads, dim, dtype)


@TORCH_FUSED
def test_torch_fused_long_rows_run_at_their_own_length(monkeypatch):
    """Rows of ``CUDNN_PADDED_BELOW`` tokens or more are not padded (here from 1,024 on)."""
    from prime_plugin_flash_attn import torch_kernels

    monkeypatch.setattr(torch_kernels, "CUDNN_PADDED_BELOW", 1024)
    _check_against_sdpa(torch_kernels.torch_fused, [4097], 16, 8, 128, torch.bfloat16)


@TORCH_FLASH
def test_torch_flash_compiled_block_does_not_recompile_per_packing():
    """A compiled function around the kernel, fed rows of one length but different samples,
    compiles once: the boundaries stay out of the graph."""
    import torch._dynamo

    from prime_plugin_flash_attn.torch_kernels import torch_flash

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()

    @torch.compile(fullgraph=False)
    def block(q, k, v, packing):
        return torch_flash(q * 2, k, v, packing, 0.125).sum()

    for lengths in ([512, 512], [100, 900, 24], [1024], [7, 1017]):
        positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
        q = torch.randn(1024, 8, 64, device="cuda", dtype=torch.bfloat16)
        k = v = torch.randn(1024, 4, 64, device="cuda", dtype=torch.bfloat16)
        block(q, k, v, Packing.from_position_ids(positions))
    assert counts["stats"]["unique_graphs"] <= 2, dict(counts["stats"])


@TORCH_FUSED
def test_torch_fused_one_sample_row_traces_into_one_graph():
    """A row of one sample runs cuDNN inside the compiled block's graph: no graph break (a break
    splits every block in two and runs a checkpointed block eagerly)."""
    import torch._dynamo

    from prime_plugin_flash_attn.torch_kernels import torch_fused

    torch._dynamo.reset()
    packing = Packing.from_position_ids(torch.arange(1024, device="cuda"))
    packing.single_sample()  # as the model's forward does, before the blocks
    q = torch.randn(1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = v = torch.randn(1024, 4, 64, device="cuda", dtype=torch.bfloat16)
    block = torch.compile(lambda q, k, v: torch_fused(q * 2, k, v, packing, 0.125).sum(), fullgraph=True)
    block(q, k, v).backward()
    assert q.grad is not None
