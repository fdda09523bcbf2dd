"""Contract tests for any EP backend (``prime_core.specs.EPBackend``).

Inside an initialised process group, ``check_backend(name)`` routes random tokens through the
backend's dispatcher: dispatch → a known linear map per global expert → combine, then
backward, and compares the output, the per-expert counts and grouping, and the gradients of
``x``, ``topk_weight`` and the expert weights with a dense float64 computation of the same
thing over every rank's tokens (each rank regenerates all ranks' inputs from the seed, so the
reference needs no communication). The routing is uneven on purpose: ranks hold different
numbers of tokens and the last expert gets none; in the ``uneven`` scenario rank 0 never
routes to the last rank's experts, and in the ``idle_rank`` scenario the last rank has no
tokens at all (but receives some).

From the command line, under torchrun (``run_in_processes`` does this)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m prime_plugin_ep.contract torch OUT.json [--ep 2] [--dtype bfloat16] [--hidden 256]

checks the whole world as one EP group, and with ``--ep N`` also groups of N consecutive
ranks. Rank 0 writes every rank's largest errors to ``OUT.json``; the exit code is 1 when any
check failed. On GPUs the process group is NCCL and the tensors are on each rank's device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOLERANCE = {"float32": 2e-5, "float64": 1e-10, "bfloat16": 3e-2}
"""Largest error allowed, relative to the largest magnitude of the reference tensor."""

SCENARIOS = (("uneven", False), ("idle_rank", True))


def _inputs(size: int, *, num_experts: int, top_k: int, hidden: int, seed: int, idle_rank: bool):
    """Every rank's tokens, routing, upstream gradient, and the global expert weights."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per_rank = num_experts // size
    expert_weights = torch.randn(num_experts, hidden, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    ranks = []
    for rank in range(size):
        tokens = 0 if idle_rank and size > 1 and rank == size - 1 else 5 + 3 * rank
        allowed = torch.ones(num_experts, dtype=torch.bool)
        allowed[num_experts - 1] = False  # an expert nobody routes to
        if rank == 0 and size > 1 and not idle_rank:
            allowed[(size - 1) * per_rank:] = False  # the last rank receives nothing from rank 0
        scores = torch.rand(tokens, num_experts, generator=gen, dtype=torch.float64)
        scores[:, ~allowed] = -1.0
        ranks.append({
            "x": torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
            "topk_idx": scores.topk(top_k, dim=-1).indices,
            "topk_weight": torch.softmax(torch.randn(tokens, top_k, generator=gen, dtype=torch.float64), -1),
            "grad": torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
        })
    return ranks, expert_weights


def _dense(x, topk_idx, topk_weight, expert_weights):
    import torch

    copies = torch.einsum("th,tkhd->tkd", x, expert_weights[topk_idx])
    return (topk_weight.unsqueeze(-1) * copies).sum(1)


def _reference(ranks, expert_weights):
    """Dense float64 output of every rank and the gradients of the summed loss."""
    expert_weights = expert_weights.clone().requires_grad_()
    leaves, loss, outs = [], 0.0, []
    for data in ranks:
        x = data["x"].clone().requires_grad_()
        weight = data["topk_weight"].clone().requires_grad_()
        out = _dense(x, data["topk_idx"], weight, expert_weights)
        loss = loss + (out * data["grad"]).sum()
        leaves.append((x, weight))
        outs.append(out.detach())
    loss.backward()
    return outs, [(x.grad, w.grad) for x, w in leaves], expert_weights.grad


def _error(got, want) -> float:
    """Largest difference relative to the reference's largest magnitude (0 for empty tensors,
    infinite for a gradient that never arrived)."""
    if want.numel() == 0:
        return 0.0
    if got is None:
        return float("inf")
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def run_scenario(dispatcher, group, *, num_experts: int, top_k: int, hidden: int, seed: int, idle_rank: bool,
                 dtype, device) -> dict[str, float]:
    """One round trip through ``dispatcher`` on this rank; the largest relative errors."""
    import torch
    import torch.distributed as dist

    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    per_rank = num_experts // size
    ranks, expert_weights = _inputs(size, num_experts=num_experts, top_k=top_k, hidden=hidden, seed=seed,
                                    idle_rank=idle_rank)
    mine = ranks[rank]
    x = mine["x"].to(device, dtype).requires_grad_()
    topk_weight = mine["topk_weight"].to(device, torch.float32).requires_grad_()
    topk_idx = mine["topk_idx"].to(device)
    local_weights = expert_weights[rank * per_rank:(rank + 1) * per_rank].to(device, dtype).requires_grad_()

    x_local, counts, handle = dispatcher.dispatch(x, topk_idx, topk_weight)
    assert counts.dtype == torch.int64 and tuple(counts.shape) == (per_rank,), (counts.dtype, counts.shape)
    sizes = counts.tolist()
    assert sum(sizes) == x_local.shape[0], f"counts sum to {sum(sizes)} but x_local has {x_local.shape[0]} rows"
    chunks = x_local.split(sizes)
    y_local = torch.cat([chunk @ local_weights[e] for e, chunk in enumerate(chunks)])
    out = dispatcher.combine(y_local, handle)
    (out.float() * mine["grad"].to(device, torch.float32)).sum().backward()

    outs, grads, weight_grad = _reference(ranks, expert_weights)
    every_idx = torch.cat([data["topk_idx"].reshape(-1) for data in ranks])
    want_counts = torch.bincount(every_idx, minlength=num_experts)[rank * per_rank:(rank + 1) * per_rank]
    # Grouping: the rows of local expert e are exactly the token copies routed to it (in any order).
    every_x = torch.cat([data["x"] for data in ranks])
    every_token = torch.cat([torch.arange(len(data["x"])) + sum(len(d["x"]) for d in ranks[:r])
                             for r, data in enumerate(ranks)])
    token_of_copy = every_token.repeat_interleave(top_k)
    want_sums = torch.stack([every_x[token_of_copy[every_idx == rank * per_rank + e]].sum(0)
                             for e in range(per_rank)])
    got_sums = torch.stack([chunk.sum(0) for chunk in chunks])
    return {
        "counts": 0.0 if sizes == want_counts.tolist() else float("inf"),
        "out": _error(out, outs[rank]),
        "expert_rows": _error(got_sums, want_sums),
        "grad_x": _error(x.grad, grads[rank][0]),
        "grad_topk_weight": _error(topk_weight.grad, grads[rank][1]),
        "grad_expert_weights": _error(local_weights.grad, weight_grad[rank * per_rank:(rank + 1) * per_rank]),
    }


def check_backend(name: str, group=None, *, num_experts: int = 8, top_k: int = 2, hidden: int = 16,
                  dtype: str = "float32", seed: int = 0, idle_rank: bool = True, config=None,
                  tolerance: float | None = None, make=None) -> dict[str, dict[str, float]]:
    """Run the contract scenarios for the EP backend ``name`` over ``group`` (default: the
    whole world when a process group is initialised, else one local process); ``config`` is
    passed to the backend's ``make`` (a ``trainer.model`` section, or any object with its
    keys); ``make`` replaces the registered backend's own (tests of a backend's code where its
    availability check fails, e.g. against a stand-in library). Returns
    ``{scenario: {quantity: largest relative error}}`` (``counts``: 0, or infinite when the
    per-expert counts differ); raises ``AssertionError`` naming what differs once every
    scenario has run, so that a numerical mismatch on one rank leaves no other rank waiting in
    a collective (a malformed ``counts`` tensor fails at once on its rank)."""
    import torch
    import torch.distributed as dist

    from prime_core.plugins import get_plugin_manager

    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    cuda = group is not None and dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    make = make or get_plugin_manager().select("ep_backends", name).make
    dispatcher = make(group, num_experts=num_experts, config=config)
    results = {}
    for offset, (scenario, idle) in enumerate(SCENARIOS):
        if idle and not idle_rank:
            continue
        results[scenario] = run_scenario(dispatcher, group, num_experts=num_experts, top_k=top_k, hidden=hidden,
                                         seed=seed + offset, idle_rank=idle, dtype=getattr(torch, dtype),
                                         device=device)
    limit = TOLERANCE[dtype] if tolerance is None else tolerance
    bad = [f"{scenario}.{key} = {value:.3g}" for scenario, errors in results.items()
           for key, value in errors.items() if not value <= limit]
    if bad:
        raise AssertionError(f"EP backend '{name}' breaks the contract (relative errors above {limit:g}): "
                             + ", ".join(bad))
    return results


def run_in_processes(name: str, processes: int, out_dir, *, ep: int | None = None, dtype: str = "float32",
                     hidden: int = 16, timeout: float = 300) -> list[dict]:
    """Run the contract for backend ``name`` in ``processes`` processes (``prime_core.testing.ranks``:
    forked, or torchrun where a GPU is visible; gloo on CPUs); returns every rank's results.
    Raises ``AssertionError`` with the output's tail."""
    from prime_core.testing.ranks import launch

    out = Path(out_dir) / f"contract-{name}-{processes}-{ep or processes}-{dtype}.json"
    argv = [name, str(out), "--dtype", dtype, "--hidden", str(hidden), *(["--ep", str(ep)] if ep else [])]
    done = launch(processes, "prime_plugin_ep.contract:main", argv, timeout=timeout)
    if done.returncode or not out.exists():
        raise AssertionError(f"contract run failed ({done.returncode}): {' '.join(map(str, done.args))}\n"
                             + done.stdout[-3000:] + done.stderr[-6000:])
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_plugin_ep.contract")
    parser.add_argument("backend")
    parser.add_argument("out", type=Path)
    parser.add_argument("--ep", type=int, default=None, help="also check EP groups of this many consecutive ranks")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--hidden", type=int, default=16)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from prime_core import distributed

    world = distributed.init()
    groups = {"world": None}
    if args.ep and args.ep < world.size:
        groups[f"ep{args.ep}"], _ = dist.new_subgroups(group_size=args.ep)
    results, failures = {}, []
    for label, group in groups.items():
        try:
            results[label] = check_backend(args.backend, group, dtype=args.dtype, hidden=args.hidden)
        except AssertionError as exc:
            failures.append(f"rank {world.rank}, {label}: {exc}")
    everyone = [(results, failures)]
    if world.distributed:
        everyone = [None] * world.size
        dist.all_gather_object(everyone, (results, failures))
    failed = [f for _, fs in everyone for f in fs]
    if world.main:
        args.out.write_text(json.dumps([r for r, _ in everyone], indent=1))
        print("\n".join(failed) or f"EP backend '{args.backend}' meets the contract on {world.size} process(es)",
              file=sys.stderr if failed else sys.stdout, flush=True)
    distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    from prime_core.distributed import exit_process

    exit_process(main())
