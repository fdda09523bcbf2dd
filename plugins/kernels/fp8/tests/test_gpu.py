"""The GPU backends (``torch``: blockwise ``scaled_mm`` and the per-K-chunk fallback;
``deep_gemm``) against the emulated reference on bf16 inputs, and a short training run whose
FP8 loss curve must track bf16's. Marked ``gpu``: skipped (with the reason) without CUDA.
Written for one H200 (SM90); the whole file takes well under a minute there."""

import pytest
import torch
import torch.nn.functional as F

from prime_plugin_fp8 import gemm
from prime_plugin_fp8.linear import fp8_linear
from prime_plugin_fp8.quant import quantize_blocks, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKEND_TOL = 1e-2
"""Relative Frobenius distance to the emulated reference. Both see the same FP8 operands;
what differs is the accumulation (tensor cores promote to float32 every 128 K; the reference
sums in float64) and the bf16 rounding of the outputs (2^-9): a few 1e-3 are expected."""
FP8_TOL = 0.05  # against float64 on the unquantised inputs, as on CPU

SHAPES = [(1, 256, 128), (333, 4096, 1024), (512, 1000, 200), (64, 2048, 1), (4096, 1536, 4608)]


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _skip_unless(backend: str) -> None:
    reason = gemm.unavailable(backend)
    if reason is None and backend == "deep_gemm" and torch.cuda.get_device_capability()[0] != 9:
        reason = "deep_gemm backend runs on SM90 only"
    if reason is not None:
        pytest.skip(reason)


def _run(backend, x, w, b, grad_y):
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xs, ws, bs, backend=backend)
    y.backward(grad_y)
    return y, xs.grad, ws.grad, bs.grad


