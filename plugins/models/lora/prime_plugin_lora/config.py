"""The lora plugin's key of ``trainer.model`` (``[trainer.model.lora]``), and the rule that a
LoRA run's inference server serves adapters of that rank."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from prime_core.config.base import Section, Toggle


class LoRAConfig(Section):
    rank: int = Field(default=16, ge=1)
    alpha: float = 32.0
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = Field(default_factory=list)


class LoRAKeys(Section):
    lora: Toggle[LoRAConfig] = None
    """Train LoRA adapters instead of the whole model; only they are published and served."""


class ServeAdapters(Section):
    """A LoRA trainer publishes adapters: the server an RL run starts must accept them."""

    @model_validator(mode="before")
    @classmethod
    def _serve_lora(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        trainer, inference = data.get("trainer"), data.get("inference", {})
        model = trainer.get("model") if isinstance(trainer, dict) else None
        lora = model.get("lora") if isinstance(model, dict) else None
        if lora is None or lora is False or inference is None or inference is False:
            return data
        inference = {} if inference is True else inference
        if isinstance(inference, dict) and inference.get("lora") is None:
            rank = lora.get("rank", 16) if isinstance(lora, dict) else 16
            data = {**data, "inference": {**inference, "lora": {"max_rank": rank}}}
        return data
