"""The ops the kernel contract knows: how the core and the native model call each one, an
eager float64 reference, and fresh random inputs. Each ``check_<op>(impl, *, dtype, device,
tolerance, ...)`` calls ``impl`` exactly as its caller does, compares the outputs and the
gradients of every differentiable input with the reference, checks that the inputs were
left unchanged, and returns the largest errors (relative to the reference's largest
magnitude); it raises ``ContractError`` when one is above ``tolerance``.

==============  ===========================================================================
op              call (caller)
==============  ===========================================================================
``lm_head``     ``impl(hidden [N, H], weight [V, H], targets [N] int64, temperature: float, *,
                token_chunk: int | "auto", with_entropy: bool) -> (logp [N] float32,
                entropy [N] float32 | None)`` (``prime_core.trainer.model``)
``rmsnorm``     ``impl(x [..., H], weight [H], eps: float) -> like x`` (native ``RMSNorm``,
                also on ``[L, heads, head_dim]`` for q/k norms)
``swiglu``      ``impl(gate, up) -> silu(gate) * up`` (native ``MLP``)
``rope``        ``impl(q [L, Hq, D], k [L, Hkv, D], cos [L, D], sin [L, D]) -> (q, k)``
                rotated, half-split layout (native ``Attention``)
``attention``   ``impl(q [L, Hq, D], k [L, Hkv, D], v, packing, scale: float) -> [L, Hq, D]``,
                causal within each sample of ``packing`` (``prime_core.trainer.packing``);
                ``impl.prepare(packing)``, when present, is called first, once per forward
``grouped_mm``  ``impl(x [N, K], w [E, K, M] (any strides), counts [E] int64) -> [N, M]``, rows
                in groups of ``counts``, group ``e`` times ``w[e]`` (native MoE experts)
``fp8_linear``  ``impl(model, *, fp8_wgrad=True, cache_weight=False) -> int``: converts the
                block linears (``q_proj`` ... ``down_proj``) in place, keeping their
                Parameters; returns how many (the trainer, ``trainer.model.quantization =
                "fp8"``). ``cache_weight``: the linears may reuse a weight's quantisation
                within an optimizer step (``trainer.model.fp8_weight_cache``); same results
``hf_patch``    ``impl(model) -> model | None``: patches a transformers model in place (the
                ``hf`` model implementation)
==============  ===========================================================================
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

from prime_core.testing.contracts import expect

TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2, "float16": 1e-2}
"""Largest error relative to the reference's largest magnitude, per input dtype."""


def _torch():
    import torch

    return torch


def error(got, want) -> float:
    if want is None or want.numel() == 0:
        return 0.0
    if got is None:
        return float("inf")
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _inputs(*shapes, dtype, device, seed: int, scale: float = 1.0):
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device, getattr(torch, dtype))
            .requires_grad_() for shape in shapes]


def _grads(outputs, inputs, upstreams):
    """Gradients of ``sum(out * up)`` over ``outputs`` with respect to ``inputs`` (zeros
    where an input takes no part)."""
    torch = _torch()
    loss = sum((out.double() * up.to(out.device)).sum() for out, up in zip(outputs, upstreams, strict=True))
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


def _upstream(shape, seed: int):
    torch = _torch()
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1000), dtype=torch.float64)


def _compare(op: str, errors: dict[str, float], tolerance: float) -> dict[str, float]:
    """Raise naming every error above ``tolerance``; return ``errors``."""
    bad = [f"{k} = {v:.3g}" for k, v in errors.items() if not v <= tolerance]
    expect(not bad, f"{op}: differs from the reference (relative errors above {tolerance:g}): {', '.join(bad)}")
    return errors


def _unchanged(op: str, inputs, copies) -> None:
    torch = _torch()
    for i, (x, before) in enumerate(zip(inputs, copies, strict=True)):
        expect(torch.equal(x.detach(), before), f"{op}: the kernel changed its input #{i} in place")


def _run(op, impl, inputs, reference, *, tolerance, seed, names):
    """``impl(*inputs)`` and ``reference(*float64 copies)``: outputs and input gradients."""
    copies = [x.detach().clone() for x in inputs]
    got = impl(*inputs)
    got = list(got) if isinstance(got, tuple | list) else [got]
    _unchanged(op, inputs, copies)
    for out, x in zip(got, inputs, strict=False):
        expect(out.dtype == x.dtype, f"{op}: output in {out.dtype}, the input is {x.dtype}")
    exact = [x.detach().double().requires_grad_() for x in inputs]
    want = reference(*exact)
    want = list(want) if isinstance(want, tuple | list) else [want]
    expect(len(got) == len(want), f"{op}: returned {len(got)} tensors, expected {len(want)}")
    upstreams = [_upstream(w.shape, seed + i) for i, w in enumerate(want)]
    got_grads = _grads(got, inputs, upstreams)
    want_grads = _grads(want, exact, upstreams)
    errors = {f"output {i}": error(g, w) for i, (g, w) in enumerate(zip(got, want, strict=True))}
    errors.update({f"grad {name}": error(g, w) for name, g, w in zip(names, got_grads, want_grads, strict=True)})
    return _compare(op, errors, tolerance)


