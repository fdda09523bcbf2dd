"""Eager stand-ins for ``liger_kernel.transformers.functional``."""

import torch
import torch.nn.functional as F

calls = []


def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
    calls.append(("rms_norm", {"casting_mode": casting_mode, "in_place": in_place, "offset": offset}))
    assert casting_mode == "llama"
    h = X.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (W + offset) * h.to(X.dtype)


def liger_swiglu(a, b):
    calls.append(("swiglu", {}))
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + turned * sin[:, :, None, :]


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        rows = []
        for x in (q, k):
            memory = x.transpose(1, 2).contiguous()  # the very storage of x when that is contiguous
            memory.copy_(_rotate(memory, cos, sin))
            rows.append(memory.transpose(1, 2))
        ctx.save_for_backward(cos, sin)
        return rows[0], rows[1], cos, sin

    @staticmethod
    def backward(ctx, dq, dk, _dcos, _dsin):
        cos, sin = ctx.saved_tensors
        grads = [_rotate(g.transpose(1, 2), cos, -sin).transpose(1, 2) for g in (dq, dk)]
        return grads[0], grads[1], None, None


def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    calls.append(("rope", {"q": tuple(q.shape), "cos": tuple(cos.shape)}))
    return _Rope.apply(q, k, cos, sin)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction):
        logits = (hidden @ weight.t()).float()
        keep = target != ignore_index
        safe = torch.where(keep, target, 0)
        lse = logits.logsumexp(-1)
        loss = torch.where(keep, lse - logits.gather(-1, safe[:, None])[:, 0], 0.0)
        grad_logits = torch.softmax(logits, -1) - F.one_hot(safe, logits.shape[-1]).float()
        grad_logits = grad_logits * keep[:, None]
        if reduction == "mean":
            grad_logits = grad_logits / keep.sum().clamp_min(1)
        grad_logits = grad_logits.to(hidden.dtype)
        ctx.save_for_backward(grad_logits @ weight, grad_logits.t() @ hidden)
        if reduction == "none":
            return loss
        return loss.sum() / (keep.sum().clamp_min(1) if reduction == "mean" else 1)

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        first = grad_output.reshape(-1)[0]  # a scalar load, whatever the reduction
        return grad_hidden * first, grad_weight * first, None, None, None


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False):
    calls.append(("flce", {"reduction": reduction, "grad": torch.is_grad_enabled() and input.requires_grad}))
    assert bias is None and ce_weight is None and softcap is None and not return_z_loss
    return _FusedLinearCrossEntropy.apply(input, weight, target, ignore_index, reduction)
