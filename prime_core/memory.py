"""Predicted peak GPU memory of one trainer process, before anything is launched
(``prime plan``, and the warning ``prime run`` prints when a run will not fit).

The model is built on the meta device (no weights read, no memory), which gives every
parameter's size and place; an ``Estimate`` then goes through the trainer's build order like
the model itself: the model implementation describes what one block keeps for its backward
pass per token (``ModelImpl.memory``, a ``BlockProfile`` per block), and every enabled
strategy whose spec has a ``memory`` hook (``ParallelStrategy.memory(estimate, config)``)
changes what it changes: FSDP shards the states and adds its gathered copies, EP splits the
experts, CP splits the tokens, AC replaces a block's activations by its input, compile makes
them smaller, the fused LM head replaces the logits. The core knows only what it owns itself:
master weights and their dtype, AdamW's state, ``optim_cpu_offload``, and the vanilla LM
head (logits, their gradient and the chunked log-softmax of ``prime_core.trainer.model``).

The peak is the largest of three moments of a step (allocator bytes, as ``--bench`` reports
``peak memory`` on GPUs):

- ``backward``: the start of the last row's backward pass. Parameters and optimizer state
  held on the GPU, the gradients of earlier rows (a step of several rows per rank), every
  block's saved activations, buffers, and the larger of the LM head's backward and one block's
  backward (its recomputation under AC);
- ``gradients``: the end of the backward pass: parameters, optimizer state, all gradients and
  the reduce buffers of the last gradients reduced;
- ``optimizer``: the update, with the optimizer state on the GPU even when it is offloaded
  between steps.

Calibrated against the single-GPU rows measured on an H200 (``docs/trainer.md``;
``tests/test_memory_plan.py`` compares every recorded row).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GIB = float(1 << 30)
PHASES = ("backward", "gradients", "optimizer")
ALLOCATOR_HEADROOM = (1.05, 1.5 * GIB)
"""A run fits when ``peak × 1.05 + 1.5 GiB`` is within the device: the allocator's cache
above the bytes it hands out, the CUDA context and NCCL's buffers, none of which the
allocator's peak counts."""
CHUNK_ELEMENTS = 1 << 28
"""``prime_core.trainer.model.CHUNK_ELEMENTS``: logit elements per float32 chunk of the
vanilla log-softmax (kept equal; the test of this module checks it)."""


@dataclass
class Param:
    """One parameter of the model as this rank holds it."""

    numel: int
    """Its full size."""
    trainable: bool = True
    block: int | None = None
    """The transformer block holding it (``None``: embeddings, final norm, LM head)."""
    shards: int = 1
    """How many ways this rank's copy is split (EP and FSDP multiply it)."""
    dim: str | None = None
    """The parallel degree a strategy split it over before data parallelism (``ep``)."""

    @property
    def held(self) -> float:
        return self.numel / self.shards


@dataclass
class BlockProfile:
    """What one transformer block keeps for its backward pass, in bytes per token of the
    row (in the run's compute dtype), as its model implementation computes it.

    ``parts``: by part of the block (``norm``, ``qk_norm``, ``attn_proj``, ``attention``,
    ``mlp_proj``, ``mlp``, ``router``, ...), eagerly; ``compiled``: the same under
    ``torch.compile`` (fused element-wise chains save less); ``input``: the block's input
    (what full activation checkpointing keeps); ``backward``: the gradients in flight while
    its backward runs; ``targets``: for each selective-checkpointing target (the ac plugin's
    names), the parts it covers and the bytes it keeps when recomputed (its inputs)."""

    parts: dict[str, float]
    compiled: dict[str, float]
    input: float
    backward: float
    targets: dict[str, tuple[tuple[str, ...], float]] = field(default_factory=dict)


@dataclass
class BlockMemory:
    """One block's activations as the strategies leave them (bytes per token); the rules in
    ``Estimate.rules`` change it, the core sums it."""

    index: int
    profile: BlockProfile
    parts: dict[str, float]
    gpu: float
    cpu: float = 0.0
    transient: float = 0.0


