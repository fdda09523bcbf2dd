#!/usr/bin/env python3
"""Kernel benchmarks on one GPU, each beside its baseline in the same process.

    python3 benchmarks/kernels_bench.py lm_head --tokens 8192 16384 32768 65536 --out $OUT
    python3 benchmarks/kernels_bench.py fp8 --tokens 8192 --out $OUT    # --backends deep_gemm torch: both; --profile
    python3 benchmarks/kernels_bench.py fp8_host --backends deep_gemm torch --reps 200 --out $OUT
    python3 benchmarks/kernels_bench.py quant_rows --tokens 8192 --out $OUT    # --launch 32:1:4: ROWS:BLOCKS:WARPS
    python3 benchmarks/kernels_bench.py adamw --out $OUT                       # --launch 4096:4 1024:8: launch shapes
    python3 benchmarks/kernels_bench.py norm --out $OUT                        # --launch 8192:8 4096:4
    python3 benchmarks/kernels_bench.py moe --tokens 8192 --out $OUT           # --profile
    python3 benchmarks/kernels_bench.py grouped_mm --tokens 8192 --reps 20 --out $OUT   # --autotune; --deep-gemm
    python3 benchmarks/kernels_bench.py table --out $OUT

``lm_head``: forward + backward of the LM head at Qwen3's vocabulary (151,936) and hidden size
2,048 in bf16, from the final hidden states to per-token log-probabilities, upstream gradient
random. ``vanilla`` is what an unfused trainer does (``logits = h @ W.T``, ``.float()``,
``log_softmax``, ``gather``); ``fused_torch`` / ``fused_triton`` are ``lm_head:fused``'s two
implementations (with the entropy too, which vanilla does not compute), ``liger`` its fused
linear cross-entropy (when installed). The upstream gradient is one per token (a summed
log-likelihood, what liger's kernel supports). Peak memory is what the call adds on top of
its inputs.

``fp8``: ``fp8_linear`` (block-scaled FP8, the ``auto`` backend: DeepGEMM where installed, else
torch's scaled matmul) against ``F.linear`` in bf16, forward + backward, on the linear shapes of
a Qwen3-1.7B and a Qwen3-8B block; TFLOP/s = 6·M·K·N / time (2·M·K·N for ``gemm``, the bare
forward matmul on pre-quantised operands). For ``qkv`` and ``gate_up`` also the model's own
split, fwd+bwd: its linears each alone in bf16 (``bf16_separate``, what the bf16 trainer runs)
and in FP8 (``fp8_separate``), and in FP8 as one group (``fp8_group``, ``fp8_linears``: what the
native model runs since stop 39).

``fp8_host``: the host time of each piece of an FP8 linear (the linear, its custom operators,
the quantisers, the GEMM wrappers), issued without waiting for the GPU at a size whose GPU work
is negligible: what bounds a step whose host falls behind its GPU.

``quant``: the FP8 quantiser of a linear's ``x`` and ``dy`` (``quantize_rows_and_columns``) at
each width of the block linears, in GPU time and GB/s, at every ``--launch TILES:STAGES:WARPS``
(default a sweep), each checked bit for bit against the default launch, and the PyTorch
quantisers compiled by Inductor beside them.

``adamw``: one update of one-process mixed precision's master weights (``prime_plugin_fsdp``):
the trainer's unfused path against ``adamw``'s fused kernel, on the 1.7B and the 2.9B MoE
shapes' tensors (``bench_adamw``).

``norm``: the sum of the squares of every bf16 gradient of those shapes, as the fused update
takes it (``norms.GradientNorms``, one ``adamw_kernel.squares`` launch a tensor), at each
``--launch`` shape, against ``torch._foreach_norm`` (what ``clip_grad_norm_`` runs) and one
``torch.linalg.vector_norm`` of all of them in one tensor (a single reduction: near the read
bound). Wall time and GPU time (``gpu_seconds``); GB/s counts each gradient read once in the
GPU time.

``moe``: the 2.9B MoE shape's layer (``SparseMoE``: 64 experts of 768, top 8, hidden 2,048;
bf16) forward + backward, eager and compiled, with the local dispatcher's permutation in
``moe_triton``'s kernels (``triton``) and in PyTorch gathers (``torch``, what Inductor fuses);
also the dispatch and combine alone (no experts between them), with the bytes they must move
(each direction reads and writes the ``T·k`` copies once, and the tokens once).

Results: JSON lines in ``OUT/kernels.jsonl``; ``table`` prints them. ``--tiny`` shrinks every
size so the script runs on a CPU in seconds (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

VOCAB, HIDDEN = 151936, 2048
FP8_SHAPES = {  # (K, N) of each block linear: y[M, N] = x[M, K] @ W[N, K].T
    "1.7B": {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)},
    "8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)},
}
FP8_GROUPS = {  # the linears the model computes as qkv and gate_up (their N, in order)
    "1.7B": {"qkv": (2048, 1024, 1024), "gate_up": (6144, 6144)},
    "8B": {"qkv": (4096, 1024, 1024), "gate_up": (12288, 12288)},
}


def timed(fn, device, reps: int) -> tuple[float, float, float]:
    """(seconds per call, peak bytes the call adds above what was allocated before it, seconds a
    call takes to issue with the GPU not waited for). A call whose host time exceeds its GPU time
    leaves the GPU idle (seen for the FP8 linear, stop 38)."""
    import torch

    fn()  # warm-up: compilation, autotuning, allocator
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) / reps
    sync()
    seconds = (time.perf_counter() - start) / reps
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return seconds, peak, host


def gpu_seconds(fn, reps: int) -> float:
    """Seconds of GPU time per call of ``fn`` (CUDA): the calls are queued behind a spin kernel
    long enough to cover their launches, so time the host spends issuing them is not counted."""
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    issue = time.perf_counter() - start  # an upper bound of one call's host time
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9 * issue * (reps + 1)))  # cycles: about 2 GHz
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def lm_head_impls():
    import torch

    from prime_plugin_fused_lm_head import torch_impl, triton_impl

    def vanilla(h, w, t):
        logits = (h @ w.T).float()
        return torch.log_softmax(logits, dim=-1).gather(1, t[:, None])[:, 0]

    impls = {
        "vanilla": vanilla,
        "fused_torch": lambda h, w, t: torch_impl.fused_logprobs(h, w, t, token_chunk="auto")[0],
        "fused_triton": lambda h, w, t: triton_impl.fused_logprobs(h, w, t, token_chunk="auto")[0],
    }
    try:
        import liger_kernel  # noqa: F401

        from prime_plugin_liger.lm_head import liger_logprobs

        impls["liger"] = lambda h, w, t: liger_logprobs(h, w, t, token_chunk="auto", with_entropy=False)[0]
    except ImportError:
        pass
    if triton_impl.unavailable_reason():
        del impls["fused_triton"]
    return impls


def bench_lm_head(args, device) -> list[dict]:
    vocab, hidden = (1000, 64) if args.tiny else (VOCAB, HIDDEN)
    impls = lm_head_impls()
    return [record for n in args.tokens for record in lm_head_at(args, device, n, vocab, hidden, impls)]


def lm_head_at(args, device, n: int, vocab: int, hidden: int, impls: dict) -> list[dict]:
    import torch

    gen = torch.Generator(device=device).manual_seed(n)
    h = torch.randn(n, hidden, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (n,), device=device, generator=gen)
    # The gradient of a summed log-likelihood (SFT's): the one upstream liger's kernel supports.
    upstream = torch.ones(n, device=device)
    reference, rows = None, []
    for name, impl in impls.items():
        record = {"bench": "lm_head", "impl": name, "tokens": n, "vocab": vocab, "hidden": hidden}

        def step(impl=impl):
            h.grad = w.grad = None
            logp = impl(h, w, t)
            (logp * upstream).sum().backward()
            return logp

        try:
            seconds, peak, _ = timed(step, device, args.reps)
            logp = step().detach().float()
            if reference is None:
                reference = logp
            record.update(ms=1e3 * seconds, peak_gib=peak / 2**30, tokens_per_s=n / seconds,
                          max_diff_vs_first=(logp - reference).abs().max().item())
        except torch.OutOfMemoryError:
            record["oom"] = True
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(record)
        emit(args, record)
    return rows


def warm_up(device, seconds: float = 1.0) -> None:
    """Matrix products for ``seconds`` before the first measurement: an idle GPU's clocks ramp
    up under load (a first bf16 row measured 70 TFLOP/s where the same shape later ran 660)."""
    import torch

    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def bench_fp8(args, device) -> list[dict]:
    from prime_plugin_fp8 import gemm as fp8_gemm

    backends = [fp8_gemm.resolve(name, device) for name in args.backends]
    warm_up(device)
    rows = []
    for m in args.tokens:
        for model, shapes in FP8_SHAPES.items():
            for layer, (k, n) in shapes.items():
                if args.layers and f"{model}:{layer}" not in args.layers:
                    continue
                if args.tiny:
                    k, n = k // 16, n // 16
                for backend in dict.fromkeys(backends):
                    rows += fp8_at(args, device, backend, model, layer, m, k, n)
    return rows


def fp8_at(args, device, backend: str, model: str, layer: str, m: int, k: int, n: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from prime_plugin_fp8 import gemm as fp8_gemm
    from prime_plugin_fp8.linear import fp8_linear, fp8_linears
    from prime_plugin_fp8.quant import quantize_blocks, quantize_rows, quantize_rows_and_columns

    gen = torch.Generator(device=device).manual_seed(k + n)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device=device, generator=gen).bfloat16()
    xq, wq = quantize_rows(x.detach()), quantize_blocks(w.detach())
    def with_torch_quantisers():
        # The linear as it was before the fused Triton quantisers: the PyTorch ones, same bits.
        from prime_plugin_fp8 import linear, quant

        fused = linear.quantize_rows, linear.quantize_blocks, linear.quantize_rows_and_columns
        linear.quantize_rows, linear.quantize_blocks = quant.quantize_rows_torch, quant.quantize_blocks_torch
        linear.quantize_rows_and_columns = lambda t: (quant.quantize_rows_torch(t), quant.quantize_rows_torch(t.t()))
        try:
            fp8_linear(x, w, backend=backend).backward(dy)
        finally:
            linear.quantize_rows, linear.quantize_blocks, linear.quantize_rows_and_columns = fused

    # Where the model has several linears of one input here (q, k, v; gate, up): each alone, as
    # the trainer ran them before FP8 groups (and as bf16 still does).
    parts = [part // 16 if args.tiny else part for part in FP8_GROUPS.get(model, {}).get(layer, ())]

    def separately(linear_fn):
        def run():
            outs = [linear_fn(x, part) for part in w.split(parts)]
            torch.autograd.backward(outs, list(dy.split(parts, dim=1)))
        return run

    cases = {
        "bf16": (lambda: F.linear(x, w).backward(dy), 6),
        "fp8": (lambda: fp8_linear(x, w, backend=backend).backward(dy), 6),
        "fp8_torch_quant": (with_torch_quantisers, 6),
        "fp8_bf16_wgrad": (lambda: fp8_linear(x, w, backend=backend, fp8_wgrad=False).backward(dy), 6),
        "bf16_gemm": (lambda: x.detach() @ w.detach().T, 2),
        "fp8_gemm": (lambda: fp8_gemm.gemm(xq, wq, b_block=128, out_dtype=torch.bfloat16, backend=backend), 2),
    }
    if device.type == "cuda":  # as a compiled step runs them: Inductor launches the quantisers
        cases["bf16_compiled"] = (compiled_backward(lambda: F.linear(x, w), dy), 6)
        cases["fp8_compiled"] = (compiled_backward(lambda: fp8_linear(x, w, backend=backend), dy), 6)
        # The GPU's time alone (no host time at all): what removing the host work could reach.
        try:
            cases["bf16_graphed"] = (graphed(lambda: F.linear(x, w).backward(dy), (x, w)), 6)
            cases["fp8_graphed"] = (graphed(lambda: fp8_linear(x, w, backend=backend).backward(dy), (x, w)), 6)
            # The weight gradient in bf16 (`fp8_wgrad=False`): no 1x128-by-1x128 GEMM, rows-only quantisers.
            cases["fp8_bf16_wgrad_graphed"] = (graphed(
                lambda: fp8_linear(x, w, backend=backend, fp8_wgrad=False).backward(dy), (x, w)), 6)
            # The same on one stream: dx's chain after dW's GEMM, not beside it.
            cases["fp8_bf16_wgrad_serial_graphed"] = (graphed(
                serial(lambda: fp8_linear(x, w, backend=backend, fp8_wgrad=False).backward(dy)), (x, w)), 6)
        except RuntimeError as exc:
            print(f"no CUDA graph of {model} {layer} ({backend}): {exc}", flush=True)
    if parts:
        cases["bf16_separate"] = (separately(F.linear), 6)
        cases["fp8_separate"] = (separately(lambda x, part: fp8_linear(x, part, backend=backend)), 6)

        def as_group():
            outs = fp8_linears(x, w.split(parts), backend=backend)
            torch.autograd.backward(outs, list(dy.split(parts, dim=1)))
        if all(part % 128 == 0 for part in parts):  # (--tiny's q/k/v are not)
            cases["fp8_group"] = (as_group, 6)
            if device.type == "cuda":
                cases["fp8_group_compiled"] = (compiled_backward(
                    lambda: torch.cat(fp8_linears(x, w.split(parts), backend=backend), dim=1), dy), 6)
    rows = []
    for case, (fn, flops_per_mkn) in cases.items():
        x.grad = w.grad = None
        seconds, _, host = timed(fn, device, args.reps)
        record = {"bench": "fp8", "case": case, "backend": backend, "model": model, "layer": layer,
                  "m": m, "k": k, "n": n, "ms": 1e3 * seconds, "tflops": flops_per_mkn * m * k * n / seconds / 1e12,
                  "host_ms": 1e3 * host}
        rows.append(record)
        emit(args, record)
        if args.profile and case in ("fp8", "fp8_compiled", "fp8_bf16_wgrad"):
            profile_calls(fn, device, f"fp8_linear {backend}, {model} {layer}, {m}x{k}x{n}")
    # The fused quantiser alone: x read once (bf16), its two FP8 copies and their scales written.
    seconds, _, _ = timed(lambda: quantize_rows_and_columns(x.detach()), device, args.reps)
    record = {"bench": "fp8_quant", "backend": backend, "model": model, "layer": layer, "m": m, "k": k,
              "ms": 1e3 * seconds, "gbps": (2 * m * k + 2 * m * k + 2 * 4 * m * k / 128) / seconds / 1e9}
    rows.append(record)
    emit(args, record)
    return rows


def bench_quant(args, device) -> list[dict]:
    """``quantize_rows_and_columns`` (each block linear's ``x`` and ``dy``) at every launch of
    ``--launch TILES:STAGES:WARPS`` (default a sweep), in GPU time, each checked bit for bit
    against the default launch; beside it the PyTorch quantisers compiled by Inductor."""
    import torch

    from prime_plugin_fp8 import quant, triton_quant

    launches = [tuple(map(int, spec.split(":"))) for spec in args.launch] or [
        (tiles, stages, warps) for tiles in (1, 2, 4) for stages in (1, 2, 3) for warps in (4, 8, 16)
        if not (tiles == 1 and stages > 1)]
    widths = sorted({k for shapes in FP8_SHAPES.values() for k, n in shapes.values()}
                    | {n for shapes in FP8_SHAPES.values() for k, n in shapes.values()})
    compiled = torch.compile(lambda t: (quant.quantize_rows_torch(t), quant.quantize_rows_torch(t.t())), dynamic=False)
    warm_up(device)
    rows = []
    for m in args.tokens:
        for k in widths:
            x = torch.randn(m, k // 16 if args.tiny else k, device=device).bfloat16()
            moved = 2 * x.numel() + 2 * x.numel() + 2 * 4 * x.numel() / 128  # bf16 in, two FP8 copies and scales out
            want = triton_quant._rows_and_columns(x, triton_quant._direct)
            cases = {f"{t}:{st}:{w}": (lambda x=x, t=t, st=st, w=w: triton_quant._rows_and_columns(
                x, triton_quant._direct, tiles=t, stages=st, warps=w)) for t, st, w in launches}
            cases["inductor"] = lambda x=x: [part for pair in compiled(x) for part in pair]
            for case, fn in cases.items():
                try:
                    got = fn()
                    same = same_bits(got, want)
                    seconds = gpu_seconds(fn, max(args.reps, 20))
                except Exception as exc:  # a launch Triton cannot compile (shared memory): say so, go on
                    print(f"quant {m}x{k} {case}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                record = {"bench": "quant", "case": case, "m": m, "k": x.shape[1], "gpu_us": seconds * 1e6,
                          "gbps": moved / seconds / 1e9, "same_bits": same}
                rows.append(record)
                emit(args, record)
    return rows


def same_bits(got, want) -> bool:
    """Whether two quantisers' outputs (FP8 values and float32 scales) are the same bits."""
    import torch

    from prime_plugin_fp8 import quant

    bits = lambda t: t.view(torch.uint8) if t.dtype == quant.FP8 else t  # noqa: E731
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))


