#!/usr/bin/env python3
"""Causal attention forward + backward on one GPU, per kernel, on the Qwen3-1.7B head shape
(16 query heads, 8 key/value heads, head dim 128, bf16): a whole row of one sample, and a row
packed with several samples (the RL case).

    python3 benchmarks/attention_bench.py --tokens 8192 32768 --samples 1 8 --out $OUT

Kernels: ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient`` (torch's SDPA with one backend
forced; a packed row runs one call per sample, as ``layers.sdpa_attention`` does) and
``torch_varlen`` (torch's bundled flash-attention 2 varlen kernel: one call per row, through
prime's ``attention:torch_flash`` kernel), ``torch_fused`` (``attention:torch_fused``: cuDNN
for one sample, ``torch_flash`` for several) and ``flash_attention_4`` (``attention:flash_attention_4``,
where ``flash-attn-4`` is installed: its first call compiles the kernels, before the timed ones).
TFLOP/s counts causal model flops (half the square), forward + backward = 3.5x forward. Each
kernel's output and gradients are compared with the first kernel's (largest difference, and
``||a - b|| / ||b||``). Results: ``OUT/attention.jsonl``.

    python3 benchmarks/attention_bench.py --new-lengths 8 --tokens 8192 \
        --kernels sdpa_cudnn torch_fused torch_varlen --out $OUT

``--new-lengths N``: what a kernel costs at a sequence length it has not met, as every RL step
brings: a row of one sample at each of N random lengths up to ``--tokens``, forward + backward,
timed at its first call and again at its second (``OUT/new_lengths.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def attention_kernels() -> dict:
    """The kernels compared: SDPA's backends one sample at a time, and the registered ones."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prime_core.trainer.packing import Packing

    def sdpa(backend):
        def run(q, k, v, bounds, scale):
            outs = []
            with sdpa_kernel([backend]):
                for s, e in bounds:
                    qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
                    if backend != SDPBackend.FLASH_ATTENTION:  # the others take grouped heads repeated
                        rep = qs.shape[1] // ks.shape[1]
                        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
                        gqa = False
                    else:
                        gqa = True
                    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
                    outs.append(out[0].transpose(0, 1))
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        return run

    def registered(name):
        def run(q, k, v, bounds, scale):
            from prime_core.plugins import get_plugin_manager

            kernel = get_plugin_manager().select("kernels", f"attention:{name}").impl
            positions = torch.cat([torch.arange(e - s, device=q.device) for s, e in bounds])
            return kernel(q, k, v, Packing.from_position_ids(positions), scale)
        return run

    return {"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "torch_varlen": registered("torch_flash"),
            "torch_fused": registered("torch_fused"), "flash_attention_4": registered("flash_attention_4")}


def new_lengths(args, kernels: dict) -> int:
    """Each kernel at ``args.new_lengths`` random lengths (one sample a row): the first call at a
    length and the second, forward + backward, synchronised around each."""
    import random

    import torch

    def timed(fn, length):
        q = torch.randn(length, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(length, args.kv_heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(q, k, v, [(0, length)], args.head_dim ** -0.5).sum().backward()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    rows = []
    for name, fn in kernels.items():
        timed(fn, 1024)  # the kernel's own first-call costs (imports, a JIT) before the lengths
        lengths = random.Random(name).sample(range(args.tokens[0] // 2, args.tokens[0]), args.new_lengths)
        first = [timed(fn, n) for n in lengths]
        again = [timed(fn, n) for n in lengths]
        row = {"kernel": name, "lengths": lengths, "first_ms": first, "again_ms": again,
               "first_mean_ms": sum(first) / len(first), "again_mean_ms": sum(again) / len(again)}
        rows.append(row)
        with open(args.out / "new_lengths.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"{'kernel':<18}{'new length, ms':>16}{'again, ms':>11}   ({args.new_lengths} lengths of "
          f"{args.tokens[0] // 2}-{args.tokens[0]} tokens, forward + backward)")
    for r in rows:
        print(f"{r['kernel']:<18}{r['first_mean_ms']:>16.1f}{r['again_mean_ms']:>11.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kernels", nargs="+", help="only these (default: all)")
    parser.add_argument("--new-lengths", type=int, help="time each kernel at this many lengths it has not met")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    kernels = attention_kernels()
    if args.kernels:
        kernels = {name: kernels[name] for name in args.kernels}
    if args.new_lengths:
        return new_lengths(args, kernels)
    device = torch.device("cuda")
    results = []
    for tokens in args.tokens:
        for samples in args.samples:
            step = tokens // samples
            bounds = [(i * step, (i + 1) * step) for i in range(samples)]
            flops = 3.5 * 4 * args.heads * args.head_dim * sum((e - s) ** 2 for s, e in bounds) / 2
            torch.manual_seed(0)
            q = torch.randn(tokens, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
            k = torch.randn(tokens, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            grad = torch.randn_like(q)
            scale = args.head_dim ** -0.5
            reference = None
            for name, fn in kernels.items():
                record = {"kernel": name, "tokens": tokens, "samples": samples}
                try:
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    torch.cuda.synchronize()
                    first = time.perf_counter()
                    out = fn(*leaves, bounds, scale)
                    out.backward(grad)
                    torch.cuda.synchronize()
                    record["first_call_s"] = time.perf_counter() - first  # with any JIT compilation
                    got = [out.detach().float()] + [t.grad.float() for t in leaves]
                    if reference is None:
                        reference = got
                    # against the first kernel listed: the output's and each gradient's largest difference
                    # and the worst ||a - b|| / ||b|| of the four
                    pairs = list(zip(got, reference, strict=True))
                    record["max_diff_vs_first"] = max(float((a - b).abs().max()) for a, b in pairs)
                    record["rel_diff_vs_first"] = max(float((a - b).norm() / b.norm()) for a, b in pairs)
                    del got, pairs
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.repeats):
                        for t in leaves:
                            t.grad = None
                        fn(*leaves, bounds, scale).backward(grad)
                    end.record()
                    torch.cuda.synchronize()
                    ms = start.elapsed_time(end) / args.repeats
                    record.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape is a result too
                    record["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(record)
                with open(args.out / "attention.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
    print(f"{'kernel':<18}{'tokens':>8}{'samples':>9}{'ms':>9}{'TFLOP/s':>9}{'max diff':>10}{'rel diff':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['kernel']:<18}{r['tokens']:>8}{r['samples']:>9}  {r['error'][:80]}")
        else:
            print(f"{r['kernel']:<18}{r['tokens']:>8}{r['samples']:>9}{r['ms']:>9.2f}{r['tflops']:>9.0f}"
                  f"{r['max_diff_vs_first']:>10.1e}{r['rel_diff_vs_first']:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
