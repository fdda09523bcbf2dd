"""The trainer's fixed build order, owned by the core (DESIGN.md): the model implementation
builds the model, then the enabled strategy of each slot of ``prime_core.specs.SLOTS`` is
applied in order (LM head → adapters → quantization → expert parallel → context parallel →
checkpointing → activation offloading → compile → data parallel), then the weights are loaded
(or broadcast from rank 0) and the optimizer is built (``start_training``).

The core knows slots, not strategies: each ``ParallelStrategy`` says which slot it fills and
whether this run enables it, from its own keys of ``trainer.model``. The ``data_parallel``
slot is required with more than one trainer process; when it is enabled the model is built
in ``optimization_dtype`` and the strategy computes in ``dtype`` (mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prime_core.errors import PluginError
from prime_core.specs import SLOTS, Applied, ParallelStrategy
from prime_core.trainer.model import resolve_impl

DATA_PARALLEL = "data_parallel"


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
    before_backward: list = field(default_factory=list)
    """``hook(model, last)`` calls before each backward pass of a step (``Applied``)."""
    update: Any = None
    """``update(model, optimizer, max_norm)``: clips and steps in place of the trainer (``Applied``)."""
    param_device: str | None = None
    """Where a strategy keeps the parameters when not on the compute device (``Applied``)."""
    defaults: list = field(default_factory=list)
    """The ``prime_core.trainer.defaults.Choice`` items this build made for undecided keys."""


def device_type(world) -> str:
    """``cuda`` or ``cpu`` (``World.device`` may be a ``torch.device`` or its name)."""
    return getattr(world.device, "type", str(world.device).split(":")[0])


def decide_defaults(model_config, manager, world, impl_name: str, role: str, *, planning: bool = False):
    """``(trainer.model with its undecided keys decided, the choices)`` for ``world``'s device."""
    from prime_core.trainer.defaults import Context, impl_choice, resolve
    from prime_core.trainer.model import hf_config_of

    context = Context(device=device_type(world), role=role, impl=impl_name, dtype=model_config.dtype,
                      processes=world.size, hf_config=hf_config_of(model_config), planning=planning)
    first = impl_choice(model_config, impl_name)
    model_config, choices = resolve(model_config.model_copy(update={"impl": impl_name}), manager, context)
    return model_config, ([first] if first else []) + choices


def enabled_strategies(model_config, manager, world, *, reference: bool = False,
                       here: bool = True) -> list[ParallelStrategy]:
    """The strategies this run applies, in build order; ``reference`` keeps only those that
    change what the model computes (parity references). ``here = False`` (planning a run for
    other machines) does not ask whether they can run on this one."""
    by_slot: dict[str, list[ParallelStrategy]] = {}
    for provided in manager.registry("parallel_strategies").values():
        spec = provided.spec
        if reference and not spec.reference:
            continue
        if spec.enabled(model_config, world):
            by_slot.setdefault(spec.slot, []).append(spec)
    chosen = []
    for slot in SLOTS:
        specs = by_slot.get(slot, [])
        if len(specs) > 1:
            raise PluginError(f"the '{slot}' slot of the build order has {len(specs)} enabled strategies "
                              f"({', '.join(s.name for s in specs)}); turn all but one of them off")
        if specs:
            reason = specs[0].unavailable_reason() if here else None
            if reason:
                raise PluginError(f"the parallel strategy '{specs[0].name}' is turned on but cannot run here: {reason}")
            chosen.append(specs[0])
    if world.size > 1 and not reference and not any(s.slot == DATA_PARALLEL for s in chosen):
        raise PluginError(
            f"{world.size} trainer processes need a data-parallel strategy (the '{DATA_PARALLEL}' slot of the "
            "build order), and no installed plugin enables one",
            hint="install a data-parallel strategy plugin (`prime plugins list` shows what is installed), or run "
                 "one trainer process")
    return chosen


def parallel_dims(model_config, strategies: list[ParallelStrategy], world):
    """``ParallelDims`` from the degrees the strategies declare."""
    from prime_core.distributed import ParallelDims

    degrees: dict[str, int] = {}
    row_dim = None
    for spec in strategies:
        declared = spec.degrees(model_config) if spec.degrees is not None else {}
        degrees.update({dim: size for dim, size in declared.items() if size > 1})
        if spec.splits_rows and spec.mesh_dims:
            row_dim = spec.mesh_dims[-1]
    return ParallelDims(world.size, degrees, row_dim=row_dim)