@dataclass
class Estimate:
    """Everything the prediction is made of, built in the trainer's build order."""

    model: Any
    """The model on the meta device (strategies may look at its modules)."""
    config: Any
    """``trainer.model``."""
    processes: int
    tokens: int
    """Tokens of the longest packed row one forward pass of this rank computes."""
    rows: int
    """Packed rows one rank computes per optimizer step."""
    hidden: int
    vocab: int
    compute_bytes: int
    master_bytes: int
    optimizer_states: int
    """Tensors of optimizer state per parameter (AdamW: 2)."""
    params: dict[str, Param]
    blocks: list[BlockProfile]
    degrees: dict[str, int] = field(default_factory=dict)
    """Parallel degrees above 1 (``ParallelDims``): ``{"ep": 4, "cp": 2, ...}``."""
    data_parallel: bool = False
    compiled: bool = False
    states: dict[str, str] = field(default_factory=lambda: {"parameters": "gpu", "gradients": "gpu",
                                                            "optimizer": "gpu"})
    optimizer_in_step: bool = False
    """The optimizer state comes to the GPU for the update (``optim_cpu_offload``)."""
    rules: list[Callable[[BlockMemory], None]] = field(default_factory=list)
    """Applied to every block's ``BlockMemory`` in build order, after every hook ran."""
    lm_head: Callable[[Estimate], float] | None = None
    """GPU bytes of the LM head's backward (at the start of the backward pass)."""
    lm_head_name: str = "vanilla (logits)"
    buffers: dict[str, tuple[float, tuple[str, ...]]] = field(default_factory=dict)
    """Other GPU bytes by name, with the phases they are alive in."""
    cpu: dict[str, float] = field(default_factory=dict)
    """Host bytes by name (offloaded state, activations)."""
    notes: list[str] = field(default_factory=list)

    def add_buffer(self, name: str, nbytes: float, phases: tuple[str, ...] = PHASES) -> None:
        self.buffers[name] = (float(nbytes), tuple(phases))

    def held(self, *, trainable: bool | None = None, block: int | None | str = "any") -> float:
        """Elements of the parameters this rank holds (after sharding)."""
        return sum(p.held for p in self.params.values()
                   if (trainable is None or p.trainable == trainable) and (block == "any" or p.block == block))

    def block_numel(self) -> list[int]:
        """Full (unsharded by data parallelism) elements of each block's parameters: what a
        gathered block holds (EP's split kept)."""
        sizes = [0] * len(self.blocks)
        for p in self.params.values():
            if p.block is not None:
                sizes[p.block] += p.numel // (self.degrees.get(p.dim, 1) if p.dim else 1)
        return sizes


@dataclass
class Prediction:
    """The result: GPU bytes per term and phase, the peak and where it happens."""

    terms: dict[str, float]
    phases: dict[str, float]
    cpu: dict[str, float]
    notes: list[str]
    lm_head: str
    tokens: int
    rows: int
    processes: int

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def needs(self) -> float:
        """Device bytes the peak needs, with the allocator's headroom."""
        factor, extra = ALLOCATOR_HEADROOM
        return self.peak * factor + extra


# ------------------------------------------------------------------ building an estimate


def dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[str(name).replace("torch.", "")]


def start(model, model_config, *, processes: int, tokens: int, rows: int, data_parallel: bool,
          blocks: list[BlockProfile], degrees: dict[str, int] | None = None) -> Estimate:
    """The estimate before any strategy: every parameter whole, in the master dtype."""
    from prime_core.trainer.model import transformer_blocks

    config = getattr(model, "config", None)
    block_of = {}
    try:
        for index, block in enumerate(transformer_blocks(model)):
            for param in block.parameters():
                block_of[id(param)] = index
    except ValueError:
        pass
    params = {}
    for name, param in model.named_parameters():  # shared (tied) parameters once
        params[name] = Param(param.numel(), param.requires_grad, block_of.get(id(param)))
    compute = dtype_bytes(model_config.dtype)
    master = dtype_bytes(model_config.optimization_dtype) if data_parallel else compute
    return Estimate(model=model, config=model_config, processes=processes, tokens=tokens, rows=rows,
                    hidden=int(getattr(config, "hidden_size", 0) or 0),
                    vocab=int(getattr(config, "vocab_size", 0) or 0),
                    compute_bytes=compute, master_bytes=master, optimizer_states=0, params=params, blocks=blocks,
                    degrees=dict(degrees or {}), data_parallel=data_parallel, lm_head=vanilla_lm_head)