def bench_quant_rows(args, device) -> list[dict]:
    """``quantize_rows`` (an activation's or a gradient's 1 x 128 blocks, what a linear with the
    weight gradient in bf16 quantises) at every launch of ``--launch ROWS:BLOCKS:WARPS`` (default
    a sweep), and ``quantize_blocks`` of each weight and of its transpose (the input gradient's
    ``W.T``) at 4 and 8 warps; GPU time, each checked bit for bit against the default launch.
    Beside them a bf16 copy of the same tensor: the rate the memory allows."""
    import torch

    from prime_plugin_fp8 import triton_quant

    launches = [tuple(map(int, spec.split(":"))) for spec in args.launch] or [
        (rows, blocks, warps) for rows in (16, 32, 64) for blocks in (1, 2, 4) for warps in (2, 4, 8)
        if rows * blocks <= 128]
    shapes = {shape for model in FP8_SHAPES.values() for shape in model.values()}
    widths = sorted({k for k, n in shapes} | {n for k, n in shapes})

    def record(**fields):
        rows.append(fields)
        emit(args, fields)

    warm_up(device)
    rows = []
    for m in args.tokens:
        for k in widths:
            x = torch.randn(m, k // 16 if args.tiny else k, device=device).bfloat16()
            moved = 2 * x.numel() + x.numel() + 4 * x.numel() / 128  # bf16 in, FP8 and scales out
            seconds = gpu_seconds(lambda x=x: x.clone(), max(args.reps, 20))
            record(bench="quant_rows", case="bf16 copy", m=m, k=x.shape[1], gpu_us=seconds * 1e6,
                   gbps=4 * x.numel() / seconds / 1e9, same_bits=True)
            want = triton_quant._rows(x, triton_quant._direct)
            for r, b, w in launches:
                def fn(x=x, r=r, b=b, w=w):
                    return triton_quant._rows(x, triton_quant._direct, rows=r, blocks=b, warps=w)
                try:
                    ok = same_bits(fn(), want)
                    seconds = gpu_seconds(fn, max(args.reps, 20))
                except Exception as exc:  # a launch Triton cannot compile: say so, go on
                    print(f"quant_rows {m}x{k} {r}:{b}:{w}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                record(bench="quant_rows", case=f"{r}:{b}:{w}", m=m, k=x.shape[1], gpu_us=seconds * 1e6,
                       gbps=moved / seconds / 1e9, same_bits=ok)
    for k, n in sorted(shapes):
        w = torch.randn(n // 16 if args.tiny else n, k // 16 if args.tiny else k, device=device).bfloat16()
        moved = 3 * w.numel()
        # W.T: read along W's rows and stored transposed (the default), or read across them.
        for name, t, store in (("W", w, None), ("W.T", w.t(), None), ("W.T read across", w.t(), False)):
            want = triton_quant._blocks(t, triton_quant._direct)
            for warps in (4, 8):
                def fn(t=t, warps=warps, store=store):
                    return triton_quant._blocks(t, triton_quant._direct, warps=warps, transposed_store=store)
                ok = same_bits(fn(), want)
                seconds = gpu_seconds(fn, max(args.reps, 20))
                record(bench="quant_blocks", case=f"{name} {warps} warps", m=w.shape[0], k=w.shape[1],
                       gpu_us=seconds * 1e6, gbps=moved / seconds / 1e9, same_bits=ok)
    return rows


def serial(fn):
    """``fn`` with the FP8 linear's input and weight gradients on one stream (``OVERLAP`` off)."""
    from prime_plugin_fp8 import linear

    def run():
        before, linear.OVERLAP = linear.OVERLAP, False
        try:
            return fn()
        finally:
            linear.OVERLAP = before
    return run


def compiled_backward(forward, dy, dynamic: bool = False):
    """``forward`` compiled (Inductor, static shapes unless ``dynamic``; AOTAutograd compiles its
    backward), then its backward from ``dy``: one call."""
    import torch

    dynamo = torch._dynamo.config
    # One lambda per case and shape: the same code object recompiles for every shape.
    dynamo.recompile_limit = dynamo.accumulated_recompile_limit = 1024
    compiled = torch.compile(forward, dynamic=dynamic)
    return lambda: compiled().backward(dy)


def graphed(fn, params):
    """``fn`` (a forward and backward of ``params``) captured once in a CUDA graph; the call
    replays it. The gradients are made in the capture, so that they live in the graph's own
    memory pool: a gradient from before would be freed (and unmapped by ``empty_cache``) while
    the replays still write into it."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture needs
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_fp8_host(args, device) -> list[dict]:
    """Host time of each piece of an FP8 linear, at a size where the GPU's work is small
    (M = ``--host-m``, 256 unless told; K = N = 2048): what a call costs to issue, the limit on a
    host-bound step; on a GPU each beside its GPU time."""
    from prime_plugin_fp8 import gemm as fp8_gemm

    rows = []
    for backend in dict.fromkeys(fp8_gemm.resolve(name, device) for name in args.backends):
        rows += fp8_host_of(args, device, backend)
    return rows


def kept(fn):
    """``fn`` as a step's later passes run it: the FP8 weight cache storing what a miss quantises
    (the first call stores, the rest hit)."""
    from prime_plugin_fp8 import weight_cache

    def call():
        weight_cache.CACHE.storing = True
        try:
            return fn()
        finally:
            weight_cache.CACHE.storing = False

    return call


def fp8_host_of(args, device, backend: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from prime_plugin_fp8 import gemm as fp8_gemm
    from prime_plugin_fp8 import linear, weight_cache
    from prime_plugin_fp8.quant import quantize_blocks, quantize_rows, quantize_rows_and_columns

    m, k, n = (16, 128, 128) if args.tiny else (args.host_m, 2048, 2048)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device=device, generator=gen).bfloat16()
    xd, wd = x.detach(), w.detach()
    xq, wq, gq = quantize_rows(xd), quantize_blocks(wd), quantize_rows(dy.t())
    _, xt = quantize_rows_and_columns(xd)
    y = linear.fp8_linear(x, w, backend=backend)
    cases = {
        "bf16 linear fwd+bwd": lambda: F.linear(x, w).backward(dy),
        "fp8 linear fwd+bwd": lambda: linear.fp8_linear(x, w, backend=backend).backward(dy),
        "bf16 linear fwd+bwd, compiled": compiled_backward(lambda: F.linear(x, w), dy),
        "fp8 linear fwd+bwd, compiled": compiled_backward(lambda: linear.fp8_linear(x, w, backend=backend), dy),
        "fp8 linear fwd": lambda: linear.fp8_linear(x, w, backend=backend),
        "fp8 linear bwd (graph kept)": lambda: y.backward(dy, retain_graph=True),
        "quantize_rows_and_columns": lambda: quantize_rows_and_columns(xd),
        "quantize_rows": lambda: quantize_rows(xd),
        "quantize_blocks": lambda: quantize_blocks(wd),
        "gemm (forward, 128x128 B)": lambda: fp8_gemm.gemm(xq, wq, b_block=128, out_dtype=torch.bfloat16,
                                                           backend=backend),
        "gemm (weight grad, 1x128 B)": lambda: fp8_gemm.gemm(gq, xt, b_block=1, out_dtype=torch.float32,
                                                             backend=backend),
        "op gemm (forward)": lambda: linear._gemm_op(*xq, *wq, 128, torch.bfloat16, backend),
        # The trainer's defaults: the weight gradient in bf16, the forward's blocks kept by a
        # step's first pass for its later ones (``weight_cache``; stored here from the warm-up call).
        "fp8 linear fwd+bwd, defaults (bf16 dW, blocks kept)": kept(
            lambda: linear.fp8_linear(x, w, backend=backend, fp8_wgrad=False, cache_weight=True).backward(dy)),
        "op gemm_cached_weight (blocks kept)": kept(
            lambda: linear._gemm_cached_op(*xq, [wd], torch.bfloat16, backend, False)),
    }
    # The same under torch.compile with a symbolic row count, as RL rows compile (``dynamic``).
    cases["bf16 linear fwd+bwd, compiled dynamic"] = compiled_backward(lambda: F.linear(x, w), dy, dynamic=True)
    cases["fp8 linear fwd+bwd, defaults, compiled dynamic"] = kept(compiled_backward(
        lambda: linear.fp8_linear(x, w, backend=backend, fp8_wgrad=False, cache_weight=True), dy, dynamic=True))
    cases["fp8 linear fwd+bwd, defaults, compiled dynamic, one stream"] = kept(serial(compiled_backward(
        lambda: linear.fp8_linear(x, w, backend=backend, fp8_wgrad=False, cache_weight=True), dy, dynamic=True)))
    # The pieces a backward issues, one by one.
    w2 = torch.cat([wd, wd])
    cases["torch.cat of two weights"] = lambda: torch.cat([wd, wd])
    cases["quantize_blocks of W.T"] = lambda: quantize_blocks(wd.t())
    cases["quantize_blocks of cat(W, W).T"] = lambda: quantize_blocks(w2.t())
    cases["bf16 dW matmul (g.T @ x)"] = lambda: dy.t() @ xd
    cases["weight cache lookup (hit)"] = kept(lambda: weight_cache.CACHE.blocks([wd], linear._forward_blocks))
    cases["empty [M, N] bf16"] = lambda: torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if device.type == "cuda":  # the defaults' backward: two streams
        dyq = quantize_rows(dy)
        cases["op input_grad_beside_weight_grad"] = lambda: linear._grads_op(
            *dyq, dy, xd, [wd], backend, torch.bfloat16, torch.bfloat16, False)
        cases["op input_grad_beside_weight_grad (W.T's blocks kept)"] = kept(lambda: linear._grads_op(
            *dyq, dy, xd, [wd], backend, torch.bfloat16, torch.bfloat16, True))
        cases["input_grad_beside_weight_grad, called"] = lambda: linear._input_grad_beside_weight_grad(
            dyq, dy, xd, [wd], backend, torch.bfloat16, torch.bfloat16)
        cases["streams alone (wait, enter, wait, record)"] = lambda: streams_alone(dy)
        if backend == "deep_gemm":
            import deep_gemm

            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            cases["deep_gemm.fp8_gemm_nt alone (1D2D)"] = lambda: deep_gemm.fp8_gemm_nt(
                xq, wq, out, recipe=(1, 128, 128), disable_ue8m0_cast=True)
    rows = []
    for case, fn in cases.items():
        x.grad = w.grad = None
        _, _, host = timed(fn, device, args.reps)
        record = {"bench": "fp8_host", "backend": backend, "case": case, "m": m, "k": k, "n": n,
                  "host_us": 1e6 * host}
        if device.type == "cuda":  # beside it: a call whose host time exceeds this leaves the GPU idle
            record["gpu_us"] = 1e6 * gpu_seconds(fn, args.reps)
        weight_cache.CACHE.clear()
        rows.append(record)
        emit(args, record)
    return rows


def streams_alone(g):
    """What ``_input_grad_beside_weight_grad`` does to streams, without its kernels."""
    import torch

    from prime_plugin_fp8 import linear

    main = torch.cuda.current_stream(g.device)
    side = linear._side_stream(g.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        pass
    main.wait_stream(side)
    g.record_stream(main)


def profile_calls(fn, device, title: str, calls: int = 5) -> None:
    """Print the operators and kernels of ``calls`` calls, host and GPU, per call. The profiler
    records every thread, the autograd engine's included (where a CUDA backward runs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(f"== {title}: {calls} calls", flush=True)
    for key in ("self_cpu_time_total", "self_device_time_total")[: len(activities)]:
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=80), flush=True)


