"""The CUDA paths: ``torch._grouped_mm`` against the reference loop, the flash kernel taking
grouped kv heads, and the model on a GPU against transformers. Skipped without a GPU."""

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sm90() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("counts", [[0, 37, 0, 5, 128, 0, 1, 0], [0] * 7 + [64], [3] * 8, [0] * 8])
def test_torch_grouped_mm_matches_the_loop_forward_and_backward(counts):
    from prime_plugin_custom.moe import grouped_mm, grouped_mm_loop, grouped_mm_torch

    if not sm90():
        pytest.skip("torch._grouped_mm needs compute capability 9.0")
    counts = torch.tensor(counts, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, device="cuda", generator=generator).bfloat16().requires_grad_()
    stored = torch.randn(8, 192, 256, device="cuda", generator=generator).bfloat16().requires_grad_()
    probe = torch.randn(x.shape[0], 192, device="cuda", generator=generator).bfloat16()
    results = []
    for fn in (grouped_mm_torch, grouped_mm_loop):
        out = fn(x, stored.transpose(1, 2), counts)
        grads = torch.autograd.grad((out.float() * probe.float()).sum(), (x, stored), allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (x, stored), strict=True)]
        results.append((out, *grads))
    for fast, ref in zip(*results, strict=True):
        torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert grouped_mm(x, stored.transpose(1, 2), counts).shape == (x.shape[0], 192)


def test_flash_attention_takes_grouped_kv_heads():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prime_core.trainer.packing import Packing
    from prime_plugin_custom.layers import sdpa_attention

    q = torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(100), torch.arange(200)])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fast = sdpa_attention(q, k, v, Packing.from_position_ids(positions.cuda()), 0.125)
    slow = sdpa_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), Packing.from_position_ids(positions),
                          0.125)
    torch.testing.assert_close(fast.float().cpu(), slow, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "LlamaForCausalLM"])
def test_model_on_gpu_matches_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime_plugin_custom.build import build
    from prime_plugin_custom.checkpoint import load_hf_weights
    from prime_plugin_custom.tiny import save_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    folder = save_tiny(tmp_path / arch, arch)
    lengths = [40, 9, 77]
    ids = torch.randint(0, 256, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    # bfloat16: transformers computes the router in bfloat16 and this implementation in float32,
    # so a token whose top-k is a near tie may pick other experts; the check is on the mean.
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 1e-2)):
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).cuda()
        config = SimpleNamespace(name=str(folder), dtype=dtype, attn="sdpa", trust_remote_code=False)
        model = build(config, device="meta")
        model.to_empty(device="cuda")
        load_hf_weights(model, folder)
        with torch.no_grad():
            expected, start = [], 0
            for n in lengths:
                expected.append(reference(input_ids=ids[:, start:start + n],
                                          position_ids=torch.arange(n, device="cuda")[None]).logits)
                start += n
            expected = torch.cat(expected, dim=1).float()
            logits = model(input_ids=ids, position_ids=positions).logits.float()
        scale = expected.abs().max().item()
        diff = (logits - expected).abs()
        print(f"{arch} {dtype}: max |diff| {diff.max().item():.2e}, mean {diff.mean().item():.2e} "
              f"(logit scale {scale:.2f})")
        assert (diff.max() if dtype == "float32" else diff.mean()).item() <= tolerance * max(1.0, scale)


def test_the_bf16_router_gives_the_float32_logits():
    """``router_logits`` on bfloat16 inputs, eager and compiled: the forward as the float32 GEMM
    computes it (the same products, summed in float32), the gradients as bfloat16's."""
    from prime_plugin_custom.moe import router_logits

    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(777, 512, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(64, 512, device="cuda", generator=generator) * 0.05).bfloat16().requires_grad_()
    dy = torch.randn(777, 64, device="cuda", generator=generator)
    want = x.double() @ weight.double().t()
    wants = dy.double() @ weight.double(), dy.double().t() @ x.double()
    for fn in (router_logits, torch.compile(router_logits)):
        logits = fn(x, weight)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)
        for got, expected in zip(torch.autograd.grad(logits, (x, weight), dy), wants, strict=True):
            assert got.dtype == torch.bfloat16
            error = ((got.double() - expected).norm() / expected.norm()).item()
            assert error < 1e-2, error


def _bf16_moe():
    from prime_plugin_custom.moe import SparseMoE

    torch.manual_seed(0)
    layer = SparseMoE(hidden=256, intermediate=128, num_experts=16, top_k=4, norm_topk_prob=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer.cuda().bfloat16()


def test_the_moe_permutation_runs_in_triton_eager_and_compiled_and_matches_the_gathers(monkeypatch):
    """bf16 on the GPU: the local dispatcher's Triton kernels (eager, and launched from a
    compiled layer's own code) and its PyTorch gathers, outputs and every gradient, each
    against the same layer in float32 (same routing: the router computes in float32)."""
    pytest.importorskip("triton")
    from torch._inductor.utils import run_and_get_code

    from prime_plugin_custom import moe

    layer = _bf16_moe()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def run(fn, dtype=torch.bfloat16):
        inputs = x.detach().to(dtype).requires_grad_()
        out = fn(inputs)
        grads = torch.autograd.grad(out, (inputs, *layer.parameters()), dy.to(dtype))
        return [out.float(), *(g.float() for g in grads)]

    triton_eager = run(layer)
    monkeypatch.setattr(moe, "TRITON", False)
    gathers = run(layer)
    layer.float()
    reference = run(layer, torch.float32)
    layer.bfloat16()
    monkeypatch.setattr(moe, "TRITON", True)
    torch._dynamo.reset()
    compiled, codes = run_and_get_code(lambda: run(torch.compile(layer, dynamic=False)))
    assert any("copy_rows" in code for code in codes) and any("sum_rows" in code for code in codes), \
        "Inductor launches the permutation's kernels"
    for name, results in (("triton", triton_eager), ("gathers", gathers), ("compiled", compiled)):
        for i, (got, want) in enumerate(zip(results, reference, strict=True)):
            error = ((got - want).norm() / want.norm()).item()
            assert error < 2e-2, f"{name}: tensor {i} is {error:.2e} from float32"


def test_the_compiled_moe_permutation_takes_any_token_count():
    """Rows of every length: compiled with dynamic shapes (as automatic dynamic makes the token
    count once a second length arrives), the permutation's operators trace with a symbolic count."""
    pytest.importorskip("triton")
    layer = _bf16_moe()
    compiled = torch.compile(layer, dynamic=True)
    for tokens in (300, 211, 517, 1):
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, want = compiled(x), layer(x)
        grad, grad_want = (torch.autograd.grad(o, x, torch.ones_like(o)) for o in (out, want))
        error = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 1e-2, (tokens, error)
        torch.testing.assert_close(grad[0].float(), grad_want[0].float(), atol=3e-2, rtol=3e-2)