def vanilla_lm_head(est: Estimate) -> float:
    """The logits ``[tokens, vocab]`` in the compute dtype, saved for backward, and their
    gradient, plus two float32 chunks of the chunked log-softmax (``token_logprob_fn``)."""
    logits = est.tokens * est.vocab
    return 2.0 * logits * est.compute_bytes + 2.0 * min(logits, CHUNK_ELEMENTS) * 4


def evaluate(est: Estimate) -> Prediction:
    """Sum the terms and the phases."""
    params = est.held() * est.master_bytes
    trainable = est.held(trainable=True)
    grads = trainable * est.master_bytes
    optimizer = trainable * est.master_bytes * est.optimizer_states
    on_gpu = {key: where == "gpu" for key, where in est.states.items()}
    cpu = dict(est.cpu)
    for key, size in (("parameters", params), ("gradients", grads), ("optimizer", optimizer)):
        if not on_gpu[key]:
            cpu[key] = cpu.get(key, 0.0) + size
    kept, transient = 0.0, 0.0
    for index, profile in enumerate(est.blocks):
        parts = dict(profile.compiled if est.compiled else profile.parts)
        block = BlockMemory(index, profile, parts, gpu=sum(parts.values()), transient=profile.backward)
        for rule in est.rules:
            rule(block)
        kept += block.gpu * est.tokens
        transient = max(transient, block.transient * est.tokens)
        if block.cpu:
            cpu["activations"] = cpu.get("activations", 0.0) + block.cpu * est.tokens
    head = est.lm_head(est) if est.lm_head else 0.0
    gpu_params = params if on_gpu["parameters"] else 0.0
    gpu_grads = grads if on_gpu["gradients"] else 0.0
    gpu_optimizer = optimizer if on_gpu["optimizer"] else 0.0

    def buffers(phase: str) -> float:
        return sum(size for size, phases in est.buffers.values() if phase in phases)

    earlier_rows = gpu_grads if est.rows > 1 else 0.0
    phases = {
        "backward": gpu_params + gpu_optimizer + earlier_rows + kept + max(head, transient) + buffers("backward"),
        "gradients": gpu_params + gpu_optimizer + gpu_grads + buffers("gradients"),
        "optimizer": (gpu_params + gpu_grads + (optimizer if on_gpu["optimizer"] or est.optimizer_in_step else 0.0)
                      + buffers("optimizer")) if on_gpu["parameters"] else buffers("optimizer"),
    }
    terms = {"parameters": gpu_params, "gradients": gpu_grads, "optimizer": gpu_optimizer,
             "activations": kept, "activations (one block's backward)": transient, "lm_head": head,
             **{name: size for name, (size, _) in est.buffers.items()}}
    return Prediction(terms=terms, phases=phases, cpu=cpu, notes=list(est.notes), lm_head=est.lm_head_name,
                      tokens=est.tokens, rows=est.rows, processes=est.processes)


# ------------------------------------------------------------------ a decoder block, counted


