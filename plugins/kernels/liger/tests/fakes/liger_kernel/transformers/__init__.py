"""Stand-ins for liger's per-architecture patch functions: they record their arguments."""

calls = []


def apply_liger_kernel_to_qwen3(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                swiglu=True, model=None):
    calls.append(("qwen3", {"rope": rope, "cross_entropy": cross_entropy,
                            "fused_linear_cross_entropy": fused_linear_cross_entropy, "rms_norm": rms_norm,
                            "swiglu": swiglu, "model": model}))


def apply_liger_kernel_to_qwen3_moe(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
    calls.append(("qwen3_moe", {"rope": rope, "cross_entropy": cross_entropy,
                                "fused_linear_cross_entropy": fused_linear_cross_entropy, "rms_norm": rms_norm,
                                "swiglu": swiglu, "model": model}))


def apply_liger_kernel_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                model=None):
    # an older signature: no swiglu switch
    calls.append(("llama", {"rope": rope, "cross_entropy": cross_entropy,
                            "fused_linear_cross_entropy": fused_linear_cross_entropy, "rms_norm": rms_norm,
                            "model": model}))
