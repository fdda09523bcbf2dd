"""Load a published Hugging Face folder into the live model, in place.

In place matters: the continuous-batching manager (and its CUDA graphs) holds the model's
parameter tensors, so new values are copied into them and no tensor is ever replaced.

Loading has two halves so that generation pauses only for the second: ``stage`` reads and
checks the folder (keys, shapes) into host memory while the model keeps serving, and
``apply`` copies the staged tensors in (host to device: tens of milliseconds per GB on a GPU).
A wrong folder fails in ``stage`` and leaves the served weights untouched. Two ways to read:

- its safetensors keys are the model's own (dense models such as Qwen3, Llama): tensors are
  read one by one, into pinned memory when the model is on a GPU;
- otherwise (checkpoint layouts transformers converts while loading, e.g. per-expert MoE
  weights it fuses): transformers loads the folder into a second model on the CPU, with its
  own conversions, and that model's tensors are staged.
"""

from __future__ import annotations

from pathlib import Path

WEIGHT_FILES = "*.safetensors"


class WeightsError(ValueError):
    """The folder cannot be served by this model; nothing was changed."""


def check_folder(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``; refuses a missing folder, a LoRA adapter and a folder
    without weights."""
    if not folder.is_dir():
        raise WeightsError(f"weights folder not found on the inference server: {folder}")
    if (folder / "adapter_config.json").exists():
        raise WeightsError(f"{folder} is a LoRA adapter; the transformers backend serves full weights only "
                           "(train without trainer.model.lora, or serve with the vllm backend)")
    files = sorted(folder.glob(WEIGHT_FILES))
    if not files:
        raise WeightsError(f"no weight files ({WEIGHT_FILES}) in {folder}; nothing was loaded")
    return files


def _targets(model) -> tuple[dict, dict[str, str]]:
    """The model's state-dict tensors by key, and for each key the first key holding the same
    tensor (tied weights such as ``lm_head.weight`` and ``model.embed_tokens.weight``)."""
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    alias = {}
    for key, tensor in state.items():
        alias[key] = first.setdefault(id(tensor), key)
    return state, alias


def _plan(state: dict, alias: dict[str, str], shapes: dict[str, tuple], folder: Path) -> dict[str, str]:
    """``{checkpoint key: model key}`` covering every model tensor, or ``WeightsError``."""
    unknown = sorted(set(shapes) - set(state))
    loaded_groups = {alias[k] for k in shapes if k in state}
    missing = sorted(k for k in state if alias[k] not in loaded_groups)
    if unknown or missing:
        raise WeightsError(f"{folder} does not match the served model: {len(missing)} of its tensors are missing "
                           f"({_some(missing)}) and {len(unknown)} are unknown ({_some(unknown)})")
    wrong = [f"{k}: {tuple(shapes[k])} instead of {tuple(state[k].shape)}" for k in shapes
             if tuple(shapes[k]) != tuple(state[k].shape)]
    if wrong:
        raise WeightsError(f"{folder} has tensors of other shapes than the served model "
                           f"(another model?): {'; '.join(wrong[:3])}")
    return {k: k for k in shapes}


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def read_shapes(files: list[Path]) -> dict[str, tuple]:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


class Staged:
    """A checked version's tensors, keyed by the model tensor each replaces: in host memory, or
    views of a buffer the trainer shares (``shared_weights``). ``step``: the version they are,
    where the source says (else the caller's)."""

    def __init__(self, tensors: dict, how: str, step: int | None = None) -> None:
        self.tensors, self.how, self.step = tensors, how, step


def stage(model, folder: Path, buffers: dict | None = None) -> Staged:
    """Read and check ``folder`` for ``model`` without touching the model (it may be serving).
    ``buffers``: host tensors kept from one load to the next (pinning gigabytes anew each time
    costs more than reading them)."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    files = check_folder(folder)
    state, alias = _targets(model)
    shapes = read_shapes(files)
    pin = next(model.parameters()).device.type == "cuda"
    if set(shapes) <= set(state):
        plan = _plan(state, alias, shapes, folder)
        tensors = {}
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    # a view of the mapped file: copied before it closes
                    tensors[plan[key]] = _host_copy(plan[key], f.get_tensor(key), buffers, pin)
        return Staged(tensors, "safetensors, staged, copied in place")
    converted = _converted(model, folder)
    plan = _plan(state, alias, {k: tuple(v.shape) for k, v in converted.items()}, folder)
    with torch.no_grad():
        tensors = {plan[k]: _host_copy(plan[k], v, buffers, pin) if pin else v for k, v in converted.items()}
    return Staged(tensors, "converted by transformers, staged, copied in place")


def _host_copy(key: str, tensor, buffers: dict | None, pin: bool):
    from prime_core.weights import host_copy

    if buffers is None:
        return tensor.pin_memory() if pin else tensor.clone()
    return host_copy(tensor, buffers, key, pin=pin)


def apply(model, staged: Staged) -> str:
    """Copy staged tensors into ``model`` (caller: the model is not in use). Returns how they
    were read, for the log."""
    import torch

    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, tensor in staged.tensors.items():
            state[key].copy_(tensor, non_blocking=True)
    _synchronize(str(next(model.parameters()).device))
    return staged.how


def _converted(model, folder: Path) -> dict:
    """The state dict transformers makes of ``folder`` for the served model's class (on the CPU)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
        loaded = type(model).from_pretrained(folder, config=config, dtype=model.dtype)
    except Exception as exc:  # transformers raises many kinds for an unreadable folder
        raise WeightsError(f"transformers cannot load {folder} as a {type(model).__name__}: "
                           f"{type(exc).__name__}: {exc}") from exc
    return {k: v for k, v in loaded.state_dict().items()}


def _synchronize(device: str) -> None:
    # The copies run on the default stream; the generation loop runs on its own stream.
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