def build_policy(model_config, manager, world, *, reference: bool = False, role: str = "trainer") -> Policy:
    """Build the policy, apply the enabled strategies in order, and place it on ``world.device``.

    With several processes only rank 0 loads the weights (on CPU); the others build the same
    model on the meta device, and after sharding every rank receives its shards from rank 0
    (``broadcast_from_rank0``), so the host holds one full copy, not one per process.

    ``reference`` builds the single-process parity reference: only the strategies that change
    what the model computes (``ParallelStrategy.reference``), no mesh.

    Keys left undecided are decided first, for this device (``prime_core.trainer.defaults``),
    and rank 0 prints the choices."""
    from prime_core.hub import loading

    impl = resolve_impl(model_config, manager)
    model_config, choices = decide_defaults(model_config, manager, world, impl.name, role)
    if world.main and not reference:
        from prime_core.trainer.defaults import Context, announce

        print(announce(choices, Context(device_type(world), role, impl.name, model_config.dtype, world.size)),
              flush=True)
    strategies = enabled_strategies(model_config, manager, world, reference=reference)
    data_parallel = any(s.slot == DATA_PARALLEL for s in strategies)
    world.dims = parallel_dims(model_config, strategies, world)
    world.dims.build(world, [s.mesh_dims for s in strategies])
    # The data-parallel strategy keeps master weights in optimization_dtype and computes in
    # dtype; without it the parameters are simply held in dtype.
    build_dtype = model_config.optimization_dtype if data_parallel else model_config.dtype
    meta = world.size > 1 and not world.main
    with loading(model_config.name, "model.name"):
        model = impl.build(model_config.model_copy(update={"dtype": build_dtype}), device="meta" if meta else "cpu")
    policy = Policy(model=model, impl=impl.name, hf_config=getattr(model, "config", None), defaults=choices)
    if policy.hf_config is not None:
        policy.hf_config.dtype = model_config.dtype  # what published checkpoints hold
    # Rank 0's full tensors, taken before any strategy slices them (EP keeps a part of the
    # experts on each rank); every rank gets its part from them once the model is sharded.
    original = model.state_dict() if world.size > 1 and world.main else None
    full = None
    for spec in strategies:
        if spec.slot == DATA_PARALLEL and original is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            # LoRA renames the layers it wraps; what it adds or renames is whole on rank 0 already.
            full = {key: original.get(_clean(key), value) for key, value in get_model_state_dict(policy.model).items()}
        mesh = world.dims.mesh(spec.mesh_dims) if spec.mesh_dims else None
        result = spec.apply(policy.model, mesh=mesh, config=model_config, world=world)
        if isinstance(result, Applied):
            policy.exporter = result.exporter or policy.exporter
            if result.before_step is not None:
                policy.before_step.append(result.before_step)
            if result.before_backward is not None:
                policy.before_backward.append(result.before_backward)
            if result.update is not None:
                if policy.update is not None:
                    raise PluginError(f"the parallel strategy '{spec.name}' and an earlier one both replace the "
                                      "optimizer step (Applied.update); turn one of them off")
                policy.update = result.update
            policy.param_device = result.param_device or policy.param_device
            result = result.model
        policy.model = result
        policy.applied.append(spec.name)
    if not data_parallel:
        policy.model.to(world.device)
    elif world.size > 1:
        _broadcast_weights(policy.model, full, world, offloaded=policy.param_device == "cpu")
    return policy


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


def full_state_dict(policy: Policy, world, *, into: dict | None = None, on_device: bool = False) -> dict | None:
    """What is published: full (unsharded) tensors with Hugging Face names, on CPU, on rank 0
    (``None`` elsewhere). Every rank must call it: gathering is collective. ``into``: host
    buffers kept from one call to the next (pinned for a GPU model), which the tensors are
    copied into, for a publish that runs while the next step trains; without it a model on the
    CPU hands out its own parameters. ``on_device``: the tensors stay on the trainer's device
    (a transport with ``device_tensors``; some are the live parameters)."""
    import torch

    if policy.exporter is not None:
        return policy.exporter(policy.model, world)
    from torch.distributed.tensor import DTensor

    dtype = getattr(torch, str(getattr(policy.hf_config, "dtype", "float32")).replace("torch.", ""))
    state, device_copies = {}, False
    for key, value in policy.model.state_dict().items():
        value = value.detach()
        if isinstance(value, DTensor):  # sharded (FSDP, EP, ...): gathered one tensor at a time
            if value.device.type != value.device_mesh.device_type:  # offloaded shards gather on the mesh's device
                value = value.to(value.device_mesh.device_type)
            value = value.full_tensor()  # collective: every rank, in the same order
        if not world.main:
            continue
        if value.is_floating_point():  # cast where the tensor is: fewer bytes cross to the host
            value = value.to(dtype)
        device_copies |= value.is_cuda
        state[key] = value if on_device else _to_host(key, value, into)
    if device_copies and into is not None:
        torch.cuda.synchronize()  # the copies into pinned buffers are asynchronous
    return clean_names(state) if world.main else None


def _to_host(key: str, value, into: dict | None):
    from prime_core.weights import host_copy

    if into is None:
        return value.to("cpu")  # a CPU model's own tensor when it needs no cast
    return host_copy(value, into, key, pin=value.is_cuda)


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
    pass_tokens: int = 1
    """``trainer.model.pass_tokens``: rows up to this many tokens in all go through one pass."""


def start_training(config, role: str, *, max_steps: int | None, seed: int, manager) -> Training:
    """Join the process group, send each rank's output to ``logs/<role>/rank_N.log``, build the
    policy, optimizer and learning-rate schedule."""
    from pathlib import Path

    import torch

    from prime_core import distributed
    from prime_core.trainer.optim import build_optimizer, build_scheduler

    world = distributed.init(getattr(config, "dist_timeout_seconds", None))
    torch.set_float32_matmul_precision(getattr(config, "matmul_precision", "highest"))
    distributed.log_per_rank(world, Path(config.output_dir) / "logs" / role)
    torch.manual_seed(seed)
    policy = build_policy(config.model, manager, world, role=role)
    policy.model.train()
    optimizer = build_optimizer(policy.model, config.optim, cpu_offload=config.model.optim_cpu_offload)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    return Training(world=world, policy=policy, optimizer=optimizer, scheduler=scheduler,
                    pass_tokens=config.model.pass_tokens)
