"""The continuous-batching settings of one server, from its ``inference`` config.

``inference.args`` are fields of transformers' ``ContinuousBatchingConfig`` (``num_blocks``,
``max_batch_tokens``, ``max_requests_per_batch``, ``use_cuda_graph``, ...), plus
``attn_implementation`` for loading the model. prime fixes the fields its sampling contract
depends on (``FIXED``) and sizes the KV cache unless ``args`` does:

- on a GPU, ``gpu_memory_utilization`` is the share of the GPU's memory this server may hold in
  all (weights, CUDA context, activations, KV cache), as for vLLM: transformers sizes the
  cache from a share of the *free* memory (``max_memory_percent``), which is set so that the
  total stays within ``gpu_memory_utilization × total`` whatever else runs on the GPU;
- on a CPU, the cache and the batch tensors get ``CPU_MEMORY_BYTES`` (the vllm backend's KV
  cache is as large), since a share of the machine's memory would be most of it; on a CPU the
  attention masks, which grow with the cache, take most of that.
"""

from __future__ import annotations

from typing import Any

from prime_plugin_transformers import torch_flash

CPU_MEMORY_BYTES = 256 * 1024**2
CPU_MAX_BATCH_TOKENS = 1024
"""Tokens per forward pass on a CPU (transformers' default, 8192, sizes attention masks for a GPU)."""
CUDA_CONTEXT_BYTES = 512 * 1024**2
"""The CUDA context of this process, outside torch's allocator, counted in its share."""
HEADROOM = 0.8
"""Of its share, what transformers' sizing may plan for: the rest is for the vocabulary-sized
temporaries of sampling it does not count (transformers' own default with logits processors)."""

FIXED = {
    "return_logprobs": "the sampling contract returns the log-probability of every sampled token",
    "per_request_processors": "every request brings its own temperature and top-p",
    "allow_block_sharing": "prefix caching is off (see the plugin's README); it cannot be turned on",
}
MODEL_ARGS = ("attn_implementation",)
"""``args`` keys that go to ``from_pretrained`` instead."""
VLLM_NAMES = {
    "max_num_seqs": "its equivalent is inference.args.max_requests_per_batch",
    "max_num_batched_tokens": "its equivalent is inference.args.max_batch_tokens",
    "enable_prefix_caching": "this backend has no prefix caching (the plugin's README says why)",
    "kv_cache_memory_bytes": "size the cache with inference.gpu_memory_utilization, or inference.args.num_blocks "
                             "(blocks of page_size tokens)",
    "gpu_memory_utilization": "use inference.gpu_memory_utilization",
    "enforce_eager": "this backend runs eagerly unless inference.args.use_cuda_graph or default_compile_level say "
                     "otherwise",
    "data_parallel_size": "use inference.parallel.dp (one server per replica)",
    "tensor_parallel_size": "this backend has no tensor parallelism",
    "enable_lora": "this backend serves no LoRA adapters",
    "max_lora_rank": "this backend serves no LoRA adapters",
}


def cb_fields() -> set[str]:
    """The fields of the installed transformers' ``ContinuousBatchingConfig``."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}


def args_problems(args: dict[str, Any], fields: set[str]) -> list[str]:
    """``inference.args: ...`` messages for keys this backend cannot take."""
    problems = []
    for raw, value in args.items():
        key = raw.replace("-", "_")
        if key in MODEL_ARGS:
            continue
        if key in FIXED:
            if key == "allow_block_sharing" and value is False:
                continue
            problems.append(f"inference.args.{raw}: set by the transformers backend ({FIXED[key]})")
        elif key in VLLM_NAMES:
            problems.append(f"inference.args.{raw} is a vLLM option the transformers backend does not have: "
                            f"{VLLM_NAMES[key]}")
        elif key not in fields:
            known = sorted(fields - set(FIXED) - {"block_size", "use_default_compile_configs", "max_cached_graphs"})
            problems.append(f"inference.args.{raw}: not a continuous-batching option of this transformers "
                            f"(options: {', '.join(known)}, attn_implementation)")
    return problems


def cpu_memory_percent() -> float:
    """The share of the memory transformers counts as free on a CPU (total minus this process)
    that makes ``CPU_MEMORY_BYTES``."""
    try:
        import psutil
    except ImportError:
        raise ValueError("transformers sizes its cache on a CPU with psutil: pip install psutil") from None
    free = psutil.virtual_memory().total - psutil.Process().memory_info().rss
    return min(1.0, CPU_MEMORY_BYTES / max(free, 1))


def gpu_memory_percent(utilization: float, *, total: int, free: int, held: int) -> float:
    """The share of the free GPU memory the KV cache and activations may take, so that this
    process holds at most ``utilization × total`` (``held``: what it holds already)."""
    budget = utilization * total - held - CUDA_CONTEXT_BYTES
    if budget <= 0:
        raise ValueError(f"inference.gpu_memory_utilization = {utilization:g} gives this server "
                         f"{utilization * total / 2**30:.1f} GiB, but the model alone takes "
                         f"{(held + CUDA_CONTEXT_BYTES) / 2**30:.1f} GiB: raise it")
    if free <= 0:
        raise ValueError("no free GPU memory left for the KV cache")
    return min(1.0, HEADROOM * budget / free)


def settings(config, model, *, device: str, fields: set[str]) -> dict[str, Any]:
    """Keyword arguments of ``ContinuousBatchingConfig`` for this server."""
    args = {k.replace("-", "_"): v for k, v in config.args.items() if k.replace("-", "_") not in MODEL_ARGS}
    out: dict[str, Any] = {"return_logprobs": True, "per_request_processors": True, "allow_block_sharing": False}
    if device == "cpu":
        if "max_memory_percent" not in args and "num_blocks" not in args:
            out["max_memory_percent"] = cpu_memory_percent()
        out["max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
    elif "max_memory_percent" not in args and "num_blocks" not in args:
        import torch

        free, total = torch.cuda.mem_get_info()
        out["max_memory_percent"] = gpu_memory_percent(config.gpu_memory_utilization, total=total, free=free,
                                                       held=torch.cuda.memory_reserved())
    if device != "cpu" and model.config._attn_implementation.removeprefix("paged|") == torch_flash.NAME:
        # The manager turns these on by default for "flash" names only; on one H100 (0.6B shape, 256
        # concurrent samples) they take the varlen kernel from 5,472 to 7,576 and 8,810 tokens/s.
        out["use_cuda_graph"] = True
        out["use_async_batching"] = True
    if "auto_switch_to_flash" in fields and model.dtype.itemsize == 4:
        out["auto_switch_to_flash"] = False  # flash attention has no float32 kernels
    out.update(args)
    return {k: v for k, v in out.items() if k in fields}
