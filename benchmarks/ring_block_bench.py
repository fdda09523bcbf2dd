#!/usr/bin/env python3
"""Ring attention's block kernel on one GPU: each block of a CP ring (this rank's queries
against one rank's keys, zigzag split, bf16, GQA) forward + backward through the flash block
kernel (``prime_plugin_cp.flash_block``: its plan, the flash calls, the merge and the gradient
sums), beside the same flash calls alone (the fused kernel, nothing around it), the same plan
on cuDNN's attention where a part allows (``cudnn_block``) and the eager reference kernel.
Issue 20's target: the block within 1.2x of the fused kernel alone. The ring's once-per-call
work (the merged output's cast and ``delta``) and the plans are timed apart.

    python3 benchmarks/ring_block_bench.py --tokens 131072 --cp 4 --out $OUT/ring_block.jsonl
    python3 benchmarks/ring_block_bench.py --tiny          # a CPU smoke run (eager kernel only)

Every block of every rank is timed (CUDA events, median of ``--repeat`` after a warm-up); one
JSON line per block plus one summary line (sum over blocks and ratios).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def timed(fn, repeat: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    import torch

    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


@dataclass
class Block:
    """One block of a ring: rank ``rank``'s queries (and upstream gradient) against rank
    ``source``'s keys and values, with their row positions and sample ids."""

    q: Any
    dout: Any
    k: Any
    v: Any
    q_index: Any
    q_seg: Any
    k_index: Any
    k_seg: Any
    scale: float

    def run(self, kernel, final, **extra) -> None:
        """Forward and backward through ``kernel`` (a ``BlockKernel``), as the ring calls it;
        ``final`` (``finish``) stands for the ring's merged output, made once per ring call."""
        out, lse = kernel.forward(self.q, self.k, self.v, self.q_index, self.q_seg, self.k_index, self.k_seg,
                                  self.scale, **extra)
        more = {"out": final[0]} if extra else {}
        kernel.backward(self.dout, self.q, self.k, self.v, lse, final[1], self.q_index, self.q_seg, self.k_index,
                        self.k_seg, self.scale, **extra, **more)

    def finish(self, kernel, **extra):
        """``(out in q's dtype, delta)`` from this block's forward: what the ring computes once
        per call from its merged output (the cast and ``delta``), here for one block."""
        out, _ = kernel.forward(self.q, self.k, self.v, self.q_index, self.q_seg, self.k_index, self.k_seg,
                                self.scale, **extra)
        return finished(out.float(), self.dout, self.q.dtype)

    def alone(self, plan, outputs) -> None:
        """The plan's flash calls only, forward and backward (the fused kernel alone)."""
        from prime_plugin_cp.flash_block import FlashBlocks

        for part, (out, lse) in zip(plan, outputs, strict=True):
            (qa, qb), (ka, kb) = part.q, part.k
            FlashBlocks.forward(self.q[qa:qb], self.k[ka:kb], self.v[ka:kb], part, self.scale)
            FlashBlocks.backward(self.dout[qa:qb], self.q[qa:qb], self.k[ka:kb], self.v[ka:kb], out, lse, part,
                                 self.scale)

    def outputs(self, plan):
        from prime_plugin_cp.flash_block import FlashBlocks

        return [FlashBlocks.forward(self.q[p.q[0]:p.q[1]], self.k[p.k[0]:p.k[1]], self.v[p.k[0]:p.k[1]], p,
                                    self.scale) for p in plan]


def finished(out, dout, dtype):
    """The ring's once-per-call work on its merged float32 output (``ring_backward``'s
    ``delta``, the forward's cast)."""
    final = out.to(dtype)
    return final, (dout.float() * final.float()).sum(-1)


def measure(block: Block, plan, *, flash: bool, eager: bool, repeat: int, cuda: bool) -> dict:
    from prime_plugin_cp.block import EAGER
    from prime_plugin_cp.flash_block import FLASH

    record = {}
    if flash:
        from prime_plugin_cp.cudnn_block import CUDNN, cudnn_unavailable

        record["parts"] = len(plan) if plan is not None else None
        final = block.finish(FLASH, plan=plan)
        record["flash_block_s"] = timed(functools.partial(block.run, FLASH, final, plan=plan), repeat, cuda)
        if plan:
            record["fused_alone_s"] = timed(functools.partial(block.alone, plan, block.outputs(plan)), repeat, cuda)
        if cudnn_unavailable(block.q) is None:  # the same plan, cuDNN's calls where a part allows
            record["cudnn_block_s"] = timed(functools.partial(block.run, CUDNN, final, plan=plan), repeat, cuda)
    if eager:
        record["eager_block_s"] = timed(functools.partial(block.run, EAGER, block.finish(EAGER)), repeat, cuda)
    return record