def adamw_shapes(model: str, tiny: bool) -> list[tuple]:
    """The trainable tensors of a Qwen3 shape: the 1.7B (tied embeddings) or the 2.9B MoE of
    ``parallel_bench.py moe`` (8 layers, 64 stacked experts of 768)."""
    if tiny:
        return [(1000, 64), (64,), (256, 64), (64, 256)] * 3
    hidden, vocab = 2048, 151936
    moe = model == "moe"
    heads, kv, layers = (32, 4, 8) if moe else (16, 8, 28)
    block = [(heads * 128, hidden), (kv * 128, hidden), (kv * 128, hidden), (hidden, heads * 128), (128,), (128,),
             (hidden,), (hidden,)]
    block += [(64, hidden), (64, 2 * 768, hidden), (64, hidden, 768)] if moe else \
        [(6144, hidden), (6144, hidden), (hidden, 6144)]
    return [(vocab, hidden), (hidden,)] + block * layers


def bench_adamw(args, device) -> list[dict]:
    """One update of the weights in one process (``one_process``), bf16 gradients of one
    micro-batch, clipped to 1.0. Master weights: ``unfused`` is the trainer's path (the
    gradients cast to float32, the norm, the clip, fused ``torch.optim.AdamW``, the next step's
    compute copies cast from the masters), ``fused`` is ``prime_plugin_fsdp.adamw``; bytes moved
    per parameter: 52 and 30. bf16 weights without a master (``PlainWeights``): ``bf16 unfused``
    is the norm, the clip and fused ``torch.optim.AdamW``, ``bf16 fused`` the kernel in place;
    20 and 16 bytes. ``--launch`` sweeps the fused kernel's BLOCK:WARPS (``BLOCK_16`` for bf16)."""
    import torch

    from prime_core.trainer.optim import clip_grad_norm
    from prime_plugin_fsdp import adamw
    from prime_plugin_fsdp.one_process import MasterWeights, PlainWeights

    defaults = {"fused": (adamw.BLOCK, adamw.WARPS), "bf16 fused": (adamw.BLOCK_16, adamw.WARPS)}
    bytes_per = {"unfused": 52, "fused": 30, "bf16 unfused": 20, "bf16 fused": 16}
    records = []
    for model in args.models:
        shapes = adamw_shapes(model, args.tiny)
        for path in bytes_per:
            bf16 = path.startswith("bf16")
            module = torch.nn.ParameterList([torch.nn.Parameter(
                (torch.randn(s, device=device) * 0.02).to(torch.bfloat16 if bf16 else torch.float32)) for s in shapes])
            weights = PlainWeights(module) if bf16 else MasterWeights(module, torch.bfloat16)
            optimizer = torch.optim.AdamW(list(module.parameters()), lr=1e-5, weight_decay=0.01,
                                          fused=device.type == "cuda")
            grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]

            def update(path=path, weights=weights, optimizer=optimizer, grads=grads, bf16=bf16):
                if bf16:
                    for param, grad in zip(weights.masters, grads, strict=True):
                        param.grad = grad
                else:
                    weights.pending = list(grads)
                    weights.compute()
                    weights.before_step()
                if path.endswith(" fused") or path == "fused":
                    assert weights.update(None, optimizer, 1.0) is not None, "the fused update did not run"
                    return
                if not bf16:
                    weights.take_gradients()
                clip_grad_norm(weights.masters, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            default = defaults.get(path)
            launches = [tuple(int(x) for x in text.split(":")) for text in args.launch] or [default]
            for launch in launches if default else [None]:  # the fused kernel once per launch shape
                if launch:
                    setattr(adamw, "BLOCK_16" if bf16 else "BLOCK", launch[0])
                    adamw.WARPS = launch[1]
                seconds, peak, _ = timed(update, device, args.reps)
                numel = sum(p.numel() for p in weights.masters)
                records.append({"bench": "adamw", "model": model, "path": path, "params": numel,
                                "ms": seconds * 1e3, "gbps": numel * bytes_per[path] / seconds / 1e9,
                                "peak_gib": peak / 2**30,
                                **({"block": launch[0], "warps": launch[1]} if launch else {})})
                emit(args, records[-1])
            if default:
                setattr(adamw, "BLOCK_16" if bf16 else "BLOCK", default[0])
                adamw.WARPS = default[1]
            del module, weights, optimizer, grads, update
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def bench_norm(args, device) -> list[dict]:
    import torch

    from prime_plugin_fsdp import adamw
    from prime_plugin_fsdp.norms import GradientNorms

    default = (adamw.NORM_BLOCK, adamw.NORM_WARPS)
    launches = [tuple(int(x) for x in text.split(":")) for text in args.launch] or [default]
    records = []
    for model in args.models:
        grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in adamw_shapes(model, args.tiny)]
        numel = sum(g.numel() for g in grads)
        for launch in launches:
            adamw.NORM_BLOCK, adamw.NORM_WARPS = launch
            norms = GradientNorms(grads)  # its slots are sized by NORM_BLOCK
            records.append(norm_record(args, device, model, "squares", lambda n=norms, g=grads: n.squared(g), numel,
                                       launch=list(launch)))
        adamw.NORM_BLOCK, adamw.NORM_WARPS = default
        flat = torch.cat([g.reshape(-1) for g in grads])
        records.append(norm_record(args, device, model, "foreach_norm", lambda g=grads: torch._foreach_norm(g), numel))
        records.append(norm_record(args, device, model, "one vector_norm", lambda f=flat: torch.linalg.vector_norm(f),
                                   numel))
        del grads, flat, norms
    return records


