#!/usr/bin/env python3
"""Plain Hugging Face transformers training-step benchmark: the baseline prime's trainer is compared to.

What one step is (deliberately vanilla, nothing from prime):

* a Qwen3-1.7B-shaped ``Qwen3ForCausalLM`` built from a ``Qwen3Config`` with random weights
  (hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab 151936,
  tied embeddings, rope_theta 1e6, max_position_embeddings 40960), ``attn_implementation="sdpa"``;
* **bf16 parameters** (and so bf16 gradients and bf16 AdamW moments) on one GPU, with plain
  ``torch.optim.AdamW`` (fused when available, lr 1e-6): no fp32 master weights, no mixed-precision
  wrapper. This is what the reference measurement used; keep it that way so numbers stay comparable;
* vanilla LM head and HF's own loss: ``model(input_ids, labels=input_ids).loss`` (full
  ``[seq, vocab]`` logits, upcast to fp32 inside HF's loss), then ``backward()``, ``step()``,
  ``zero_grad(set_to_none=True)``;
* batch 1 x seq_len random tokens; gradient checkpointing (non-reentrant) on at 16384 and 32768
  tokens (``--gc-from``), off below.

For each length: 2 warm-up + 3 measured steps (``--warmup``/``--steps``), each timed with a CUDA
synchronize around a host clock; reported: median step time, tokens/s, peak
``torch.cuda.max_memory_allocated`` (GiB and % of the device's total) and MFU. An out-of-memory step is
reported as "OOM" and the run goes on with the next length.

MFU = flops / step_time / peak, with
  flops = 6 * N * tokens + 6 * n_layers * (n_heads * head_dim) * seq_len**2
where N = non-embedding parameters + LM-head parameters (counted once more when tied, since the head
matmul is real work), and the second term is causal attention (QK^T and AV, half the square, fwd+bwd).
Recomputation by gradient checkpointing is not counted (model flops, not hardware flops).
peak = 989e12 (dense bf16) for H100 / H200 by device name, else n/a (or ``--peak-tflops``).

Reference: such a plain step measured about 25.6k tokens/s at 8192 tokens and 97 GiB peak at 32768 on
one H200 (so 32768 does not fit an 80 GB H100).

    python3 benchmarks/hf_baseline.py --seq-lens 4096 8192 16384 32768 --output-json hf.json
    python3 benchmarks/hf_baseline.py --tiny   # seconds-long smoke test of the script itself (CPU is fine)
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import torch

GIB = 1024**3
# dense bf16 tensor-core peak, by a substring of torch.cuda.get_device_name()
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}

QWEN3_1_7B = {
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
QWEN3_MOE = {  # parallel_bench.py's MoE shape (2.9B, 8 layers, 64 experts, top 8): --moe
    **QWEN3_1_7B,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 768,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--gc-from", type=int, default=16384, help="gradient checkpointing on for seq_len >= this (default 16384)"
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak used for MFU")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true", help="the 2.9B Qwen3-MoE shape of parallel_bench.py moe "
                   "(MFU over the active parameters)")
    p.add_argument("--tiny", action="store_true", help="tiny config and short lengths: smoke test only")
    a = p.parse_args(argv)
    if a.tiny and a.seq_lens == p.get_default("seq_lens"):
        a.seq_lens = [64, 128, 256, 512]
        a.gc_from = 256
    return a


def build_model(cfg_kwargs, device):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    config_class = Qwen3MoeConfig if "num_experts" in cfg_kwargs else Qwen3Config
    try:
        config = config_class(**cfg_kwargs, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    except TypeError:  # transformers 4.x spelling
        config = config_class(**cfg_kwargs, rope_theta=1e6)
    config.use_cache = False
    with torch.device(device):  # initialise on the GPU: random init of 2B params on the CPU is slow
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:  # transformers 4.x spelling
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device=device, dtype=torch.bfloat16)
    model.train()
    return config, model


def make_optimizer(model, lr, device):
    params = [p for p in model.parameters() if p.requires_grad]
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True), "fused"
        except (TypeError, RuntimeError, ValueError):
            pass
    return torch.optim.AdamW(params, lr=lr), "default"


def count_params(model, config):
    emb = model.get_input_embeddings().weight
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    non_emb = total - emb.numel()
    lm_head = config.vocab_size * config.hidden_size  # the head's matmul, tied or not
    active = non_emb
    experts = getattr(config, "num_experts", 0)
    if experts:  # MoE: only the routed experts' weights do a token's work
        idle = experts - config.num_experts_per_tok
        active -= config.num_hidden_layers * idle * 3 * config.hidden_size * config.moe_intermediate_size
    return {
        "total_unique": total,
        "embedding": emb.numel(),
        "non_embedding": non_emb,
        "active_non_embedding": active,
        "lm_head": lm_head,
        "flops_params": active + lm_head,
    }


def step_flops(n_params, config, seq_len, batch=1):
    attn = 6 * config.num_hidden_layers * (config.num_attention_heads * config.head_dim) * seq_len**2
    return 6 * n_params * seq_len * batch + attn * batch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(e):
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t
    )
    return isinstance(e, oom_types) or "out of memory" in str(e).lower()


def free(model, opt, device):
    opt.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_one(model, opt, config, seq_len, args, device, n_params, peak_flops, total_mem):
    use_gc = seq_len >= args.gc_from
    if use_gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.config.use_cache = False
    free(model, opt, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + seq_len)
    res = {"seq_len": seq_len, "tokens_per_step": seq_len, "grad_checkpointing": use_gc}
    times, losses, oom = [], [], None
    loss = ids = None
    try:
        for i in range(args.warmup + args.steps):
            ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=gen).to(device, non_blocking=True)
            sync(device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            loss = ids = None
            if i >= args.warmup:
                times.append(dt)
    except Exception as e:  # OOM is a result; anything else is re-raised
        if not is_oom(e):
            raise
        oom = str(e).splitlines()[0][:300]
    if oom is not None:  # outside the except: its traceback no longer pins the activations
        loss = ids = None
        res.update(status="OOM", error=oom, losses=losses)
        if device.type == "cuda":
            res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            res["peak_mem_pct"] = 100 * torch.cuda.max_memory_allocated(device) / total_mem
        free(model, opt, device)
        return res
    step = statistics.median(times)
    flops = step_flops(n_params, config, seq_len)
    res.update(
        status="ok",
        step_time_s=step,
        step_times_s=times,
        tokens_per_s=seq_len / step,
        flops_per_step=flops,
        tflops_per_s=flops / step / 1e12,
        mfu=(flops / step / peak_flops) if peak_flops else None,
        losses=losses,
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        res.update(
            peak_mem_gib=peak / GIB,
            peak_mem_pct=100 * peak / total_mem,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
        )
    free(model, opt, device)
    return res


def fmt_row(r):
    gc_ = "on" if r["grad_checkpointing"] else "off"
    if r["status"] != "ok":
        return [str(r["seq_len"]), gc_, "OOM", "OOM", "OOM", "OOM", "OOM"]
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "n/a"
    pct = f"{r['peak_mem_pct']:.0f}%" if "peak_mem_pct" in r else "n/a"
    return [str(r["seq_len"]), gc_, f"{r['tokens_per_s']:,.0f}", f"{1000 * r['step_time_s']:.0f}", mfu, mem, pct]


def print_table(title, rows):
    headers = ["seq_len", "grad ckpt", "tokens/s", "step ms", "MFU", "peak GiB", "% of GPU"]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for h in headers:
            t.add_column(h, justify="right")
        for r in rows:
            t.add_row(*r)
        Console(width=120).print(t)
    except ImportError:
        w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w[i]) for i, h in enumerate(headers)))
        for r in rows:
            print("  ".join(c.rjust(w[i]) for i, c in enumerate(r)))


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("hf_baseline: no CUDA device (use --tiny for a CPU smoke test)")
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    total_mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    peak_flops = (
        args.peak_tflops * 1e12
        if args.peak_tflops
        else next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if device.type == "cuda"
        else None
    )

    t0 = time.perf_counter()
    shape = TINY if args.tiny else QWEN3_MOE if args.moe else QWEN3_1_7B
    config, model = build_model(shape, device)
    opt, opt_kind = make_optimizer(model, args.lr, device)
    counts = count_params(model, config)
    build_s = time.perf_counter() - t0
    print(
        f"hf_baseline: {name}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{counts['total_unique'] / 1e9:.3f}B params ({counts['non_embedding'] / 1e9:.3f}B non-embedding), "
        f"bf16, AdamW {opt_kind}, sdpa; model built in {build_s:.1f}s",
        flush=True,
    )

    results = []
    for L in args.seq_lens:
        r = bench_one(model, opt, config, L, args, device, counts["flops_params"], peak_flops, total_mem)
        results.append(r)
        msg = (
            f"  seq {L}: {r['tokens_per_s']:,.0f} tok/s, {1000 * r['step_time_s']:.0f} ms/step, "
            f"peak {r['peak_mem_gib'] if 'peak_mem_gib' in r else float('nan'):.1f} GiB, loss {r['losses'][-1]:.3f}"
            if r["status"] == "ok"
            else f"  seq {L}: OOM ({r['error']})"
        )
        print(msg, flush=True)

    out = {
        "benchmark": "hf_baseline",
        "device": name,
        "device_total_mem_gib": total_mem / GIB if total_mem else None,
        "peak_flops": peak_flops,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": {k: getattr(config, k) for k in shape},
        "params": counts,
        "dtype": "bfloat16 params, grads and AdamW states (no fp32 master weights)",
        "optimizer": f"torch.optim.AdamW({opt_kind}), lr={args.lr}",
        "attn_implementation": "sdpa",
        "loss": "HF model(input_ids, labels=input_ids).loss",
        "batch_size": 1,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "gc_from_seq_len": args.gc_from,
        "results": results,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    print_table(
        f"HF baseline, {'Qwen3-MoE 2.9B' if args.moe else 'Qwen3-1.7B'} shape{' (TINY)' if args.tiny else ''}, "
        f"bf16 + AdamW, batch 1 — {name}",
        [fmt_row(r) for r in results],
    )


if __name__ == "__main__":
    main()
