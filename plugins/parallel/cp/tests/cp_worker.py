"""Run under torchrun (gloo): every CP case on this group, errors against a float64
single-process reference; rank 0 writes ``{case: {quantity: max abs error, ...}}`` as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node N cp_worker.py OUT.json
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from prime_core import distributed
from prime_core.trainer.packing import Packing, cp_indices, pad_to
from prime_plugin_cp.block import EAGER, BlockKernel
from prime_plugin_cp.reference import dense_attention
from prime_plugin_cp.ring import ring_attention
from prime_plugin_cp.strategy import apply
from prime_plugin_cp.ulysses import ulysses_attention

UNEVEN = (37, 5, 83)
D = 16
DEVICE = torch.device("cpu")  # the rank's device (a GPU under NCCL), set by main()


def packed_row(lengths, size: int) -> Packing:
    """Samples back to back, padded to a multiple of ``2 * size`` with a padding sample."""
    positions = [torch.arange(n) for n in lengths]
    filler = pad_to(sum(lengths), 2 * size) - sum(lengths)
    if filler:
        positions.append(torch.arange(filler))
    return Packing.from_position_ids(torch.cat(positions).to(DEVICE))


def reduce_max(values: dict, group) -> dict:
    keys = sorted(values)
    tensor = torch.tensor([float(torch.as_tensor(values[k]).detach()) for k in keys], dtype=torch.float64,
                          device=DEVICE)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, tensor.tolist(), strict=True))


def attention_case(kind, group, *, lengths=UNEVEN, hq=4, hkv=2, dtype=torch.float64, kernel=EAGER):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    row = packed_row(lengths, size)
    generator = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(row.length, h, D, dtype=torch.float64, generator=generator).to(DEVICE)
               for h in (hq, hkv, hkv))
    dout = torch.randn(row.length, hq, D, dtype=torch.float64, generator=generator).to(DEVICE)
    scale = 1 / math.sqrt(D)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = dense_attention(*full, row, scale)
    expected.backward(dout)

    local = cp_indices(row.length, rank, size, device=DEVICE)
    mine = [t[local].to(dtype).requires_grad_() for t in (q, k, v)]
    if kind == "ring":
        out = ring_attention(*mine, row.select(local), scale, group, kernel=kernel)
    else:
        out = ulysses_attention(*mine, row.select(local), scale, group, dense_attention)
    out.backward(dout[local].to(dtype))
    errors = {"out": (out.double() - expected[local]).abs().max()}
    for name, got, want in zip(("dq", "dk", "dv"), mine, full, strict=True):
        errors[name] = (got.grad.double() - want.grad[local]).abs().max()
    errors["nonfinite"] = float(not all(torch.isfinite(t).all() for t in (out, *(m.grad for m in mine))))
    errors["wrong_dtype"] = float(out.dtype != dtype or any(m.grad.dtype != dtype for m in mine))
    return reduce_max(errors, group)


def counted_blocks(group) -> dict:
    """Every sample exactly one zigzag chunk long: no rank may attend another's keys, so each
    rank must compute its own block only (in forward and in backward)."""
    size = dist.get_world_size(group)
    calls = {"forward": 0, "backward": 0}

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    kernel = BlockKernel(forward=count("forward", EAGER.forward), backward=count("backward", EAGER.backward))
    errors = attention_case("ring", group, lengths=[8] * (2 * size), kernel=kernel)
    return {**errors, **reduce_max({f"{k}_blocks": v for k, v in calls.items()}, group)}


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, hq: int, hkv: int) -> None:
        super().__init__()
        self.hq, self.hkv = hq, hkv
        self.q = torch.nn.Linear(hidden, hq * D, dtype=torch.float64)
        self.kv = torch.nn.Linear(hidden, 2 * hkv * D, dtype=torch.float64)
        self.o = torch.nn.Linear(hq * D, hidden, dtype=torch.float64)
        self.attention_fn = dense_attention

    def forward(self, x, packing):
        q = self.q(x).view(len(x), self.hq, D)
        k, v = self.kv(x).view(len(x), 2, self.hkv, D).unbind(1)
        return self.o(self.attention_fn(q, k, v, packing, D ** -0.5).reshape(len(x), -1))


class Toy(torch.nn.Module):
    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(hidden, 4, 2), Attention(hidden, 4, 1)])

    def forward(self, x, packing):
        for layer in self.layers:
            x = x + layer(x, packing)
        return x


def applied_case(style: str, group, mesh) -> dict:
    """The strategy on a two-layer model: outputs, input and parameter gradients (summed over
    the CP group, as data parallelism would) match the unsplit model."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    row = packed_row(UNEVEN, size)
    torch.manual_seed(7)
    reference = Toy().to(DEVICE)
    model = Toy().to(DEVICE)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(row.length, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x_full = x.clone().requires_grad_()
    expected = reference(x_full, row)
    expected.square().sum().backward()

    apply(model, mesh=mesh, config=SimpleNamespace(cp=size, cp_style=style, cp_ring_kernel="auto"),
          world=distributed.World())
    local = cp_indices(row.length, rank, size, device=DEVICE)
    x_local = x[local].clone().requires_grad_()
    with counted_gathers(style) as gathers:
        out = model(x_local, row.select(local))
        out.square().sum().backward()
    errors = {"out": (out - expected[local]).abs().max(), "dx": (x_local.grad - x_full.grad[local]).abs().max()}
    worst = 0.0
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, float((p.grad - r.grad).abs().max()))
    errors["dparams"] = worst
    errors["wrapped"] = float(sum(type(m.attention_fn).__name__ == "CPAttention" for m in model.layers))
    errors["gathers"] = float(gathers[0])
    return reduce_max(errors, group)