def summarise(records: list[dict], args) -> dict:
    summary = {"summary": True, "tokens": args.tokens, "cp": args.cp, "samples": args.samples}
    for key in ("flash_block_s", "fused_alone_s", "cudnn_block_s", "eager_block_s"):
        values = [r[key] for r in records if key in r]
        if values:
            summary[key] = sum(values)
    live = [r for r in records if r.get("fused_alone_s")]
    if live:
        summary["block_over_fused"] = sum(r["flash_block_s"] for r in live) / sum(r["fused_alone_s"] for r in live)
        summary["worst_block_over_fused"] = max(r["flash_block_s"] / r["fused_alone_s"] for r in live)
    if "cudnn_block_s" in summary:
        summary["cudnn_over_flash_block"] = summary["cudnn_block_s"] / summary["flash_block_s"]
    if "eager_block_s" in summary and "flash_block_s" in summary:
        summary["eager_over_flash"] = summary["eager_block_s"] / summary["flash_block_s"]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=131072, help="tokens of the whole row")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1, help="samples packed in the row (equal lengths)")
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 8), metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-eager", action="store_true", help="skip the eager kernel (slow at long rows)")
    parser.add_argument("--tiny", action="store_true", help="a small CPU run of the eager kernel")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from prime_core.trainer.packing import Packing, cp_indices
    from prime_plugin_cp.flash_block import prepare, unavailable

    if args.tiny:
        args.tokens, args.cp, args.heads, args.head_dim, args.repeat = 512, 2, (4, 2), 32, 2
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    length = args.tokens
    per = length // args.samples
    positions = torch.cat([torch.arange(per)] * args.samples + [torch.arange(length - per * args.samples)])
    row = Packing.from_position_ids(positions.to(device))
    hq, hkv = args.heads
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(length, hq, args.head_dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(length, hkv, args.head_dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    locals_ = [cp_indices(length, r, args.cp, device=device) for r in range(args.cp)]
    meta = torch.stack([torch.stack([row.index[i], row.segment_ids[i]]) for i in locals_]).to(torch.int64)
    flash = cuda and unavailable(q) is None
    records = []
    prepared, per_call = [], []
    for rank, mine in enumerate(locals_):
        plans = prepare(meta, rank) if flash else [None] * args.cp
        if flash:  # once per ring call (the plans once per step): its share of each block is this over cp
            merged = torch.randn(len(mine), hq, args.head_dim, device=device, generator=gen)
            prepared.append(timed(functools.partial(prepare, meta, rank), args.repeat, cuda))
            per_call.append(timed(functools.partial(finished, merged, dout[mine].contiguous(), dtype), args.repeat,
                                  cuda))
        for source, theirs in enumerate(locals_):
            block = Block(q[mine].contiguous(), dout[mine].contiguous(), k[theirs].contiguous(),
                          v[theirs].contiguous(), meta[rank, 0], meta[rank, 1], meta[source, 0], meta[source, 1],
                          args.head_dim ** -0.5)
            record = {"tokens": length, "cp": args.cp, "samples": args.samples, "rank": rank, "source": source,
                      "device": torch.cuda.get_device_name() if cuda else "cpu",
                      **measure(block, plans[source], flash=flash, eager=not args.no_eager, repeat=args.repeat,
                                cuda=cuda)}
            records.append(record)
            print(json.dumps(record), flush=True)
    summary = summarise(records, args)
    if prepared and "fused_alone_s" in summary:
        summary["prepare_s"], summary["per_call_s"] = sum(prepared), sum(per_call)
        summary["with_prepare_over_fused"] = (summary["flash_block_s"] + sum(prepared)) / summary["fused_alone_s"]
        summary["with_call_over_fused"] = (summary["flash_block_s"] + sum(per_call)) / summary["fused_alone_s"]
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as handle:
            for record in [*records, summary]:
                handle.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