# ------------------------------------------------------------------ elementwise ops


def rmsnorm_reference(x, weight, eps):
    torch = _torch()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def check_rmsnorm(impl, *, dtype, device, tolerance=None, seed=0, **_):
    tolerance = tolerance or TOLERANCE[dtype]
    errors = {}
    for shape in ((13, 32), (11, 4, 16)):  # hidden states, and q/k heads (qk_norm)
        x, weight = _inputs(shape, shape[-1:], dtype=dtype, device=device, seed=seed)
        with _torch().no_grad():
            weight.add_(1.0)
        found = _run(f"rmsnorm on {list(shape)}", lambda a, w: impl(a, w, 1e-6), [x, weight],
                     lambda a, w: rmsnorm_reference(a, w, 1e-6), tolerance=tolerance, seed=seed, names=("x", "weight"))
        errors.update({f"{list(shape)}: {k}": v for k, v in found.items()})
    return errors


def swiglu_reference(gate, up):
    torch = _torch()
    return torch.nn.functional.silu(gate) * up


def check_swiglu(impl, *, dtype, device, tolerance=None, seed=0, **_):
    tolerance = tolerance or TOLERANCE[dtype]
    gate, up = _inputs((13, 48), (13, 48), dtype=dtype, device=device, seed=seed, scale=2.0)
    return _run("swiglu", impl, [gate, up], swiglu_reference, tolerance=tolerance, seed=seed, names=("gate", "up"))


def rotate(x, cos, sin):
    torch = _torch()
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


def rope_tables(lengths, dim: int, dtype, device):
    """``cos, sin [L, D]`` of a packed row's positions (restarting at 0 per sample)."""
    torch = _torch()
    positions = torch.cat([torch.arange(n) for n in lengths]).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.cat([positions[:, None] * inv[None]] * 2, dim=-1)
    return angles.cos().to(device, getattr(torch, dtype)), angles.sin().to(device, getattr(torch, dtype))


def check_rope(impl, *, dtype, device, tolerance=None, seed=0, **_):
    tolerance = tolerance or TOLERANCE[dtype]
    lengths = [5, 8]
    cos, sin = rope_tables(lengths, 16, dtype, device)
    q, k = _inputs((13, 4, 16), (13, 2, 16), dtype=dtype, device=device, seed=seed)
    return _run("rope", lambda a, b: impl(a, b, cos, sin), [q, k],
                lambda a, b: (rotate(a, cos.double(), sin.double()), rotate(b, cos.double(), sin.double())),
                tolerance=tolerance, seed=seed, names=("q", "k"))


# ------------------------------------------------------------------ attention


def attention_reference(q, k, v, lengths, scale):
    """Causal attention within each sample, float64, kv heads repeated for grouped queries."""
    torch = _torch()
    repeat = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n] for t in (q, k, v))
        ks, vs = ks.repeat_interleave(repeat, dim=1), vs.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


def check_attention(impl, *, dtype, device, tolerance=None, seed=0, head_dim=16, **_):
    """``head_dim``: a kernel's contract may name one it supports (``options``)."""
    tolerance = tolerance or TOLERANCE[dtype]
    torch = _torch()
    from prime_core.trainer.packing import Packing

    errors = {}
    scale = head_dim ** -0.5

    def call(a, b, c, positions):
        packing = Packing.from_position_ids(positions)
        if callable(getattr(impl, "prepare", None)):
            impl.prepare(packing)  # once per forward, before the layers
        return impl(a, b, c, packing, scale)

    for lengths in ([17], [5, 9, 3]):
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        q, k, v = _inputs(*((sum(lengths), heads, head_dim) for heads in (4, 2, 2)), dtype=dtype, device=device,
                          seed=seed + len(lengths))
        found = _run(f"attention on samples {lengths}", functools.partial(call, positions=positions), [q, k, v],
                     functools.partial(attention_reference, lengths=lengths, scale=scale), tolerance=tolerance,
                     seed=seed, names=("q", "k", "v"))
        errors.update({f"{lengths}: {name}": value for name, value in found.items()})
    return errors