def norm_record(args, device, model: str, path: str, fn, numel: int, **extra) -> dict:
    """``ms``: a call's wall time (the host's launches included); ``gpu_ms``: its GPU time alone."""
    seconds, _, _ = timed(fn, device, args.reps)
    gpu = gpu_seconds(fn, args.reps) if device.type == "cuda" else seconds
    record = {"bench": "norm", "model": model, "path": path, **extra, "params": numel, "ms": seconds * 1e3,
              "gpu_ms": gpu * 1e3, "gbps": numel * 2 / gpu / 1e9}
    emit(args, record)
    return record


def bench_moe(args, device) -> list[dict]:
    """``SparseMoE`` forward + backward with each permutation path, eager and compiled, and the
    permutation alone (``dispatch`` then ``combine`` of the copies, fwd+bwd)."""
    import torch

    from prime_plugin_custom import moe as moe_module
    from prime_plugin_custom import moe_triton
    from prime_plugin_custom.moe import SparseMoE

    default = (moe_triton.TILE, moe_triton.SPAN, moe_triton.WARPS)

    hidden, inter, experts, k = (64, 32, 8, 2) if args.tiny else (2048, 768, 64, 8)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = SparseMoE(hidden=hidden, intermediate=inter, num_experts=experts, top_k=k, norm_topk_prob=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    layer = layer.to(device=device, dtype=dtype)
    records = []
    for tokens in args.tokens:
        tokens = min(tokens, 256) if args.tiny else tokens
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
        with torch.no_grad():
            idx, weight = layer.route(x)
        weight.requires_grad_()  # the permutation alone: the router weight is a leaf

        def whole(x=x, dy=dy):
            layer(x).backward(dy)

        def permutation(x=x, dy=dy, idx=idx, weight=weight):
            x_local, _, handle = layer.dispatcher.dispatch(x, idx, weight)
            layer.dispatcher.combine(x_local, handle).backward(dy)

        element = torch.finfo(dtype).bits // 8
        moved = 4 * (tokens * k + tokens) * hidden * element  # two passes each way, each T·k rows and T rows
        launches = [tuple(int(v) for v in text.split(":")) for text in args.launch] or [default]
        runs = [("torch", default)] + [("triton", launch) for launch in launches]
        for path, (moe_triton.TILE, moe_triton.SPAN, moe_triton.WARPS) in runs:
            moe_module.TRITON = path == "triton"
            for case, fn in (("layer", whole), ("permutation", permutation)):
                for compiled in (False, True):
                    torch._dynamo.reset()
                    call = torch.compile(fn, dynamic=False) if compiled else fn
                    seconds, peak, host = timed(call, device, args.reps)
                    record = {"bench": "moe", "path": path, "case": case, "compiled": compiled, "tokens": tokens,
                              "hidden": hidden, "experts": experts, "k": k, "ms": seconds * 1e3,
                              "host_ms": host * 1e3, "peak_gib": peak / 2**30}
                    if path == "triton":
                        record["launch"] = f"{moe_triton.TILE}:{moe_triton.SPAN}:{moe_triton.WARPS}"
                    if case == "permutation":
                        record["gbps"] = moved / seconds / 1e9
                    records.append(record)
                    emit(args, record)
                    if args.profile and compiled and case == "layer":
                        profile_calls(call, device, f"MoE layer, {path} permutation, compiled, {tokens} tokens")
    moe_module.TRITON = True
    moe_triton.TILE, moe_triton.SPAN, moe_triton.WARPS = default
    return records


def bench_grouped_mm(args, device) -> list[dict]:
    """The MoE layer's expert GEMMs alone (``torch._grouped_mm``, bf16, on a GPU): forward, input
    gradient and weight gradient of gate_up and down, the weight gradients in both operand orders
    (into ``[E, N, K]`` or ``[E, K, N]``), on a balanced random routing of ``tokens x top 8``."""
    import torch

    if device.type != "cuda":
        raise SystemExit("grouped_mm: torch._grouped_mm runs on a CUDA GPU only")
    warm_up(device)
    experts, hidden, width, k = 64, 2048, 768, 8  # the 2.9B MoE shape (width: moe_intermediate_size)
    records = []
    for tokens in args.tokens:
        torch.manual_seed(0)
        rows = tokens * k
        choice = torch.randn(tokens, experts, device=device).topk(k, dim=-1).indices.reshape(-1)
        offs = torch.bincount(choice, minlength=experts).cumsum(0).to(torch.int32)

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=torch.bfloat16)

        x, h, dy, dgu = rand(rows, hidden), rand(rows, width), rand(rows, hidden), rand(rows, 2 * width)
        gate_up, down = rand(experts, 2 * width, hidden), rand(experts, hidden, width)
        gate_up_flops, down_flops = 2.0 * rows * hidden * 2 * width, 2.0 * rows * hidden * width
        cases = {
            "down wgrad h.T @ dy -> [E, I, H]": (h.t(), dy, down_flops),
            "down wgrad dy.T @ h -> [E, H, I]": (dy.t(), h, down_flops),
            "gate_up wgrad x.T @ dgu -> [E, H, 2I]": (x.t(), dgu, gate_up_flops),
            "gate_up wgrad dgu.T @ x -> [E, 2I, H]": (dgu.t(), x, gate_up_flops),
            "gate_up fwd x @ W.T": (x, gate_up.transpose(1, 2), gate_up_flops),
            "down fwd h @ W.T": (h, down.transpose(1, 2), down_flops),
            "gate_up dgrad dgu @ W": (dgu, gate_up, gate_up_flops),
            "down dgrad dy @ W": (dy, down, down_flops),
        }
        for case, (a, b, flops) in cases.items():
            seconds, _, host = timed(lambda a=a, b=b, offs=offs: torch._grouped_mm(a, b, offs=offs), device,
                                       args.reps)
            gpu = gpu_seconds(lambda a=a, b=b, offs=offs: torch._grouped_mm(a, b, offs=offs), args.reps)
            record = {"bench": "grouped_mm", "case": case, "tokens": tokens, "ms": seconds * 1e3,
                      "host_ms": host * 1e3, "gpu_ms": gpu * 1e3, "tflops": flops / gpu / 1e12}
            records.append(record)
            emit(args, record)
            if args.autotune:
                records.append(autotuned_grouped_mm(args, case, tokens, a, b, offs, flops, gpu))
        if args.deep_gemm:
            records += deep_gemm_grouped(args, tokens, offs, dict(x=x, h=h, dy=dy, dgu=dgu, gate_up=gate_up,
                                                                  down=down), gate_up_flops, down_flops)
    return records


def deep_gemm_grouped(args, tokens, offs, t: dict, gate_up_flops: float, down_flops: float) -> list[dict]:
    """DeepGEMM's bf16 grouped GEMMs on the same routing, beside ``torch._grouped_mm``: the
    forward and input gradients M-grouped (``m_grouped_bf16_gemm_{nt,nn}_contiguous``), the weight
    gradients K-grouped (``k_grouped_bf16_gemm_tn_contiguous``). Both want every expert's rows to
    start at a multiple of ``get_mk_alignment_for_contiguous_layout()`` (128 on an H200), so the
    rows are laid out padded (pad rows zero) in a buffer sized for the worst case, as a dispatcher
    would have to lay them out: by each row's expert (``m_indices``, -1 for padding) or by each
    expert's end (``psum``). The K-grouped kernel accumulates into float32 (zeroed first) and
    takes the groups' sizes from the host; ``+ cast`` adds the bf16 cast a bf16 gradient needs.
    ``rel_err``: relative Frobenius distance from ``torch._grouped_mm``'s result."""
    import torch

    try:
        import deep_gemm
    except ImportError as error:
        raise SystemExit(f"grouped_mm --deep-gemm: {error}; build DeepGEMM as benchmarks/deepgemm_build.sh says") \
            from error
    experts = t["gate_up"].shape[0]
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    aligned = (counts + align - 1) // align * align
    starts = aligned.cumsum(0) - aligned
    rows = int(offs[-1])
    size = rows + experts * (align - 1)  # any routing fits: no host read to size it
    ends = (starts + counts).to(torch.int32)
    dest = torch.repeat_interleave(starts - (offs.long() - counts), counts) + torch.arange(rows, device=offs.device)
    by_row = torch.full((size,), -1, dtype=torch.int32, device=offs.device)
    by_row[dest] = torch.repeat_interleave(torch.arange(experts, device=offs.device, dtype=torch.int32), counts)

    def padded(a):
        out = a.new_zeros(size, a.shape[1])
        out[dest] = a
        return out

    p = {name: padded(t[name]) for name in ("x", "h", "dy", "dgu")}
    gm = functools.partial(torch._grouped_mm, offs=offs)
    records = []

    def run(case, path, fn, flops, result=None, reference=None):
        gpu = gpu_seconds(fn, args.reps)
        record = {"bench": "grouped_mm", "case": case, "tokens": tokens, "path": path, "alignment": align,
                  "gpu_ms": gpu * 1e3, "tflops": flops / gpu / 1e12}
        if reference is not None:
            fn()
            record["rel_err"] = ((result().float() - reference.float()).norm() / reference.float().norm()).item()
        records.append(record)
        emit(args, record)

    for case, a, w, flops, nt in (("gate_up fwd x @ W.T", "x", "gate_up", gate_up_flops, True),
                                  ("down fwd h @ W.T", "h", "down", down_flops, True),
                                  ("gate_up dgrad dgu @ W", "dgu", "gate_up", gate_up_flops, False),
                                  ("down dgrad dy @ W", "dy", "down", down_flops, False)):
        weight = t[w]
        reference = gm(t[a], weight.transpose(1, 2) if nt else weight)
        d = torch.empty(size, weight.shape[1 if nt else 2], device=weight.device, dtype=torch.bfloat16)
        call = deep_gemm.m_grouped_bf16_gemm_nt_contiguous if nt else deep_gemm.m_grouped_bf16_gemm_nn_contiguous
        for layout, grouped, psum in (("m_indices", by_row, False), ("psum", ends, True)):
            run(case, f"deep_gemm {layout}",
                lambda call=call, a=p[a], w=weight, d=d, grouped=grouped, psum=psum:
                    call(a, w, d, grouped, use_psum_layout=psum),
                flops, lambda d=d: d[dest], reference)
    ks, used = aligned.tolist(), int(aligned.sum())
    sizes = aligned.to(torch.int32)
    for case, g, a, flops in (("down wgrad dy.T @ h -> [E, H, I]", "dy", "h", down_flops),
                              ("gate_up wgrad dgu.T @ x -> [E, 2I, H]", "dgu", "x", gate_up_flops)):
        reference = gm(t[g].t(), t[a])
        c = torch.zeros(experts, t[g].shape[1], t[a].shape[1], device=reference.device, dtype=torch.float32)
        gs, as_ = p[g][:used].contiguous(), p[a][:used].contiguous()

        def wgrad(c=c, gs=gs, as_=as_):
            c.zero_()
            deep_gemm.k_grouped_bf16_gemm_tn_contiguous(gs, as_, c, ks, sizes, c)

        run(case, "deep_gemm float32", wgrad, flops, lambda c=c: c, reference)
        run(case, "deep_gemm float32 + cast", lambda wgrad=wgrad, c=c: (wgrad(), c.to(torch.bfloat16)), flops)
    return records


def autotuned_grouped_mm(args, case, tokens, a, b, offs, flops, eager_gpu) -> dict:
    """``torch._grouped_mm`` compiled with Inductor's max-autotune (its persistent Triton template
    against the ATen kernel, benchmarked on even groups); the chosen kernel's GPU time on the
    bench's routing, and its largest difference from the eager result."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), dynamic=False,
                             options={"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"})
    start = time.perf_counter()
    result = compiled(a, b, offs)
    tune = time.perf_counter() - start
    error = (result.float() - torch._grouped_mm(a, b, offs=offs).float()).abs().max().item()
    gpu = gpu_seconds(lambda: compiled(a, b, offs), args.reps)
    record = {"bench": "grouped_mm", "case": case, "tokens": tokens, "path": "max-autotune",
              "gpu_ms": gpu * 1e3, "tflops": flops / gpu / 1e12, "vs_eager": eager_gpu / gpu,
              "max_abs_diff": error, "tune_s": tune}
    emit(args, record)
    return record


def emit(args, record: dict) -> None:
    with open(args.out / "kernels.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def fp8_tables(console, fp8: list[dict]) -> None:
    from rich.table import Table

    grid = Table(title="FP8 linear against bf16 (same backend's run): TFLOP/s")
    for column in ("backend", "model", "layer", "M×K×N", "bf16 fwd+bwd", "fp8 fwd+bwd", "ratio",
                   "fp8 ms (host ms)", "torch quant", "ratio", "bf16 gemm", "fp8 gemm", "ratio"):
        grid.add_column(column, justify="right")
    keyed = {(r["backend"], r["model"], r["layer"], r["m"], r["case"]): r for r in fp8}
    for (backend, model, layer, m, case), r in keyed.items():
        if case != "bf16":
            continue
        get = {c: keyed.get((backend, model, layer, m, c), {}).get("tflops", float("nan"))
               for c in ("bf16", "fp8", "fp8_torch_quant", "bf16_gemm", "fp8_gemm")}
        fp8_row = keyed.get((backend, model, layer, m, "fp8"), {})
        timing = f"{fp8_row['ms']:.2f} ({fp8_row['host_ms']:.2f})" if "host_ms" in fp8_row else "-"
        grid.add_row(backend, model, layer, f"{m}×{r['k']}×{r['n']}", f"{get['bf16']:.0f}", f"{get['fp8']:.0f}",
                     ratio(get["fp8"], get["bf16"]), timing, f"{get['fp8_torch_quant']:.0f}",
                     ratio(get["fp8_torch_quant"], get["bf16"]), f"{get['bf16_gemm']:.0f}",
                     f"{get['fp8_gemm']:.0f}", ratio(get["fp8_gemm"], get["bf16_gemm"]))
    console.print(grid)
    groups = Table(title="Linears of one input, fwd+bwd TFLOP/s: each alone (the model in bf16, and in FP8 "
                         "before groups) or as one")
    for column in ("backend", "model", "layer", "M×K×N", "bf16 alone", "bf16 one", "fp8 alone", "fp8 group",
                   "fp8 group / bf16 alone"):
        groups.add_column(column, justify="right")
    for (backend, model, layer, m, case), r in keyed.items():
        if case != "bf16_separate":
            continue
        get = {c: keyed.get((backend, model, layer, m, c), {}).get("tflops", float("nan"))
               for c in ("bf16_separate", "bf16", "fp8_separate", "fp8_group")}
        groups.add_row(backend, model, layer, f"{m}×{r['k']}×{r['n']}", *(f"{v:.0f}" for v in get.values()),
                       ratio(get["fp8_group"], get["bf16_separate"]))
    if groups.rows:
        console.print(groups)
    compiled = Table(title="Compiled (torch.compile, Inductor launching the quantisers), fwd+bwd TFLOP/s; the "
                           "group is the layer's linears as one FP8 group, against one bf16 linear; graphed: "
                           "replayed from a CUDA graph, the GPU's time alone (bf16 wgrad: fp8_wgrad=False, dx "
                           "beside dW on a second stream; one stream: the same, dx after dW)")
    for column in ("backend", "model", "layer", "M×K×N", "bf16", "fp8", "ratio", "fp8 group", "ratio",
                   "bf16 graphed", "fp8 graphed", "ratio", "bf16 wgrad", "ratio", "one stream", "ratio"):
        compiled.add_column(column, justify="right")
    for (backend, model, layer, m, case), r in keyed.items():
        if case != "bf16_compiled":
            continue
        get = {c: keyed.get((backend, model, layer, m, c), {}).get("tflops", float("nan"))
               for c in ("bf16_compiled", "fp8_compiled", "fp8_group_compiled", "bf16_graphed", "fp8_graphed",
                         "fp8_bf16_wgrad_graphed", "fp8_bf16_wgrad_serial_graphed")}
        compiled.add_row(backend, model, layer, f"{m}×{r['k']}×{r['n']}", f"{get['bf16_compiled']:.0f}",
                         f"{get['fp8_compiled']:.0f}",
                         ratio(get["fp8_compiled"], get["bf16_compiled"]), f"{get['fp8_group_compiled']:.0f}",
                         ratio(get["fp8_group_compiled"], get["bf16_compiled"]), f"{get['bf16_graphed']:.0f}",
                         f"{get['fp8_graphed']:.0f}", ratio(get["fp8_graphed"], get["bf16_graphed"]),
                         f"{get['fp8_bf16_wgrad_graphed']:.0f}",
                         ratio(get["fp8_bf16_wgrad_graphed"], get["bf16_graphed"]),
                         f"{get['fp8_bf16_wgrad_serial_graphed']:.0f}",
                         ratio(get["fp8_bf16_wgrad_serial_graphed"], get["bf16_graphed"]))
    if compiled.rows:
        console.print(compiled)


def moe_table(console, moe: list[dict]) -> None:
    from rich.table import Table

    if not moe:
        return
    grid = Table(title="MoE layer (bf16) and its permutation alone, forward + backward, ms: PyTorch gathers "
                       "against moe_triton's kernels")
    for column in ("tokens", "case", "compiled", "tile:span:warps", "torch ms", "triton ms", "triton / torch",
                   "torch GB/s", "triton GB/s", "peak GiB torch / triton"):
        grid.add_column(column, justify="right")
    base = {(r["tokens"], r["case"], r["compiled"]): r for r in moe if r["path"] == "torch"}
    for other in moe:
        r = base.get((other["tokens"], other["case"], other["compiled"]))
        if other["path"] != "triton" or r is None:
            continue
        grid.add_row(f"{other['tokens']:,}", other["case"], str(other["compiled"]),
                     other.get("launch", "-"), f"{r['ms']:.2f}", f"{other['ms']:.2f}",
                     ratio(other["ms"], r["ms"]), f"{r.get('gbps', 0):.0f}", f"{other.get('gbps', 0):.0f}",
                     f"{r['peak_gib']:.2f} / {other['peak_gib']:.2f}")
    console.print(grid)


def table(out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    records = [json.loads(line) for line in (out / "kernels.jsonl").read_text().splitlines() if line.strip()]
    console = Console(width=140)
    heads = [r for r in records if r["bench"] == "lm_head"]
    if heads:
        grid = Table(title=f"LM head forward + backward, V = {heads[0]['vocab']:,}, H = {heads[0]['hidden']}, bf16")
        for column in ("tokens", "impl", "ms", "peak GiB", "× vanilla time", "× vanilla memory"):
            grid.add_column(column, justify="right")
        base = {r["tokens"]: r for r in heads if r["impl"] == "vanilla" and not r.get("oom")}
        for r in heads:
            b = base.get(r["tokens"])
            if r.get("oom"):
                grid.add_row(f"{r['tokens']:,}", r["impl"], "OOM", "", "", "")
                continue
            grid.add_row(f"{r['tokens']:,}", r["impl"], f"{r['ms']:.1f}", f"{r['peak_gib']:.2f}",
                         ratio(r["ms"], b and b["ms"]), ratio(r["peak_gib"], b and b["peak_gib"]))
        console.print(grid)
    fp8 = [r for r in records if r["bench"] == "fp8"]
    if fp8:
        fp8_tables(console, fp8)
    host = [r for r in records if r["bench"] == "fp8_host"]
    if host:
        grid = Table(title=f"FP8 linear host time per call, µs (M×K×N = {host[0]['m']}×{host[0]['k']}×{host[0]['n']})")
        backends = list(dict.fromkeys(r["backend"] for r in host))
        for column in ("piece", *backends):
            grid.add_column(column, justify="right")
        keyed = {(r["backend"], r["case"]): f"{r['host_us']:.0f}"
                 + (f" / {r['gpu_us']:.0f} GPU" if "gpu_us" in r else "") for r in host}
        for case in dict.fromkeys(r["case"] for r in host):
            grid.add_row(case, *(keyed.get((b, case), "-") for b in backends))
        console.print(grid)
    quant_table(console, [r for r in records if r["bench"] == "quant"])
    quant_rows_table(console, [r for r in records if r["bench"] in ("quant_rows", "quant_blocks")])
    moe_table(console, [r for r in records if r["bench"] == "moe"])
    steps = [r for r in records if r["bench"] == "adamw"]
    if steps:
        grid = Table(title="The update in one process (bf16 gradients, clip, AdamW; master weights: compute copies)")
        for column in ("model", "parameters", "path", "ms", "GB/s (bytes it must move)", "× unfused time"):
            grid.add_column(column, justify="right")
        base = {(r["model"], r["path"].startswith("bf16")): r["ms"] for r in steps if r["path"].endswith("unfused")}
        for r in steps:
            path = f"{r['path']} {r['block']}x{r['warps']}" if "block" in r else r["path"]
            grid.add_row(r["model"], f"{r['params'] / 1e9:.2f}B", path, f"{r['ms']:.1f}", f"{r['gbps']:.0f}",
                         ratio(r["ms"], base.get((r["model"], r["path"].startswith("bf16")))))
        console.print(grid)


def quant_table(console, rows: list[dict]) -> None:
    """Per input shape: the default launch, the fastest bit-exact one, and Inductor's."""
    from rich.table import Table

    if not rows:
        return
    from prime_plugin_fp8.triton_quant import ROWS_AND_COLUMNS

    default = "{tiles}:{stages}:{warps}".format(**ROWS_AND_COLUMNS)
    grid = Table(title=f"quantize_rows_and_columns, GPU µs (GB/s); launches TILES:STAGES:WARPS, default {default}")
    for column in ("M × K", "default", "fastest launch", "× default", "inductor"):
        grid.add_column(column, justify="right")
    for shape in dict.fromkeys((r["m"], r["k"]) for r in rows):
        here = [r for r in rows if (r["m"], r["k"]) == shape]
        cell = {r["case"]: r for r in here}
        best = min((r for r in here if r["same_bits"] and r["case"] != "inductor"), key=lambda r: r["gpu_us"])
        base = cell.get(default)
        show = lambda r: f"{r['gpu_us']:.1f} ({r['gbps']:.0f})" if r else "-"  # noqa: E731
        grid.add_row(f"{shape[0]:,} × {shape[1]:,}", show(base), f"{best['case']}: {show(best)}",
                     ratio(base["gpu_us"], best["gpu_us"]) if base else "-", show(cell.get("inductor")))
    console.print(grid)


