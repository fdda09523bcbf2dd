"""The trainer's fixed build order, owned by the core (DESIGN.md):

model impl → LoRA → expert parallel → context parallel → activation checkpointing →
activation offloading → compile → FSDP2 → optimizer (state on CPU if asked).

Each step past the model is a ``ParallelStrategy`` selected by name from the registry when
its config key is on. ``fsdp`` is the data-parallel strategy: required with more than one
trainer process, and applied to one process where it has work there (fp32 master weights
under bf16 compute, or CPU offload). One process computing in its master dtype skips it: FSDP
would only copy every weight and gradient once more per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prime_core.errors import PluginError
from prime_core.specs import Applied
from prime_core.trainer.model import attach_lm_head, resolve_impl

ORDER = ("lora", "ep", "cp", "ac", "ac_offloading", "compile", "fsdp")
KEYS = {"lora": "trainer.model.lora", "ep": "trainer.model.ep", "cp": "trainer.model.cp",
        "ac": "trainer.model.ac", "ac_offloading": "trainer.model.ac_offloading",
        "compile": "trainer.model.compile", "fsdp": "trainer.model"}


@dataclass
class Policy:
    model: Any
    impl: str
    applied: list[str] = field(default_factory=list)
    hf_config: Any = None
    exporter: Any = None
    """``exporter(model, world)``: what is published instead of the full weights (LoRA's
    ``Adapter``), set by the strategy that returned it."""
    before_step: list = field(default_factory=list)
    """``hook(model)`` calls before each gradient clipping and optimizer step (``Applied``)."""


def requested(model_config) -> list[str]:
    """Strategies the config turns on, in build order (``fsdp`` decided separately)."""
    on = {"lora": model_config.lora is not None, "ep": model_config.ep > 1, "cp": model_config.cp > 1,
          "ac": model_config.ac is not None, "ac_offloading": model_config.ac_offloading is not None,
          "compile": model_config.compile is not None}
    return [name for name in ORDER if on.get(name)]


def build_policy(model_config, manager, world, *, only: set[str] | None = None) -> Policy:
    """Build the policy, apply the strategies in order, and place it on ``world.device``.

    With several processes only rank 0 loads the weights (on CPU); the others build the same
    model on the meta device, and after sharding every rank receives its shards from rank 0
    (``broadcast_from_rank0``), so the host holds one full copy, not one per process.

    ``only`` limits the strategies to those named (parity tests build their single-process
    reference with ``only={"lora"}``: the model without the numerically transparent ones)."""
    from prime_core import distributed
    from prime_core.hub import loading

    strategies = manager.registry("parallel_strategies")
    names = [n for n in requested(model_config) if only is None or n in only]
    fsdp_has_work = (world.size > 1 or model_config.optimization_dtype != model_config.dtype
                     or model_config.fsdp_cpu_offload)
    use_fsdp = ("fsdp" in strategies and strategies["fsdp"].spec.unavailable_reason() is None
                and (only is None or "fsdp" in only) and fsdp_has_work)
    if world.size > 1 and not use_fsdp:
        raise PluginError(
            f"{world.size} trainer processes need a data-parallel strategy, and the 'fsdp' parallel "
            "strategy is not installed",
            hint="pip install prime-plugin-fsdp (or run one trainer process)",
        )
    impl = resolve_impl(model_config, manager)
    # FSDP keeps master weights in optimization_dtype and computes in dtype; without it the
    # parameters are simply held in dtype.
    build_dtype = model_config.optimization_dtype if use_fsdp else model_config.dtype
    meta = world.size > 1 and not world.main
    with loading(model_config.name, "model.name"):
        model = impl.build(model_config.model_copy(update={"dtype": build_dtype}), device="meta" if meta else "cpu")
    attach_lm_head(model, model_config, manager)
    policy = Policy(model=model, impl=impl.name, hf_config=getattr(model, "config", None))
    if policy.hf_config is not None:
        policy.hf_config.dtype = model_config.dtype  # what published checkpoints hold
    # Rank 0's full tensors, taken before any strategy slices them (EP keeps a part of the
    # experts on each rank); every rank gets its part from them once the model is sharded.
    original = model.state_dict() if world.size > 1 and world.main else None
    full = None
    for name in names + (["fsdp"] if use_fsdp else []):
        if name != "lora":
            _quantize(policy, model_config, manager)
        if name == "fsdp" and original is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            # LoRA renames the layers it wraps; what it adds or renames is whole on rank 0 already.
            full = {key: original.get(_clean(key), value) for key, value in get_model_state_dict(policy.model).items()}
        spec = manager.select("parallel_strategies", name, key=KEYS[name])
        mesh = distributed.mesh_for(world, spec.mesh_dims, model_config)
        result = spec.apply(policy.model, mesh=mesh, config=model_config, world=world)
        if isinstance(result, Applied):
            policy.exporter = result.exporter or policy.exporter
            if result.before_step is not None:
                policy.before_step.append(result.before_step)
            result = result.model
        policy.model = result
        policy.applied.append(name)
    _quantize(policy, model_config, manager)
    if not use_fsdp:
        policy.model.to(world.device)
    elif world.size > 1:
        _broadcast_weights(policy.model, full, world, offloaded=model_config.fsdp_cpu_offload)
    return policy


def _quantize(policy: Policy, model_config, manager) -> None:
    """``trainer.model.quantization = "fp8"``: the blocks' linear layers compute in FP8 (after
    LoRA, whose base layers it converts, and before every strategy that wraps or shards).
    Like LoRA it changes the model, so parity references get it too."""
    if model_config.quantization != "fp8" or "fp8" in policy.applied:
        return
    spec = manager.select("kernels", "fp8_linear:auto", key="trainer.model.quantization")
    if not spec.impl(policy.model):
        raise PluginError("trainer.model.quantization = 'fp8': the model has no block linear layers "
                          "(q_proj ... down_proj) to convert", hint="unset trainer.model.quantization")
    policy.applied.append("fp8")


def _broadcast_weights(model, full: dict | None, world, *, offloaded: bool) -> None:
    """Give the meta-built ranks their shards and buffers from rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not world.main:
        model.to_empty(device="cpu" if offloaded else world.device)
    elif not offloaded:
        _to_device(model, world.device)
    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (rotary frequencies) were never initialised on meta ranks.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def _to_device(model, device) -> None:
    """Move what FSDP did not (parameters another strategy owns) to ``device``."""
    import torch

    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and param.device != device:
                module._parameters[key] = torch.nn.Parameter(param.detach().to(device),
                                                             requires_grad=param.requires_grad)