# ------------------------------------------------------------------ grouped matmul


def check_grouped_mm(impl, *, dtype, device, tolerance=None, seed=0, **_):
    tolerance = tolerance or TOLERANCE[dtype]
    torch = _torch()
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int64, device=device)  # an expert with no tokens
    x, w_rows = _inputs((9, 32), (4, 24, 32), dtype=dtype, device=device, seed=seed)
    # The experts hold [E, M, K]; the model hands the transpose, a strided view.
    return _run("grouped_mm", lambda a, w: impl(a, w.transpose(1, 2), counts), [x, w_rows],
                lambda a, w: torch.cat([g @ w[e].T for e, g in enumerate(a.split(counts.tolist()))]),
                tolerance=tolerance, seed=seed, names=("x", "w"))


# ------------------------------------------------------------------ fp8 linears

FP8_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_TOLERANCE = {"output": 0.05, "grad": 0.2, "reference": 1e-2}
"""Relative Frobenius error of the converted model against float64. Block-scaled FP8 rounds
every GEMM operand (gradients included) to a few mantissa bits; measured on this model: the
output 0.5 %, the weights' gradients about 10 % (float32 and bfloat16 alike). A wrong layout,
scale or transpose is off by 100 % or more. Against the registered reference backend (same FP8
operands), GPU tensor cores promote their float32 accumulation every 128 K where the
reference sums exactly: a few 1e-3 (measured 1.3e-3 on an H100, float32 inputs)."""


