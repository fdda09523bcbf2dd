"""The kernel contract suite: correct eager kernels pass every op's check, and kernels that
break the contract fail it, each for what it breaks. (The kernel plugins run the suite in
plugins/kernels/*/tests/test_contract.py.)"""

import pytest
import torch
import torch.nn.functional as F

from prime_core.specs import Kernel
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import kernel_ops as ops
from prime_core.testing.contracts.kernel import check_available_is_cheap, check_kernel


def kernel(op, impl, **kwargs):
    return Kernel(op=op, name="mine", impl=impl, **kwargs)


def rmsnorm(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(q, k, cos, sin):
    return ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)


def attention(q, k, v, packing, scale):
    bounds = packing.segments()
    return torch.cat([ops.attention_reference(q[s:e], k[s:e], v[s:e], [e - s], scale) for s, e in bounds])


def grouped_mm(x, w, counts):
    return torch.cat([g @ w[e] for e, g in enumerate(x.split(counts.tolist()))])


def lm_head(hidden, weight, targets, temperature=1.0, *, token_chunk, with_entropy=True, vocab_chunk=None):
    logsm = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return logsm.gather(1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1) if with_entropy else None


def fp8_emulated(model, *, fp8_wgrad=True, cache_weight=False):
    from prime_plugin_fp8.convert import convert

    return convert(model, "emulated", fp8_wgrad=fp8_wgrad, cache_weight=cache_weight)


CORRECT = {"rmsnorm": rmsnorm, "swiglu": lambda g, u: F.silu(g) * u, "rope": rope, "attention": attention,
           "grouped_mm": grouped_mm, "lm_head": lm_head, "hf_patch": lambda model: None}


@pytest.mark.parametrize("op", sorted(CORRECT))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_correct_eager_kernels_pass(op, dtype):
    errors = check_kernel(kernel(op, CORRECT[op]), dtype=dtype, device="cpu")
    assert errors and max(errors.values()) <= ops.TOLERANCE[dtype]


def test_the_fp8_reference_backend_passes():
    errors = check_kernel(kernel("fp8_linear", fp8_emulated), device="cpu")
    assert errors["output"] < 0.02


def norm_without_weight(x, weight, eps):
    return rmsnorm(x, torch.ones_like(weight), eps)


def norm_in_place(x, weight, eps):
    return x.mul_(1).copy_(rmsnorm(x.detach(), weight, eps)) if not x.requires_grad else rmsnorm(
        x.data.mul_(torch.rsqrt(x.data.pow(2).mean(-1, keepdim=True) + eps)), weight, 0.0)


def rope_interleaved(q, k, cos, sin):
    def turn(x):  # the other rotary layout: pairs (0, 1), (2, 3), ... instead of halves
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

    return (q * cos[:, None] + turn(q) * sin[:, None], k * cos[:, None] + turn(k) * sin[:, None])


def attention_across_samples(q, k, v, packing, scale):
    return ops.attention_reference(q, k, v, [q.shape[0]], scale).to(q.dtype)


def grouped_mm_skipping_empty_groups(x, w, counts):
    live = [e for e, c in enumerate(counts.tolist()) if c]
    return torch.cat([g @ w[i] for i, g in zip(range(len(live)), x.split([c for c in counts.tolist() if c]),
                                                strict=True)])


def lm_head_ignoring_temperature(hidden, weight, targets, temperature=1.0, **kwargs):
    return lm_head(hidden, weight, targets, 1.0, **kwargs)


def lm_head_in_input_dtype(hidden, weight, targets, temperature=1.0, **kwargs):
    logp, entropy = lm_head(hidden, weight, targets, temperature, **kwargs)
    return logp.double(), entropy


@pytest.mark.parametrize(("op", "impl", "message"), [
    ("rmsnorm", norm_without_weight, "grad weight = inf|output 0"),
    ("rmsnorm", norm_in_place, "changed its input #0 in place"),
    ("swiglu", lambda gate, up: F.silu(up) * gate, "output 0 = "),
    ("rope", rope_interleaved, "output 0 = "),
    ("attention", attention_across_samples, "attention on samples \\[5, 9, 3\\]: .*output 0 = "),
    ("grouped_mm", grouped_mm_skipping_empty_groups, "output 0 = "),
    ("lm_head", lm_head_ignoring_temperature, "chunk auto: logp = "),
    ("lm_head", lm_head_in_input_dtype, "log-probabilities in torch.float64, expected float32"),
])
def test_broken_kernels_fail(op, impl, message):
    with pytest.raises(ContractError, match=message):
        check_kernel(kernel(op, impl), device="cpu")


def test_an_sft_only_lm_head_must_refuse_entropies():
    with pytest.raises(ContractError, match="must refuse with_entropy=True"):
        check_kernel(kernel("lm_head", lm_head), device="cpu", rl=False)


def test_a_patch_that_changes_the_model_fails():
    def wrong_norm(model):
        model.model.norm.variance_epsilon = 10.0

    with pytest.raises(ContractError, match="hf_patch: differs from the reference .*logits"):
        check_kernel(kernel("hf_patch", wrong_norm), device="cpu")


def test_fp8_conversions_that_break_the_contract_fail():
    def also_the_head(model, *, fp8_wgrad=True):
        from prime_plugin_fp8.linear import FP8Linear

        model.lm_head = FP8Linear(model.lm_head, backend="emulated", fp8_wgrad=fp8_wgrad)
        return fp8_emulated(model, fp8_wgrad=fp8_wgrad) + 1

    with pytest.raises(ContractError, match="converted .*lm_head.*exactly the blocks'"):
        check_kernel(kernel("fp8_linear", also_the_head), device="cpu")

    def fresh_parameters(model, *, fp8_wgrad=True):
        count = fp8_emulated(model, fp8_wgrad=fp8_wgrad)
        for block in model.layers:
            block.q_proj.weight = torch.nn.Parameter(block.q_proj.weight.detach().clone())
        return count

    with pytest.raises(ContractError, match="replaced Parameters"):
        check_kernel(kernel("fp8_linear", fresh_parameters), device="cpu")

    def miscounts(model, *, fp8_wgrad=True):
        return fp8_emulated(model, fp8_wgrad=fp8_wgrad) - 1

    with pytest.raises(ContractError, match="returned 13 but converted 14 modules"):
        check_kernel(kernel("fp8_linear", miscounts), device="cpu")

    def off_when_cached(model, *, fp8_wgrad=True, cache_weight=False):
        count = fp8_emulated(model, fp8_wgrad=fp8_wgrad, cache_weight=cache_weight)
        if cache_weight:
            model.layers[0].q_proj.register_forward_hook(lambda _module, _args, out: out * (1 + 2**-10))
        return count

    with pytest.raises(ContractError, match="with cache_weight=True the output differs"):
        check_kernel(kernel("fp8_linear", off_when_cached), device="cpu")


def test_availability_checks_that_raise_or_initialise_cuda_fail(monkeypatch):
    def broken():
        raise ImportError("no module named fancy")

    with pytest.raises(ContractError, match="available\\(\\) raised ImportError"):
        check_available_is_cheap(kernel("swiglu", CORRECT["swiglu"], available=broken))
    with pytest.raises(ContractError, match="non-empty reason"):
        check_available_is_cheap(kernel("swiglu", CORRECT["swiglu"], available=lambda: ""))

    state = {"initialised": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialised"])

    def initialises():
        state["initialised"] = True  # as torch.cuda.get_device_capability() would

    with pytest.raises(ContractError, match="available\\(\\) initialised CUDA"):
        check_available_is_cheap(kernel("swiglu", CORRECT["swiglu"], available=initialises))
