#!/usr/bin/env python3
"""The MoE shape's expert GEMMs alone on one GPU (64 experts, hidden 2,048, expert width 768,
8,192 tokens x top 8): the weight-gradient GEMMs in either operand order, and the experts'
forward and backward as the custom model runs them, with the kernels it launches.

    python3 benchmarks/grouped_mm_bench.py [--tokens 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def timed(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    import torch
    import torch.nn.functional as F

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    E, H, W = args.experts, args.hidden, args.width  # experts, hidden, expert width (I in the labels)
    rows = args.tokens * args.top_k
    choice = torch.randn(args.tokens, E, device=dev).topk(args.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(choice, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(rows, H, device=dev, dtype=bf)
    h = torch.randn(rows, W, device=dev, dtype=bf)
    dy = torch.randn(rows, H, device=dev, dtype=bf)
    dgu = torch.randn(rows, 2 * W, device=dev, dtype=bf)
    gate_up = torch.randn(E, 2 * W, H, device=dev, dtype=bf) * 0.02
    down = torch.randn(E, H, W, device=dev, dtype=bf) * 0.02
    results = {}

    def flops(m, n, k):
        return 2.0 * m * n * k

    cases = {
        "down wgrad h.T @ dy -> [E, I, H]": (lambda: torch._grouped_mm(h.t(), dy, offs=offs), flops(rows, H, W)),
        "down wgrad dy.T @ h -> [E, H, I]": (lambda: torch._grouped_mm(dy.t(), h, offs=offs), flops(rows, H, W)),
        "gate_up wgrad x.T @ dgu -> [E, H, 2I]": (lambda: torch._grouped_mm(x.t(), dgu, offs=offs),
                                                   flops(rows, H, 2 * W)),
        "gate_up wgrad dgu.T @ x -> [E, 2I, H]": (lambda: torch._grouped_mm(dgu.t(), x, offs=offs),
                                                   flops(rows, H, 2 * W)),
        "gate_up fwd x @ W.T": (lambda: torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs),
                                flops(rows, 2 * W, H)),
        "down fwd h @ W.T": (lambda: torch._grouped_mm(h, down.transpose(1, 2), offs=offs), flops(rows, H, W)),
        "gate_up dgrad dgu @ W": (lambda: torch._grouped_mm(dgu, gate_up, offs=offs), flops(rows, H, 2 * W)),
        "down dgrad dy @ W": (lambda: torch._grouped_mm(dy, down, offs=offs), flops(rows, W, H)),
    }
    for name, (fn, f) in cases.items():
        ms = timed(fn)
        results[name] = {"ms": ms, "tflops": f / ms / 1e9}
        print(f"{name:42s} {ms:7.3f} ms {f / ms / 1e9:7.1f} TFLOP/s", flush=True)

    # The experts' forward and backward as prime_plugin_custom.moe.Experts computes them.
    w1 = gate_up.clone().requires_grad_()
    w2 = down.clone().requires_grad_()
    xin = x.clone().requires_grad_()

    def experts():
        g, u = torch._grouped_mm(xin, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)
        y.backward(dy)

    ms = timed(experts)
    total = 3 * (flops(rows, 2 * W, H) + flops(rows, H, W))
    results["experts fwd+bwd"] = {"ms": ms, "tflops": total / ms / 1e9,
                                  "grad_strides": [list(w1.grad.stride()), list(w2.grad.stride())]}
    print(f"experts fwd+bwd {ms:.3f} ms {total / ms / 1e9:.1f} TFLOP/s; grad strides {w1.grad.stride()} "
          f"{w2.grad.stride()}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        experts()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=90)
    print(table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "grouped_mm.jsonl").open("a") as f:
            f.write(json.dumps({"tokens": args.tokens, "counts_max": int(counts.max()), **results}) + "\n")


if __name__ == "__main__":
    main()