def decoder_block_profile(hf_config, compute_bytes: int, *, o_proj_copy: bool, moe: bool = False) -> BlockProfile:
    """What a Llama/Qwen-style decoder block (RMSNorm in float32, q/k norms where the config
    has them, GQA attention whose kernel saves q, k, v and its output, SwiGLU or a top-k MoE)
    keeps per token, counted tensor by tensor as autograd saves them. Model implementations
    call it with their particulars (``o_proj_copy``: the attention output is copied before
    ``o_proj``, as transformers' transpose and reshape do).

    Eager: each RMSNorm keeps its float32 input and its rounded output; the MLP keeps its
    input, the gate and up projections, the SiLU output and the product. Compiled: the norms
    keep their inputs, the SwiGLU its gate, up and product (Inductor fuses the rest and
    recomputes it in the backward pass)."""
    dt = compute_bytes
    f32 = max(4, dt)
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = getattr(hf_config, "num_key_value_heads", heads) * head_dim
    qk_norm = getattr(hf_config, "model_type", "").startswith("qwen3")
    parts = {
        "norm": 2 * (f32 + dt) * h,
        "qk_norm": (f32 + dt) * (q + kv) if qk_norm else 0.0,
        "attn_proj": dt * h + (dt * q if o_proj_copy else 0.0),
        "attention": dt * (2 * q + 2 * kv),
    }
    compiled = {"norm": 2 * dt * h, "qk_norm": dt * (q + kv) if qk_norm else 0.0,
                "attn_proj": parts["attn_proj"], "attention": parts["attention"]}
    targets = {"norm": (("norm", "qk_norm"), 2 * dt * h + (dt * (q + kv) if qk_norm else 0.0)),
               "attn_proj": (("attn_proj",), parts["attn_proj"]),
               "attention": (("attn_proj", "qk_norm", "attention"), dt * h)}
    if moe:
        k = hf_config.num_experts_per_tok
        inter = hf_config.moe_intermediate_size
        experts = hf_config.num_experts
        # The router in float32 (its input and probabilities), then per routed copy: the
        # dispatched rows, the gate/up output, SiLU's output, the product and the expert output
        # that the combine weighs.
        parts["router"] = f32 * (h + 2 * experts)
        parts["mlp_proj"] = k * dt * (h + inter + h)
        parts["mlp"] = k * dt * (3 * inter)
        compiled["router"] = parts["router"]
        compiled["mlp_proj"] = parts["mlp_proj"]
        compiled["mlp"] = parts["mlp"]
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            parts["mlp"] += dt * 4 * shared
            compiled["mlp"] += dt * 3 * shared
        backward = k * dt * (2 * inter + 2 * h)
    else:
        inter = hf_config.intermediate_size
        parts["mlp_proj"] = dt * (h + inter)
        parts["mlp"] = 3 * dt * inter
        compiled["mlp_proj"] = dt * h
        compiled["mlp"] = 3 * dt * inter
        backward = 3 * dt * inter
    targets["mlp_proj"] = (("mlp_proj",), parts["mlp_proj"])
    targets["mlp"] = (("mlp_proj", "mlp", "router"), dt * h)
    return BlockProfile(parts=parts, compiled=compiled, input=dt * h, backward=backward, targets=targets)


def generic_profiles(model, model_config) -> list[BlockProfile]:
    """For a model implementation without a ``memory`` hook: every block counted as a
    transformers decoder block (``decoder_block_profile``)."""
    from prime_core.trainer.model import transformer_blocks

    config = model.config
    moe = bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
    profile = decoder_block_profile(config, dtype_bytes(model_config.dtype), o_proj_copy=True, moe=moe)
    return [profile] * len(transformer_blocks(model))


# ------------------------------------------------------------------ the core's own terms


def core_terms(est: Estimate, trainer_config) -> None:
    """What the core owns: the optimizer's state (AdamW: two tensors per trainable parameter
    in the master dtype) and ``optim_cpu_offload`` (that state in host memory between steps,
    on the GPU for the update)."""
    optim = getattr(trainer_config, "optim", None)
    est.optimizer_states = 2 if optim is None or optim.type == "adamw" else 0
    if getattr(est.config, "optim_cpu_offload", False):
        est.states["optimizer"] = "cpu"
        est.optimizer_in_step = True


def rows_per_rank(batch_samples: int, groups: int) -> int:
    """Packed rows a rank computes per step, at most: one sample per row (the worst case for
    memory: gradients of earlier rows are held while the next rows run)."""
    return max(1, math.ceil(batch_samples / max(1, groups)))
