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

    fp8_wgrad: bool = True
    """With ``quantization = "fp8"``: the weight gradient ``dy.T @ x`` in FP8 too (1×128 blocks
    along the tokens on both sides, as DeepSeek-V3); ``false`` computes it in bf16 from ``x``
    kept in bf16 (more activation memory: 2 bytes an element of each linear's input instead of 1)."""

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
