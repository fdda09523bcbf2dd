"""Building the model from a Hugging Face folder, and writing one back.

Weights are read tensor by tensor straight into the model's storage (an expert's pieces into
their slices of the stacked tensors), so loading holds one copy of the model, never two.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prime_plugin_custom.adapter import ADAPTER, TIED_HEAD, piece, target

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_BYTES = 5 * 1024**3
# Tensors some checkpoints carry that this implementation recomputes.
_IGNORED = (".rotary_emb.inv_freq",)


def weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX).is_file():
        shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{folder}: no safetensors weights (the custom implementation reads only "
                                "safetensors; convert the checkpoint or use trainer.model.impl = 'hf')")
    return found


def load_hf_weights(model, folder: str | Path) -> None:
    """Copy a Hugging Face checkpoint (hub layout, or stacked experts) into ``model``; every
    parameter and persistent buffer must be covered, and nothing may be left over."""
    from safetensors import safe_open

    folder = Path(folder)
    own = model.state_dict(keep_vars=True)
    tied = model.tied
    filled: set = set()
    unexpected = []
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                if name.endswith(_IGNORED) or (tied and name == TIED_HEAD):
                    continue
                dest_name, part = target(name)
                if dest_name not in own:
                    unexpected.append(name)
                    continue
                dest = own[dest_name] if part is None else piece(own[dest_name], part)
                tensor = reader.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, the model expects "
                                     f"{tuple(dest.shape)} (config.json does not match the weights?)")
                with torch.no_grad():
                    dest.copy_(tensor)
                filled.add((dest_name, part))
    missing = [name for name in own if not _covered(name, own[name], filled, tied)]
    if unexpected or missing:
        raise ValueError(f"{folder}: the checkpoint does not match {type(model).__name__} "
                         f"({getattr(model.family, 'architecture', '?')}): missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")


def _covered(name: str, tensor, filled: set, tied: bool) -> bool:
    if (name, None) in filled or (tied and name == TIED_HEAD):
        return True
    if name.endswith(".experts.down_proj"):
        return all((name, (e, "down_proj")) in filled for e in range(tensor.shape[0]))
    if name.endswith(".experts.gate_up_proj"):
        return all((name, (e, p)) in filled for e in range(tensor.shape[0]) for p in ("gate_proj", "up_proj"))
    return False


def save_hf(model, path: Path, state: dict | None = None, *, shard_bytes: int = SHARD_BYTES) -> None:
    """``model.save_pretrained``: config, generation config and weights in the hub layout."""
    from safetensors.torch import save_file

    from prime_core.trainer.build import clean_names

    if state is None:
        state = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in model.state_dict().items()}
    tensors = ADAPTER.to_hf(clean_names(state), tied=model.tied)
    path.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, shard_bytes)
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file = SINGLE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: _owned(tensors[name]) for name in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2, sort_keys=True) + "\n")
    model.config.save_pretrained(path)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(path)


def _shards(tensors: dict, limit: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage (the per-expert views of a stacked tensor).
    tensor = tensor.detach().cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor
