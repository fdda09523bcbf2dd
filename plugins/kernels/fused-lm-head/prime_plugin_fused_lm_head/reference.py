"""The eager reference every ``lm_head:fused`` implementation is checked against: the full
logits in float64, ``log_softmax`` and a gather. Memory ``O(N * V)``: for tests only.

``check_against_reference`` is the check every implementation's tests run: errors are
measured against the size of what is compared, ``|got - ref| <= tol * (|ref| + max(1, max
|ref|))``, since gradients are sums that cancel and elementwise relative error means nothing
near zero. ``tol`` is 1e-5 for float32 (measured worst: about 6e-7) and 3e-2 for bfloat16
(measured worst: about 7e-3): the matmul rounds every logit to bfloat16 (up to 4e-3
relative), an absolute error that passes into every probability and gradient."""

from __future__ import annotations

import torch


def reference_logprobs(hidden, weight, targets, temperature=1.0):
    """``(logp [N], entropy [N])`` in float64, differentiable in ``hidden`` and ``weight``
    (through their float64 copies) for comparing gradients."""
    logits = hidden.double() @ weight.double().T
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.double().reshape(-1, 1)
    else:
        logits = logits / float(temperature)
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, targets[:, None])[:, 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-10}


def assert_near(got, ref, dtype, what, loosen=1.0):
    ref = ref.detach()
    assert got.shape == ref.shape, what
    if ref.numel() == 0:
        return
    error = (got.double() - ref).abs()
    allowed = loosen * TOL[dtype] * (ref.abs() + max(1.0, ref.abs().max().item()))
    worst = (error / allowed).max().item()
    assert worst <= 1, f"{what}: max error {error.max().item():.3g} is {worst:.2f}x the {dtype} tolerance"


def make_inputs(n, vocab, width, dtype, per_token, *, seed, logit_scale=2.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=generator).to(dtype).requires_grad_()
    # Logits of standard deviation ~logit_scale, as a trained head produces: large enough to
    # make the softmax peaked, small enough that bfloat16 rounding of them stays meaningful.
    weight = (torch.randn(vocab, width, generator=generator) * logit_scale / width**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=generator)
    temperature = torch.rand(n, generator=generator) + 0.5 if per_token else 0.7
    upstream = torch.randn(n, generator=generator)
    return hidden, weight, targets, temperature, upstream


def check_against_reference(impl, n, vocab, width, dtype, per_token, token_chunk, vocab_chunk, seed=0, loosen=1.0,
                            device="cpu", **kwargs):
    """Run ``impl`` (``fused_logprobs``' signature) on fresh inputs and compare its log-probs,
    entropies and both gradients with the float64 reference."""
    hidden, weight, targets, temperature, upstream = make_inputs(n, vocab, width, dtype, per_token, seed=seed,
                                                                 **kwargs)
    if device != "cpu":
        hidden, weight = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
        targets, upstream = targets.to(device), upstream.to(device)
        temperature = temperature.to(device) if isinstance(temperature, torch.Tensor) else temperature
    logp, entropy = impl(hidden, weight, targets, temperature, token_chunk=token_chunk,
                                   vocab_chunk=vocab_chunk)
    assert logp.dtype == entropy.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_hidden, grad_weight = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    assert (grad_hidden.dtype, grad_weight.dtype) == (dtype, dtype)

    ref_logp, ref_entropy = reference_logprobs(hidden, weight, targets, temperature)
    ref_hidden, ref_weight = torch.autograd.grad((ref_logp * upstream.double()).sum(), (hidden, weight))
    logp, entropy, grad_hidden, grad_weight = (t.cpu() for t in (logp, entropy, grad_hidden, grad_weight))
    ref_logp, ref_entropy, ref_hidden, ref_weight = (t.cpu() for t in (ref_logp, ref_entropy, ref_hidden, ref_weight))
    assert_near(logp, ref_logp, dtype, "logp", loosen)
    assert_near(entropy, ref_entropy, dtype, "entropy", loosen)
    assert_near(grad_hidden, ref_hidden, dtype, "grad hidden", loosen)
    assert_near(grad_weight, ref_weight, dtype, "grad weight", loosen)