@pytest.mark.parametrize("mkn", SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "torch-chunked", "deep_gemm"])
def test_backend_matches_emulated_on_bf16(backend, mkn, monkeypatch):
    name = backend.split("-")[0]
    _skip_unless(name)
    if backend == "torch-chunked":
        monkeypatch.setitem(gemm._torch_modes, str(torch.device("cuda", torch.cuda.current_device())), "chunked")
    m, k, n = mkn
    g = torch.Generator(device="cuda").manual_seed(sum(mkn))
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    grad_y = torch.randn(m, n, device="cuda", generator=g).bfloat16()

    got = _run(name, x, w, b, grad_y)
    want = _run("emulated", x, w, b, grad_y)
    for label, a, r in zip(("y", "grad_x", "grad_w", "grad_b"), got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape, label
        assert _rel(a, r) < BACKEND_TOL, (label, _rel(a, r))
    x64, w64, g64 = x.double(), w.double(), grad_y.double()
    assert _rel(got[0], x64 @ w64.T + b.double()) < FP8_TOL
    assert _rel(got[1], g64 @ w64) < FP8_TOL
    assert _rel(got[2], g64.T @ x64) < FP8_TOL


def test_torch_backend_uses_the_blockwise_recipes_on_sm90():
    _skip_unless("torch")
    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability()[0] != 9 or not hasattr(F, "ScalingType"):
        pytest.skip(f"blockwise scaled_mm needs SM90 and torch >= 2.10 (torch {torch.__version__})")
    assert gemm.torch_mode(device) == "blockwise"
    a, bq = quantize_rows(torch.randn(256, 512, device=device)), quantize_blocks(torch.randn(384, 512, device=device))
    got = gemm.torch_gemm(a, bq, b_block=128, out_dtype=torch.float32)
    if gemm.torch_mode(device) != "blockwise":
        pytest.skip(f"PyTorch refused the blockwise recipes here: {gemm._torch_fallbacks.get(str(device))}")
    # Hopper's FP8 tensor cores accumulate with fewer bits than float32 between promotions
    # (measured: 1.3e-4 relative against the float64 sums of the reference).
    assert _rel(got, gemm.emulated_gemm(a, bq, b_block=128, out_dtype=torch.float32)) < 5e-4


def test_quantisation_on_the_gpu_matches_the_cpu_bit_for_bit():
    x = torch.randn(300, 1000) * torch.logspace(-6, 3, 300)[:, None]
    for quantize in (quantize_rows, quantize_blocks):
        q_cpu, s_cpu = quantize(x)
        q_gpu, s_gpu = quantize(x.cuda())
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
        assert torch.equal(s_gpu.cpu(), s_cpu)


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "bf16_wgrad"])
def test_fp8_training_tracks_bf16(fp8_wgrad):
    """200 AdamW steps of next-token loss on 4 fixed random rows (memorisation) with a tiny
    Qwen3 (hidden 256, 2 layers), float32 master weights under bf16 autocast. The FP8 model
    (``auto``: DeepGEMM where installed, else torch; the weight gradient in FP8 or in bf16) must
    stay within 5 % + 0.05 nats of the bf16 curve in every 20-step window."""
    from prime_plugin_custom.model import CausalLM
    from prime_plugin_custom.tiny import randomise, tiny_config
    from prime_plugin_fp8.convert import convert

    backend = gemm.resolve("auto", torch.device("cuda", torch.cuda.current_device()))
    config = tiny_config("Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=768,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    rows = torch.randint(0, 2048, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
    curves = {}
    for run in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = CausalLM(config)
        randomise(model, seed=0, std=0.05)
        model.cuda()
        if run == "fp8":
            assert convert(model, "auto", fp8_wgrad=fp8_wgrad) == 14
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(200):
            ids = rows[step % 4][None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids).logits[0, :-1]
            loss = F.cross_entropy(logits.float(), ids[0, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves[run] = torch.stack(losses).float().cpu()
    bf16, fp8 = curves["bf16"].view(10, 20).mean(1), curves["fp8"].view(10, 20).mean(1)
    summary = f"backend={backend} bf16={bf16.tolist()} fp8={fp8.tolist()}"
    assert bf16[-1] < 0.5 * bf16[0], summary  # the task is learnt
    assert ((fp8 - bf16).abs() <= 0.05 * bf16 + 0.05).all(), summary


def test_compiled_group_launches_the_quantisers_from_inductor_with_eager_s_bits():
    """A group (q, k, v shapes) under ``torch.compile`` (Inductor, one graph): its quantisers are
    Triton operators that Inductor launches from its own code, its GEMMs one custom operator
    each; the outputs and all gradients are eager's bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from prime_plugin_fp8.linear import fp8_linears

    backend = gemm.resolve("auto", torch.device("cuda", torch.cuda.current_device()))
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3, 300, 640, device="cuda", generator=g).bfloat16()
    weights = [(torch.randn(n, 640, device="cuda", generator=g) / 25).bfloat16() for n in (512, 128, 128)]
    dys = [torch.randn(3, 300, n, device="cuda", generator=g).bfloat16() for n in (512, 128, 128)]

    def run(fn):
        xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights]
        outs = fn(xs, *ws)
        torch.autograd.backward(outs, dys)
        return (*outs, xs.grad, *(w.grad for w in ws))

    def group(x, *ws):
        return fp8_linears(x, ws, backend=backend)

    want = run(group)
    got, (forward_code, *_) = run_and_get_code(run, torch.compile(group, fullgraph=True, dynamic=False))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert "rows_and_columns" in forward_code and "prime_fp8.gemm" in forward_code, forward_code


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_input_grad_beside_weight_grad_has_one_stream_s_bits(compiled, monkeypatch):
    """``fp8_wgrad=False``: the input gradient's chain on a second stream beside the weight
    gradient's GEMM (``OVERLAP``) gives the one-stream gradients bit for bit, eagerly and under
    ``torch.compile`` (where the pair is one custom operator)."""
    from torch._inductor.utils import run_and_get_code

    from prime_plugin_fp8 import linear

    backend = gemm.resolve("auto", torch.device("cuda", torch.cuda.current_device()))
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2, 1000, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1536, 2048, device="cuda", generator=g) / 45).bfloat16()
    dy = torch.randn(2, 1000, 1536, device="cuda", generator=g).bfloat16()

    def forward(a, b):
        return fp8_linear(a, b, backend=backend, fp8_wgrad=False)

    beside, calls = linear._input_grad_beside_weight_grad, []

    def counted(*args):
        calls.append(args)
        return beside(*args)

    monkeypatch.setattr(linear, "_input_grad_beside_weight_grad", counted)

    def run(overlap):
        monkeypatch.setattr(linear, "OVERLAP", overlap)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = torch.compile(forward, fullgraph=True, dynamic=False) if compiled else forward
        fn(xs, ws).backward(dy)
        return xs.grad, ws.grad

    want = run(False)
    assert not calls, len(calls)  # one stream: the two gradients one after the other
    got, codes = run_and_get_code(run, True)
    assert len(calls) == 1, len(calls)  # two streams, eagerly or from inside the compiled operator
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    if compiled:
        assert any("input_grad_beside_weight_grad" in code for code in codes), codes


def test_compiled_with_a_symbolic_row_count_the_quantisers_give_eager_s_bits():
    """Packed rows of varying length make a compiled block's row count symbolic. The quantisers'
    operators then still compile (their scales were once an ``empty_strided`` tensor that
    Inductor cloned and failed to: stop 70) and give the eager bits."""
    from prime_plugin_fp8 import triton_quant

    def quantize(x):
        return triton_quant.quantize_rows(x), triton_quant.quantize_rows_and_columns(x)

    compiled = torch.compile(quantize, dynamic=True, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    for m in (90, 37, 256, 1):
        x = torch.randn(m, 300, device="cuda", generator=g).bfloat16()
        got, want = compiled(x), quantize(x)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            assert a.shape == b.shape and a.stride() == b.stride(), (m, a.shape, a.stride(), b.stride())
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), m


def test_checkpointing_fsdp_and_kept_blocks_train_as_plain_fp8(tmp_path):
    """The FP8 model (bf16 compute, float32 masters, the ``auto`` backend) over three steps of
    several passes each, so that the weights' blocks are kept from the second step on and the
    recomputation of a checkpointed block finds them. With activation checkpointing on every
    block it trains to the same losses and weights as without, bit for bit: eagerly, and under
    FSDP (asked for with ``reshard_after_forward``). FSDP itself is not the one-process casts'
    bits on a GPU, for any model (probably: its gathered weights sit elsewhere in memory, and
    cuBLAS picks kernels by alignment too), only near them. Compiled, checkpointing may round
    otherwise (the compiler fuses a checkpointed block differently), but by no more than
    compiling itself does."""
    from prime_core.parity import distance, run
    from prime_core.testing.contracts.parallel_strategy import tiny_model
    from prime_plugin_fp8.weight_cache import CACHE

    fp8 = {"impl": "custom", "dtype": "bfloat16", "quantization": "fp8", "compile": False}
    ac, fsdp = {"ac": {"freq": 1}}, {"reshard_after_forward": True}
    compiled = {**fp8, "compile": {}}
    cases = [{"name": "fp8", "model": fp8}, {"name": "ac", "model": {**fp8, **ac}},
             {"name": "fsdp", "model": {**fp8, **fsdp}}, {"name": "fsdp_ac", "model": {**fp8, **fsdp, **ac}},
             {"name": "compiled", "model": compiled}, {"name": "compiled_ac", "model": {**compiled, **ac}}]
    CACHE.hits = CACHE.misses = 0
    run(tiny_model(tmp_path / "tiny"), tmp_path, cases)
    assert CACHE.hits > 0, "no pass found the weights' blocks kept"
    got = {case["name"]: torch.load(tmp_path / f"{case['name']}.pt", weights_only=False) for case in cases}
    for name, result in got.items():
        assert "fp8" in result["applied"] and ("ac" in result["applied"]) == name.endswith("ac"), \
            (name, result["applied"])
        assert bool(result["layout"]) == name.startswith("fsdp"), (name, "FSDP in the fsdp cases only")
    for name, plain in (("ac", "fp8"), ("fsdp_ac", "fsdp")):
        assert got[name]["losses"] == got[plain]["losses"], (name, got[name]["losses"], got[plain]["losses"])
        for key, value in got[plain]["state"].items():
            assert torch.equal(got[name]["state"][key], value), (name, key)
    for a, b in zip(got["fsdp"]["losses"], got["fp8"]["losses"], strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (got["fsdp"]["losses"], got["fp8"]["losses"])
    compiling = distance(got["compiled"]["state"], got["fp8"]["state"])
    assert distance(got["compiled_ac"]["state"], got["compiled"]["state"]) <= 2 * compiling, compiling
