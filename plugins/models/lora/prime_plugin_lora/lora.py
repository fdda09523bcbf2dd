"""LoRA (``trainer.model.lora``): low-rank adapters on the chosen linear layers.

Every ``nn.Linear`` of the transformer blocks whose name is in ``target_modules`` becomes
``base + (alpha / rank) · B·A·dropout(x)``, with ``A`` initialised like a linear layer and ``B``
at zero, so training starts from the base model. Everything else is frozen: only the adapters
get gradients and optimizer state, and only they are published, in the PEFT layout vLLM
loads (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import math

from prime_core.specs import Applied

PREFIX = "base_model.model."


def _lora_linear_class():
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
            super().__init__()
            self.base = base
            self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
            self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
            self.scaling = alpha / rank
            self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    return LoRALinear


def apply(model, *, config, **_):
    """Wrap the target layers and freeze the rest; the adapter alone is what gets published."""
    from torch import nn

    from prime_core.trainer.model import transformer_blocks

    lora = config.lora
    if lora.modules_to_save:
        raise ValueError("trainer.model.lora.modules_to_save is not supported: vLLM cannot serve adapters "
                         "with fully trained modules; leave it empty")
    wrapper = _lora_linear_class()
    for param in model.parameters():
        param.requires_grad_(False)
    wrapped = 0
    for block in transformer_blocks(model):
        targets = [(name, module) for name, module in block.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in lora.target_modules]
        for name, module in targets:
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, wrapper(module, lora.rank, lora.alpha, lora.dropout))
            wrapped += 1
    if not wrapped:
        raise ValueError(f"trainer.model.lora.target_modules = {lora.target_modules}: no linear layer of "
                         f"{type(model).__name__}'s blocks has one of these names")
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(config.name),
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(set(lora.target_modules)), "bias": "none", "use_rslora": False,
        "use_dora": False, "inference_mode": True,
    }

    def export(model, world):
        return adapter_state(model, world, adapter_config)

    return Applied(model, exporter=export)


def adapter_state(model, world, adapter_config: dict):
    """The adapter's full tensors with PEFT names, on rank 0 (``None`` elsewhere). Collective."""
    from prime_core.trainer.build import clean_names
    from prime_core.weights import Adapter

    params = dict(model.named_parameters())
    if any(hasattr(p, "full_tensor") for p in params.values()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    else:
        state = {name: p.detach().cpu() for name, p in params.items() if p.requires_grad}
    if not world.main:
        return None
    tensors = {PREFIX + name: value.contiguous() for name, value in clean_names(state).items()
               if ".lora_A." in name or ".lora_B." in name}
    return Adapter(tensors=tensors, config=adapter_config)


def merge(base: str, adapter: str, out: str) -> str:
    """Write ``base`` with ``adapter`` folded in (``W + alpha/r · B·A``) as a full Hugging Face
    model (tokenizer included when the base has one)."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    modules = dict(model.named_modules())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        path = key.removeprefix(PREFIX).replace(".lora_A.weight", "")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        if path not in modules:
            raise ValueError(f"{adapter}: {path} is not a module of {base}")
        with torch.no_grad():
            modules[path].weight += scale * (b.float() @ a.float())
    model.save_pretrained(out, safe_serialization=True)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base).save_pretrained(out)
    except (OSError, ValueError):
        pass  # a base without a tokenizer
    return out
