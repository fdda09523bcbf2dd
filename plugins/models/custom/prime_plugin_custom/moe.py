"""The mixture-of-experts layer, written against the contract expert parallelism plugs into.

``SparseMoE.forward(x [T, H])``: the router (float32) picks ``top_k`` experts per token, the
``dispatcher`` groups the token copies by expert (``LocalDispatcher`` here; an EP backend
sends them to the ranks that own the experts), ``experts`` runs every local expert on its
contiguous group with one grouped matmul, and ``dispatcher.combine`` brings the outputs back
and sums them weighted by the router. An optional shared expert is added on top.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from prime_plugin_custom.layers import MLP

TRITON = importlib.util.find_spec("triton") is not None
if TRITON:  # registers the permutation's operators, so a compiled block can call them
    from prime_plugin_custom import moe_triton


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Reference grouped matmul: rows ``x [N, K]`` come in groups of ``counts [E]`` and group
    ``e`` is multiplied by ``w[e]`` (``w [E, K, M]``, any strides) -> ``[N, M]``."""
    groups = torch.split(x, counts.tolist())
    # Every expert takes part, empty groups too, so each gets a (zero) gradient.
    return torch.cat([g @ w[e] for e, g in enumerate(groups)])


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_loop`` in one ``torch._grouped_mm`` call (CUDA, bfloat16, sm90+)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return torch._grouped_mm(x, w, offs=offsets)


def torch_grouped_mm_unavailable() -> str | None:
    """Why ``torch._grouped_mm`` cannot run here (``None`` when it can); initialises no CUDA
    context (the compute capability is checked per call)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (needs torch >= 2.8)"
    if not torch.cuda.is_available():
        return "torch._grouped_mm needs a CUDA GPU"
    return None


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` where it runs (bfloat16 on a CUDA GPU of compute capability 9.0
    or newer), else the reference loop. Same contract as ``grouped_mm_loop``."""
    if (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())):
        return grouped_mm_torch(x, w, counts)
    return grouped_mm_loop(x, w, counts)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, H] @ weight.T`` in float32 (the router's logits). With bfloat16 ``x`` and ``weight``
    on a CUDA GPU, one bfloat16 GEMM writing float32 (``_Bf16Router``); elsewhere both are cast
    to float32 first."""
    if x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16:
        return _Bf16Router.apply(x, weight)
    return F.linear(x.float(), weight.float())


class _Bf16Router(torch.autograd.Function):
    """The forward computes what ``F.linear(x.float(), weight.float())`` does (bfloat16 values are
    exact in float32; the products are summed in float32), on the tensor cores: the float32 GEMMs
    ran on the CUDA cores, 1.6 ms of a 2.9B MoE step (8 layers, 8k tokens) on an H200. The backward
    rounds the logits' gradient to bfloat16 and multiplies in bfloat16, as transformers' bfloat16
    router does; the gradients it returns are bfloat16 either way."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def _local(param: torch.Tensor) -> torch.Tensor:
    # An EP strategy shards the expert weights as DTensors over dim 0; this rank computes
    # with its own slice.
    return param.to_local() if hasattr(param, "to_local") else param


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked, in transformers 5's in-memory layout:
    ``gate_up_proj [E, 2 * I, H]`` (gate rows first) and ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.grouped_mm = grouped_mm

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [N, H]`` grouped by local expert (``counts [E_local]``) -> ``[N, H]``."""
        # Cast: without a data-parallel wrapper nothing turns float32 master weights into
        # the compute dtype.
        gate_up = _local(self.gate_up_proj).to(x.dtype)
        down = _local(self.down_proj).to(x.dtype)
        gate, up = self.grouped_mm(x, gate_up.transpose(1, 2), counts).chunk(2, dim=-1)
        return self.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), counts)


class _Gather(torch.autograd.Function):
    """``x[index]`` where every row of ``x`` is taken ``copies`` times, ``index``'s inverse
    (``inverse[index[i] * copies + j]`` lists row ``index[i]``'s copies) known. Its backward
    gathers and sums each row's copies, where autograd's would scatter-add them with atomics
    into a zeroed buffer (about 2 ms a layer for 64k copies of 2,048 features on an H200)."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        rows = grad[inverse]
        if ctx.copies > 1:
            rows = rows.view(-1, ctx.copies, grad.shape[-1]).sum(dim=1)
        return rows, None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """``x[index]``, differentiable through a gather (``_Gather``): ``index`` takes every row of
    ``x`` exactly ``copies`` times and ``inverse`` lists where, row by row."""
    return _Gather.apply(x, index, inverse, copies)


class LocalDispatcher:
    """Dispatch and combine without communication: every expert is local. On a CUDA device
    with Triton, the copies move in ``moe_triton``'s kernels; elsewhere through ``gather_rows``."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor):
        """``(x_local [T * k, H], counts [E] int64, handle)``: the token copies sorted by expert
        (stable, so tokens stay in order within an expert)."""
        tokens, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # Not bincount: on a GPU it sizes its output from max() read by the host, a sync per layer
        # (the GPU idled 0.3-1 ms at each on an H100) that also split the compiled block.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # Copy i of token t sits at inverse[t * k + i]: the backward sums a token's copies by a
        # gather, in a fixed order.
        if x.is_cuda and TRITON:
            x_local = moe_triton.dispatch(x, inverse, k)
        else:
            x_local = gather_rows(x, order // k, inverse, k)
        return x_local, counts, (order, inverse, topk_weight, tokens, k)

    def combine(self, y_local: torch.Tensor, handle) -> torch.Tensor:
        """``[T, H]``: for each token the router-weighted sum of its ``k`` expert outputs."""
        order, inverse, topk_weight, tokens, k = handle
        if y_local.is_cuda and TRITON:
            return moe_triton.combine(y_local, inverse, topk_weight)
        # Back in (token, choice) order, the k copies of a token are adjacent: a fixed-order
        # sum, no atomics (and none in the backward, a gather by ``order``).
        y = gather_rows(y_local, inverse, order).view(tokens, k, y_local.shape[-1])
        return (y * topk_weight.to(y.dtype)[..., None]).sum(dim=1)


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE, Qwen2-MoE), optionally with a shared expert.

    ``gate``: the router ``nn.Linear(H, E, bias=False)``, computed in float32; ``experts``:
    ``Experts``; ``dispatcher``: ``LocalDispatcher`` until an EP strategy swaps in its own;
    ``shared_expert`` / ``shared_expert_gate``: ``None`` when the family has none."""

    def __init__(self, *, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate: int | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.dispatcher = LocalDispatcher(num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx [T, k] int64, topk_weight [T, k] float32)``: softmax over all experts,
        then the top k (renormalised to sum to 1 when ``norm_topk_prob``)."""
        logits = router_logits(x, self.gate.weight)
        weight, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weight = self.route(x)
        x_local, counts, handle = self.dispatcher.dispatch(x, idx, weight)
        out = self.dispatcher.combine(self.experts(x_local, counts), handle)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
