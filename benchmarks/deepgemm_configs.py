"""DeepGEMM's own launch settings against its default choice, for the FP8 linear's GEMMs
(``gemm(..., backend="deep_gemm")``, 1×128 by 128×128 scales, bf16 out): the SM count it plans
for (``set_num_sms``), the block sizes it may pick (``set_block_size_multiple_of``) and
programmatic dependent launch (``set_pdl``). Each GEMM replayed from a CUDA graph, GPU time
(``kernels_bench``'s ``graphed`` and ``gpu_seconds``; stop 60's rows were timed over graphs of 20
calls, the same GPU time).

    DG_PRINT_CONFIGS=1 python3 benchmarks/deepgemm_configs.py [--shapes 8192x2048x2048 ...]

Prints one line per (shape, setting): µs and the ratio to the default; DeepGEMM prints each
config it picks (``DG_PRINT_CONFIGS``).
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8192x2048x2048"], help="MxKxN")
    parser.add_argument("--num-sms", nargs="*", type=int, default=[128, 120, 112])
    parser.add_argument("--block-n-multiples", nargs="*", type=int, default=[32, 64, 128])
    args = parser.parse_args()

    import deep_gemm
    import torch
    from kernels_bench import gpu_seconds, graphed

    from prime_plugin_fp8.gemm import gemm
    from prime_plugin_fp8.quant import quantize_blocks, quantize_rows

    sms, pdl = deep_gemm.get_num_sms(), deep_gemm.get_pdl()
    settings = [("default", {})] + [(f"num_sms={n}", {"num_sms": n}) for n in args.num_sms] + [
        (f"block_n%{b}", {"block_n": b}) for b in args.block_n_multiples] + [("pdl", {"pdl": True})]
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = quantize_rows(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
        b = quantize_blocks((torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16())
        want = gemm(a, b, b_block=128, out_dtype=torch.bfloat16, backend="deep_gemm")
        base = None
        for name, setting in settings:
            deep_gemm.set_num_sms(setting.get("num_sms", sms))
            deep_gemm.set_block_size_multiple_of((1, setting.get("block_n", 1)))
            deep_gemm.set_pdl(setting.get("pdl", pdl))
            try:
                got = gemm(a, b, b_block=128, out_dtype=torch.bfloat16, backend="deep_gemm")
                replay = graphed(lambda a=a, b=b: gemm(a, b, b_block=128, out_dtype=torch.bfloat16,
                                                       backend="deep_gemm"), ())
                us = gpu_seconds(replay, 200) * 1e6
            except Exception as exc:  # a setting DeepGEMM refuses for this shape
                print(json.dumps({"shape": shape, "setting": name, "error": str(exc)[:200]}), flush=True)
                continue
            base = base or us
            print(json.dumps({"shape": shape, "setting": name, "us": round(us, 2), "vs_default": round(base / us, 3),
                              "tflops": round(2 * m * k * n / us / 1e6), "same": bool(torch.equal(got, want))}),
                  flush=True)
        deep_gemm.set_num_sms(sms)
        deep_gemm.set_block_size_multiple_of((1, 1))
        deep_gemm.set_pdl(pdl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