def fp8_toy_model(device, dtype, seed: int = 0):
    """Two transformer-shaped blocks (the seven projection names) and an LM head, sized in
    whole 128-wide blocks."""
    torch = _torch()
    from torch import nn

    class Block(nn.Module):
        def __init__(self, hidden, inner):
            super().__init__()
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self, name, nn.Linear(hidden, hidden, bias=False))
            self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
            self.down_proj = nn.Linear(inner, hidden, bias=False)

        def forward(self, x):
            h = self.o_proj(self.q_proj(x) + self.k_proj(x) + self.v_proj(x))
            return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(128, 256), Block(128, 256)])
            self.lm_head = nn.Linear(128, 64, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(x)

    torch.manual_seed(seed)
    return Toy().to(device, getattr(torch, dtype))


def _frobenius(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def check_fp8_linear(impl, *, dtype, device, tolerance=None, seed=0, reference_impl: Callable | None = None, **_):
    """``tolerance`` replaces both of ``FP8_TOLERANCE``'s limits."""
    torch = _torch()
    original = fp8_toy_model(device, dtype, seed)
    model = copy.deepcopy(original)
    params = {name: id(p) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    types = {name: type(m) for name, m in model.named_modules()}
    count = impl(model, fp8_wgrad=True)
    changed = [n for n, m in model.named_modules() if n in types and type(m) is not types[n]]
    expect(isinstance(count, int) and count == len(changed) and count > 0,
           f"fp8_linear: returned {count!r} but converted {len(changed)} modules")
    expect(sorted(n.rsplit(".", 1)[-1] for n in changed) == sorted(FP8_TARGETS * 2),
           f"fp8_linear: converted {changed}; the contract converts exactly the blocks' {', '.join(FP8_TARGETS)}")
    expect({n: id(p) for n, p in model.named_parameters()} == params and list(model.state_dict()) == keys,
           "fp8_linear: the conversion replaced Parameters or renamed state-dict keys (data parallelism and the "
           "optimizer hold the originals)")
    with torch.device("meta"):
        meta = fp8_toy_model("meta", dtype, seed)
    expect(impl(meta, fp8_wgrad=True) == count, "fp8_linear: converting the meta-device build gave another count")

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 128, generator=generator, dtype=torch.float64)
    upstream = torch.randn(37, 64, generator=generator, dtype=torch.float64)
    exact = copy.deepcopy(original).double().cpu()
    want_out = exact(x)
    (want_out * upstream).sum().backward()
    inputs = x.to(device, getattr(torch, dtype))
    got_out = model(inputs)
    (got_out.double() * upstream.to(device)).sum().backward()
    errors = {"output": _frobenius(got_out, want_out)}
    _compare("fp8_linear", errors, tolerance or FP8_TOLERANCE["output"])
    want_grads = dict(exact.named_parameters())
    grads = {f"grad {name}": _frobenius(p.grad, want_grads[name].grad) for name, p in model.named_parameters()}
    errors.update(_compare("fp8_linear", grads, tolerance or FP8_TOLERANCE["grad"]))
    cached = copy.deepcopy(original)
    expect(impl(cached, fp8_wgrad=True, cache_weight=True) == count,
           "fp8_linear: converting with cache_weight=True gave another count")
    for _ in range(2):
        expect(torch.equal(cached(inputs), got_out),
               "fp8_linear: with cache_weight=True the output differs from the uncached conversion's (a weight's "
               "quantisation changes no bit)")
    if reference_impl is not None:  # a registered reference backend computes the same FP8 math
        twin = copy.deepcopy(original)
        reference_impl(twin, fp8_wgrad=True)
        ref_out = twin(inputs)
        errors["output vs reference kernel"] = _frobenius(got_out, ref_out)
        _compare("fp8_linear", {"output vs reference kernel": errors["output vs reference kernel"]},
                 FP8_TOLERANCE["reference"])
    return errors


# ------------------------------------------------------------------ the LM head


def lm_head_reference(hidden, weight, targets, temperature):
    torch = _torch()
    logsm = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    return logsm.gather(1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


def check_lm_head(impl, *, dtype, device, tolerance=None, seed=0, rl: bool = True, **_):
    """``rl``: the kernel serves RL (entropies, any upstream gradient); otherwise it serves SFT
    only and must refuse ``with_entropy=True`` by raising."""
    tolerance = tolerance or TOLERANCE[dtype]
    torch = _torch()
    errors = {}
    n, vocab, width = 13, 40, 24
    hidden, = _inputs((n, width), dtype=dtype, device=device, seed=seed)
    weight, = _inputs((vocab, width), dtype=dtype, device=device, seed=seed + 1, scale=2.0 / width ** 0.5)
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(device)
    if rl:
        upstream = _upstream((n,), seed)
    else:  # SFT: -loss_mask * scale
        upstream = -(torch.arange(n) % 3 != 0).double() * 0.25
        refused = False
        try:
            impl(hidden, weight, targets, 0.7, token_chunk="auto", with_entropy=True)
        except Exception:  # noqa: BLE001 - refusing, with any error, is what an SFT-only kernel must do
            refused = True
        expect(refused, "lm_head: an SFT-only kernel (rl = False) must refuse with_entropy=True, not ignore it")
    exact_h, exact_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want_logp, want_entropy = lm_head_reference(exact_h, exact_w, targets, 0.7)
    want_grads = torch.autograd.grad((want_logp * upstream.to(device)).sum(), (exact_h, exact_w))
    for chunk in ("auto", 4):  # 4: several chunks, the last one short
        copies = (hidden.detach().clone(), weight.detach().clone())
        logp, entropy = impl(hidden, weight, targets, 0.7, token_chunk=chunk, with_entropy=rl)
        _unchanged("lm_head", (hidden, weight), copies)
        expect(logp.dtype == (torch.float64 if dtype == "float64" else torch.float32),
               f"lm_head: log-probabilities in {logp.dtype}, expected float32")
        if rl:
            expect(entropy is not None, "lm_head: with_entropy=True returned no entropy")
            errors[f"chunk {chunk}: entropy"] = error(entropy, want_entropy)
        grads = torch.autograd.grad((logp.double() * upstream.to(device)).sum(), (hidden, weight))
        errors[f"chunk {chunk}: logp"] = error(logp, want_logp)
        errors[f"chunk {chunk}: grad hidden"] = error(grads[0], want_grads[0])
        errors[f"chunk {chunk}: grad weight"] = error(grads[1], want_grads[1])
    return _compare("lm_head", errors, tolerance)


# ------------------------------------------------------------------ transformers patches


def check_hf_patch(impl, *, dtype, device, tolerance=None, seed=0, **_):
    tolerance = tolerance or TOLERANCE[dtype]
    torch = _torch()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(seed)
    original = Qwen3ForCausalLM(config).to(device, getattr(torch, dtype))
    patched = copy.deepcopy(original)
    result = impl(patched)
    expect(result is None or isinstance(result, torch.nn.Module), f"hf_patch: returned {type(result).__name__}, "
                                                                  "not the model or None")
    patched = result if result is not None else patched
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(seed)).to(device)
    errors = {}
    outs = []
    for model in (original, patched):
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    errors["logits"] = error(outs[1][0], outs[0][0])
    for name, grad in outs[0][1].items():
        errors[f"grad {name}"] = error(outs[1][1].get(name), grad)
    return _compare("hf_patch", errors, tolerance)


OPS: dict[str, Callable] = {
    "lm_head": check_lm_head, "rmsnorm": check_rmsnorm, "swiglu": check_swiglu, "rope": check_rope,
    "attention": check_attention, "grouped_mm": check_grouped_mm, "fp8_linear": check_fp8_linear,
    "hf_patch": check_hf_patch,
}