def full_state_dict(policy: Policy, world) -> dict | None:
    """What is published: full (unsharded) tensors with Hugging Face names, on CPU, on rank 0
    (``None`` elsewhere). Every rank must call it: gathering is collective."""
    import torch

    if policy.exporter is not None:
        return policy.exporter(policy.model, world)
    if "fsdp" in policy.applied:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {key: value.detach().cpu() for key, value in policy.model.state_dict().items()}
    if not world.main:
        return None
    dtype = getattr(torch, str(getattr(policy.hf_config, "dtype", "float32")).replace("torch.", ""))
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in clean_names(state).items()}


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_offload_wrapped_module.")


def clean_names(state: dict) -> dict:
    """Drop the name parts wrappers add (checkpointing, compile, offloading)."""
    return {_clean(key): value for key, value in state.items()}


def _clean(key: str) -> str:
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return key


@dataclass
class Training:
    """Everything a training loop needs, built the same way by ``prime trainer`` and ``prime sft``."""

    world: Any
    policy: Policy
    optimizer: Any
    scheduler: Any


def start_training(config, role: str, *, max_steps: int | None, seed: int, manager) -> Training:
    """Join the process group, send each rank's output to ``logs/<role>/rank_N.log``, build the
    policy, optimizer and learning-rate schedule."""
    from pathlib import Path

    import torch

    from prime_core import distributed
    from prime_core.trainer.optim import build_optimizer, build_scheduler

    world = distributed.init()
    distributed.log_per_rank(world, Path(config.output_dir) / "logs" / role)
    torch.manual_seed(seed)
    policy = build_policy(config.model, manager, world)
    policy.model.train()
    optimizer = build_optimizer(policy.model, config.optim, cpu_offload=config.model.optim_cpu_offload)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    return Training(world=world, policy=policy, optimizer=optimizer, scheduler=scheduler)