def quant_rows_table(console, rows: list[dict]) -> None:
    """Per input shape: a bf16 copy, the default launch, the fastest bit-exact one; per weight
    shape, ``W`` and ``W.T``'s blocks."""
    from rich.table import Table

    if not rows:
        return
    from prime_plugin_fp8.triton_quant import ROWS

    show = lambda r: f"{r['gpu_us']:.1f} ({r['gbps']:.0f})" if r else "-"  # noqa: E731
    default = "{rows}:{blocks}:{warps}".format(**ROWS)
    grid = Table(title=f"quantize_rows, GPU µs (GB/s); launches ROWS:BLOCKS:WARPS, default {default}")
    for column in ("M × K", "bf16 copy", "default", "fastest launch", "× default"):
        grid.add_column(column, justify="right")
    quants = [r for r in rows if r["bench"] == "quant_rows"]
    for shape in dict.fromkeys((r["m"], r["k"]) for r in quants):
        cell = {r["case"]: r for r in quants if (r["m"], r["k"]) == shape}
        best = min((r for c, r in cell.items() if r["same_bits"] and c != "bf16 copy"), key=lambda r: r["gpu_us"])
        base = cell.get(default)
        grid.add_row(f"{shape[0]:,} × {shape[1]:,}", show(cell.get("bf16 copy")), show(base),
                     f"{best['case']}: {show(best)}", ratio(base["gpu_us"], best["gpu_us"]) if base else "-")
    console.print(grid)
    blocks = [r for r in rows if r["bench"] == "quant_blocks"]
    if blocks:
        cases = list(dict.fromkeys(r["case"] for r in blocks))
        grid = Table(title="quantize_blocks, GPU µs (GB/s)")
        for column in ("N × K", *cases, "same bits"):
            grid.add_column(column, justify="right")
        for shape in dict.fromkeys((r["m"], r["k"]) for r in blocks):
            cell = {r["case"]: r for r in blocks if (r["m"], r["k"]) == shape}
            grid.add_row(f"{shape[0]:,} × {shape[1]:,}", *(show(cell.get(c)) for c in cases),
                         str(all(r["same_bits"] for r in cell.values())))
        console.print(grid)


def ratio(value, base) -> str:
    return f"{value / base:.2f}" if base else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode",
                        choices=("lm_head", "fp8", "fp8_host", "quant", "quant_rows", "adamw", "norm", "moe",
                                 "grouped_mm", "table"))
    parser.add_argument("--models", nargs="+", default=["1.7B", "moe"], help="adamw, norm: the shapes")
    parser.add_argument("--launch", nargs="+", default=[], metavar="BLOCK:WARPS",
                        help="adamw, norm, moe, quant, quant_rows: time the fused kernel / the squares / the "
                             "permutation's kernels / the FP8 quantiser at each of these launch shapes (default: "
                             "their own; norm's NORM_BLOCK:NORM_WARPS, moe's TILE:SPAN:WARPS, see moe_triton.TILE; "
                             "quant's TILES:STAGES:WARPS and quant_rows' ROWS:BLOCKS:WARPS, default a sweep)")
    parser.add_argument("--backends", nargs="+", default=["auto"],
                        help="fp8: the fp8_linear backends to time, each beside its own bf16 run")
    parser.add_argument("--layers", nargs="+", default=[], metavar="MODEL:LAYER",
                        help="fp8: only these shapes (e.g. 1.7B:qkv 8B:down; default all)")
    parser.add_argument("--profile", action="store_true",
                        help="fp8, moe: print the profiler's host and GPU tables of each FP8 linear's / the compiled "
                             "MoE layer's calls")
    parser.add_argument("--autotune", action="store_true",
                        help="grouped_mm: each case also compiled with Inductor's max-autotune (Triton template "
                             "against ATen), timed on the same routing")
    parser.add_argument("--deep-gemm", action="store_true",
                        help="grouped_mm: DeepGEMM's bf16 grouped GEMMs too, on the same routing laid out padded")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--host-m", type=int, default=256,
                        help="fp8_host: the linear's rows (M; K = N = 2,048); small, so the host's time shows")
    parser.add_argument("--out", type=Path, default=Path("/tmp/prime-kernels"))
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "table":
        table(args.out)
        return 0
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    {"lm_head": bench_lm_head, "fp8": bench_fp8, "fp8_host": bench_fp8_host, "quant": bench_quant,
     "quant_rows": bench_quant_rows, "adamw": bench_adamw,
     "norm": bench_norm, "moe": bench_moe, "grouped_mm": bench_grouped_mm}[args.mode](args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
