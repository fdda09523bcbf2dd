"""One GPU: the FP8 linear's two-stream backward (``linear._input_grad_beside_weight_grad``,
the weight gradient in bf16) against the orders it could run in, at M = 8,192 on the block
shapes, each fwd + bwd replayed from a CUDA graph, in alternated rounds (a clock change hits
every case), medians:

- ``bf16``: ``F.linear``, the baseline;
- ``fp8``: the linear as it is (dy's rows, then W.T's blocks and the FP8 GEMM on the side
  stream beside dW's; until stop 74 the rows were quantised on the side stream after W.T's
  blocks, and before stop 61 before them);
- ``fp8_one_stream``: everything on the current stream (``OVERLAP`` off);
- ``fp8_weight_cached``: the linear as it is with ``cache_weight=True``, the weight's blocks and
  W.T's stored: what a step's micro-batches after its first take (``weight_cache``).

``--timelines SHAPE ...`` prints each FP8 case's kernels in one replay (stream, start, length,
grid): where the side stream's launches ran, beside or after dW's GEMM.

    python3 benchmarks/fp8_streams_bench.py --out $OUT          # DeepGEMM on PYTHONPATH
    python3 benchmarks/fp8_streams_bench.py --shapes 1.7B:o --timelines 1.7B:o --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import kernels_bench as kb  # noqa: E402


def timeline(replay, out: Path, name: str) -> None:
    """The kernels of one replay of ``replay`` (the last of three profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
    trace = out / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    kernels = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    trace.unlink()
    last = kernels[-(len(kernels) // 3):]
    start = last[0]["ts"]
    print(f"-- {name}: {len(last)} kernels, {last[-1]['ts'] + last[-1]['dur'] - start:.1f} us", flush=True)
    for e in last:
        print(f"  stream {e['args'].get('stream')} at {e['ts'] - start:7.1f} for {e['dur']:6.1f} us, grid "
              f"{e['args'].get('grid')}: {e['name'][:70]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = [f"{model}:{layer}" for model, layers in kb.FP8_SHAPES.items() for layer in layers]
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--timelines", nargs="*", default=[])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/prime-kernels"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    import torch.nn.functional as F

    from prime_plugin_fp8 import weight_cache
    from prime_plugin_fp8.linear import fp8_linear

    weight_cache.CACHE.storing = True  # as in a step after one of several passes
    device = torch.device("cuda")
    kb.warm_up(device)
    table = []
    for spec in args.shapes:
        model, layer = spec.split(":")
        k, n = kb.FP8_SHAPES[model][layer]
        gen = torch.Generator(device=device).manual_seed(k + n)
        x = torch.randn(args.tokens, k, device=device, generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16().requires_grad_()
        dy = torch.randn(args.tokens, n, device=device, generator=gen).bfloat16()

        def fp8(x=x, w=w, dy=dy):
            fp8_linear(x, w, fp8_wgrad=False).backward(dy)

        def fp8_weight_cached(x=x, w=w, dy=dy):
            fp8_linear(x, w, fp8_wgrad=False, cache_weight=True).backward(dy)
        cases = {"bf16": lambda x=x, w=w, dy=dy: F.linear(x, w).backward(dy), "fp8": fp8,
                 "fp8_one_stream": kb.serial(fp8),
                 "fp8_weight_cached": fp8_weight_cached}
        replays = {case: kb.graphed(fn, (x, w)) for case, fn in cases.items()}
        rounds = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, replay in replays.items():
                rounds[case].append(kb.gpu_seconds(replay, args.reps) * 1e6)
        median = {case: sorted(us)[len(us) // 2] for case, us in rounds.items()}
        for case, us in median.items():
            kb.emit(args, {"bench": "fp8_streams", "model": model, "layer": layer, "m": args.tokens, "k": k, "n": n,
                           "case": case, "gpu_us": us, "rounds_us": rounds[case],
                           "x_bf16": median["bf16"] / us, "device": torch.cuda.get_device_name()})
        table.append((spec, median))
        if spec in args.timelines:
            for case in ("fp8", "fp8_one_stream", "fp8_weight_cached"):
                timeline(replays[case], args.out, f"{spec.replace(':', '_')}_{case}")
    print(f"{'shape':12s}" + "".join(f"{case:>24s}" for case in table[0][1]) + "   (median GPU us, x bf16)")
    for spec, median in table:
        print(f"{spec:12s}" + "".join(f"{us:16.1f} {median['bf16'] / us:6.3f}x" for us in median.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
