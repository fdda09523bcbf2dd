"""The fp8 plugin's key of ``trainer.model`` (prime-rl's name)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from prime_core.config.base import Section


class FP8Keys(Section):
    prime_rl_keys: ClassVar[tuple[str, ...]] = ("fp8",)

    quantization: Literal["fp8"] | None = None
    """``fp8``: the transformer blocks' linear layers compute in block-scaled FP8 (after LoRA,
    before every strategy that wraps or shards); the backend is ``trainer.model.kernels.fp8_linear``
    (``auto`` by default). prime-rl 0.6's ``fp8 = true`` means the same."""

    fp8_wgrad: bool = False
    """With ``quantization = "fp8"``: ``true`` computes the weight gradient ``dy.T @ x`` in FP8
    too (1×128 blocks along the tokens on both sides, DeepSeek-V3's recipe and the default of
    ``prime_plugin_fp8.linear``), keeping each linear's input as ``x.T`` in FP8 (a byte an
    element, not two); ``false`` computes it in bf16 from ``x`` itself. On an H200 with DeepGEMM
    the bf16 weight gradient is the faster one: the Qwen3-1.7B-shape step at 8k tokens 1.07x
    bf16's against about 1.0x, the lone linears 1.12-1.29x bf16 against 0.91-1.29x (the FP8
    weight-gradient GEMM runs at about 780 TFLOP/s, and its operands' column quantisation costs
    more than it saves), and it adds no FP8 rounding to the weight gradient."""

    fp8_weight_cache: bool = True
    """With ``quantization = "fp8"`` in one trainer process: quantise each weight into its FP8
    blocks once a step, the forward GEMM's in the first forward pass and the input gradient's
    (``W.T``'s) in the first backward pass, and reuse them in the step's later passes
    (micro-batches, and recomputation under activation checkpointing), as Transformer Engine
    does. It starts in the step after one of several passes and holds up to two bytes a
    converted weight: the forward's until the step's last backward pass, ``W.T``'s into it; a
    step of one pass stores nothing. Same bits either way. With several processes FSDP gathers
    the weights anew for every pass, and nothing is kept."""

    @model_validator(mode="before")
    @classmethod
    def _fp8_flag(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fp8" in data:
            data = dict(data)
            if data.pop("fp8"):
                if data.get("quantization") not in (None, "fp8"):
                    raise ValueError("fp8 = true and quantization disagree: give one of them")
                data["quantization"] = "fp8"
        return data
