"""Run under torchrun: ``ep_apply_worker.py OUT.json EP``.

Builds a small model with two MoE layers that follow the ``SparseMoE`` contract (a stand-in
written here, not the custom plugin's), rank 0 on CPU and the others on the meta device as the
core does, applies the ``ep`` strategy over a ``(world / EP, EP)`` mesh, fills the shards from
rank 0 with ``broadcast_from_rank0``, and compares the forward output and every gradient
with the unsharded module run on all ranks' inputs in one process, after the reduction data
parallelism does (emulated here: the dense gradients averaged over every rank, the expert
gradients summed over ``dp_mod_ep`` and divided by the world size, as the fsdp plugin does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from prime_plugin_ep.dispatch import make as local_dispatcher

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 8


class StandInExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) / INTER ** 0.5)

    def forward(self, x, counts):
        gate_up, down = (p.to_local() if isinstance(p, DTensor) else p for p in (self.gate_up_proj, self.down_proj))
        outs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            gate, up = (chunk @ gate_up[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ down[e].T)
        return torch.cat(outs)


class StandInMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = EXPERTS, TOP_K
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = StandInExperts()
        self.dispatcher = local_dispatcher(None, num_experts=EXPERTS)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weight, idx = self.gate(flat).float().softmax(-1).topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        x_local, counts, handle = self.dispatcher.dispatch(flat, idx, weight)
        return self.dispatcher.combine(self.experts(x_local, counts), handle).view_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = StandInMoE()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def build(device: str) -> Tiny:
    torch.manual_seed(0)
    with torch.device(device):
        return Tiny()


def error(got, want) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    want = want.detach()
    return float((got.detach() - want).abs().max() / want.abs().max().clamp_min(1e-12))


def main(path: Path, ep: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from prime_core import distributed
    from prime_core.config.checks import section_model
    from prime_plugin_ep.strategy import apply

    world = distributed.init()
    mesh = init_device_mesh("cpu", (world.size // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    reference = build("cpu")
    full = {key: value.clone() for key, value in reference.state_dict().items()} if world.main else {}
    model = build("cpu" if world.main else "meta")
    assert apply(model, mesh=mesh, config=section_model("trainer", "model")(name="stand-in", ep=ep),
                 world=world) is model
    if not world.main:
        model.to_empty(device="cpu")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    result = {"rank": world.rank, "errors": {}}
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert len(sharded) == 4 and all(p.device_mesh.mesh_dim_names == ("ep",) for p in sharded), sharded
    assert model.layers[0].mlp.dispatcher is model.layers[1].mlp.dispatcher
    per_rank = EXPERTS // ep
    rows = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    for name, param in model.named_parameters():
        want = reference.get_parameter(name)
        if isinstance(param, DTensor):
            assert param.placements == (Shard(0),) and param.shape == want.shape, (name, param.placements)
            assert param.to_local().shape[0] == per_rank
            result["errors"][f"weight:{name}"] = error(param.to_local(), want[rows])
        else:
            result["errors"][f"weight:{name}"] = error(param, want)

    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 3 + rank, HIDDEN, generator=gen) for rank in range(world.size)]
    grads = [torch.randn(2, 3 + rank, HIDDEN, generator=gen) for rank in range(world.size)]
    out = model(inputs[world.rank])
    # The core scales each rank's loss by world_size / total tokens (here 1 token's weight).
    ((out * grads[world.rank]).sum() * world.size).backward()
    for param in model.parameters():  # what data parallelism does
        grad = param.grad.to_local() if isinstance(param, DTensor) else param.grad
        dist.all_reduce(grad, group=mesh["dp_mod_ep"].get_group() if isinstance(param, DTensor) else None)
        grad.div_(world.size)

    ref_outs = [reference(x) for x in inputs]
    sum((o * g).sum() for o, g in zip(ref_outs, grads, strict=True)).backward()
    result["errors"]["out"] = error(out, ref_outs[world.rank])
    for name, param in model.named_parameters():
        want = reference.get_parameter(name).grad
        got = param.grad.to_local() if isinstance(param, DTensor) else param.grad
        result["errors"][f"grad:{name}"] = error(got, want[rows] if isinstance(param, DTensor) else want)
    everyone = [None] * world.size
    dist.all_gather_object(everyone, result)
    if world.main:
        path.write_text(json.dumps(everyone, indent=1))
    distributed.shutdown()
    return result


if __name__ == "__main__":
    from prime_core.distributed import exit_process

    main(Path(sys.argv[1]), int(sys.argv[2]))
    exit_process(0)