@contextlib.contextmanager
def counted_gathers(style: str):
    """Counts (in the yielded list's one item) the all-gathers of row positions the style's
    module makes inside the block."""
    module = importlib.import_module(f"prime_plugin_cp.{style}")
    gather, count = module.gather_packing, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return gather(*args, **kwargs)

    module.gather_packing = counted
    try:
        yield count
    finally:
        module.gather_packing = gather


def head_error(group) -> dict:
    """3 query heads cannot be split over 2 or 4 ranks: every rank raises before communicating."""
    row = packed_row(UNEVEN, dist.get_world_size(group))
    q = torch.zeros(row.length // dist.get_world_size(group), 3, D, device=DEVICE)
    try:
        ulysses_attention(q, q[:, :1], q[:, :1], row, 1.0, group, dense_attention)
    except ValueError as error:
        return {"message": str(error)}
    return {"message": ""}


def main() -> int:
    from torch.distributed.device_mesh import init_device_mesh

    global DEVICE
    world = distributed.init()
    DEVICE = world.device
    mesh = init_device_mesh(DEVICE.type, (world.size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    for kind in ("ring", "ulysses"):
        results[f"{kind}_f64"] = attention_case(kind, group)
        results[f"{kind}_mqa"] = attention_case(kind, group, hq=4, hkv=1)
        results[f"{kind}_apply"] = applied_case(kind, group, mesh)
        if world.size == 2:
            results[f"{kind}_f32"] = attention_case(kind, group, dtype=torch.float32)
            results[f"{kind}_bf16"] = attention_case(kind, group, dtype=torch.bfloat16)
    # The flash block kernel's plans through the real ring (flash's calls emulated by the eager
    # kernel, test_flash_block.py), and on GPUs torch's flash kernel itself in bf16.
    from test_flash_block import EMULATED

    results["ring_plan"] = attention_case("ring", group, kernel=EMULATED)
    if DEVICE.type == "cuda":
        from prime_plugin_cp.cudnn_block import CUDNN
        from prime_plugin_cp.flash_block import FLASH

        results["ring_flash"] = attention_case("ring", group, hq=16, hkv=8, dtype=torch.bfloat16, kernel=FLASH)
        results["ring_cudnn"] = attention_case("ring", group, hq=16, hkv=8, dtype=torch.bfloat16, kernel=CUDNN)
    results["ring_isolated"] = counted_blocks(group)
    results["head_error"] = head_error(group)
    if world.main:
        with open(sys.argv[1], "w", encoding="utf-8") as handle:
            json.dump({"world_size": world.size, **results}, handle, indent=1)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    distributed.exit_process(main())
