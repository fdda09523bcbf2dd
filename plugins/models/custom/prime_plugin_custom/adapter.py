"""Tensor names between this implementation and the Hugging Face hub layout.

The names are transformers' except for the routed experts: the hub (what ``save_pretrained``
writes and vLLM reads) holds one ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert,
the model holds them stacked as ``mlp.experts.gate_up_proj [E, 2 * I, H]`` (gate rows first)
and ``mlp.experts.down_proj [E, H, I]``. Imports no torch until a conversion runs.
"""

from __future__ import annotations

import re

EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<name>gate_up_proj|down_proj)$")
TIED_HEAD = "lm_head.weight"


def target(hf_name: str) -> tuple[str, tuple[int, str] | None]:
    """The model tensor a hub tensor belongs in, and for an expert piece ``(expert, proj)``."""
    match = EXPERT.match(hf_name)
    if match is None:
        return hf_name, None
    stacked = "down_proj" if match["proj"] == "down_proj" else "gate_up_proj"
    return f"{match['prefix']}.{stacked}", (int(match["expert"]), match["proj"])


def piece(stacked, part: tuple[int, str]):
    """The view of a stacked expert tensor that holds ``part`` (``target``'s second value)."""
    expert, proj = part
    if proj == "down_proj":
        return stacked[expert]
    half = stacked.shape[1] // 2
    return stacked[expert, :half] if proj == "gate_proj" else stacked[expert, half:]


class HubAdapter:
    """``to_hf`` / ``from_hf`` for ``ModelImpl.state_dict_adapter``."""

    def to_hf(self, state: dict, *, tied: bool = False) -> dict:
        """Model names -> hub names; expert tensors become per-expert views (clone them before
        handing them to safetensors, which refuses shared storage). ``tied`` drops
        ``lm_head.weight``, as transformers does for tied embeddings."""
        out = {}
        for name, tensor in state.items():
            match = STACKED.match(name)
            if match is None:
                if not (tied and name == TIED_HEAD):
                    out[name] = tensor
                continue
            projs = ("down_proj",) if match["name"] == "down_proj" else ("gate_proj", "up_proj")
            for expert in range(tensor.shape[0]):
                for proj in projs:
                    out[f"{match['prefix']}.{expert}.{proj}.weight"] = piece(tensor, (expert, proj))
        return out

    def from_hf(self, state: dict) -> dict:
        """Hub names -> model names, stacking the experts (every expert must be present)."""
        import torch

        out, pieces = {}, {}
        for name, tensor in state.items():
            own, part = target(name)
            if part is None:
                out[own] = tensor
            else:
                pieces.setdefault(own, {})[part] = tensor
        for own, parts in pieces.items():
            count = 1 + max(expert for expert, _ in parts)
            projs = ("down_proj",) if own.endswith("down_proj") else ("gate_proj", "up_proj")
            missing = [f"{e}.{p}" for e in range(count) for p in projs if (e, p) not in parts]
            if missing:
                raise ValueError(f"{own}: expert tensors missing from the checkpoint: {', '.join(missing[:8])}")
            out[own] = torch.stack([torch.cat([parts[(e, p)] for p in projs]) for e in range(count)])
        return out


ADAPTER = HubAdapter()
