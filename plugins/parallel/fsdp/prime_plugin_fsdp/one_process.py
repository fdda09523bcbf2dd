"""Mixed precision in one process, without FSDP.

FSDP reaches bf16 compute over fp32 master weights through its collectives, which in one
process are copies: every step each weight goes through the all-gather's buffers (cast on the
way in) and each gradient through the reduce-scatter's (cast again), 16 ms of a 256 ms step
for the 1.7B shape on an H200 where the two casts alone take about 4. Here the casts are all
that is left.

Each trainable parameter has two tensors:

- its **master** (``optimization_dtype``), registered in the model whenever it is not
  computing: what the optimizer was built over and steps, what gradient clipping reads, what
  checkpoints hold and what is published, exactly as under FSDP;
- its **compute copy** (``dtype``), registered from the first forward pass after an optimizer
  step until ``before_step``. The blocks (compiled, recomputed by activation checkpointing)
  only ever see the copies. When autograd has accumulated a copy's gradient, the gradient is
  taken from it: a single micro-batch's stays in the compute dtype; from a second
  micro-batch on they are summed in the master dtype, as FSDP's ``reduce_dtype = "float32"``
  sums them.

The update (``update``, the trainer's ``Applied.update`` hook): with AdamW on a GPU, one
kernel clips, steps the masters from the gradients as they are held and writes the new
compute copies (``adamw``: 30 bytes a parameter moved where the unfused path moves 52).
Otherwise (another optimizer, optimizer state offloaded, no GPU) the gradients are cast to the
master dtype into the masters' ``grad`` and the trainer clips and steps as usual.

The copies are refreshed from the masters on every switch to computing, unless the fused
update wrote them and no master changed since (their versions say so), so nothing that
changes the masters between steps (a checkpoint load) can leave them stale. A forward pass
without gradients switches back to the masters when it returns (so it belongs between
steps, not between a step's forward and backward passes).
Frozen parameters (a LoRA run's base weights) never change: they are held in the
compute dtype alone.

The copies of every weight are held for the whole step, like FSDP's
``reshard_after_forward = false``: 2 bytes a parameter more than FSDP's default.

With bfloat16 as both the compute and the optimization dtype there is nothing to cast, and
FSDP in one process would only copy every weight into its gather buffer and every gradient
through its reduction (and hold a second copy of the weights). The model then keeps its own
parameters (``PlainWeights``), and AdamW on a GPU steps them in place in one kernel with the
norm and the clip (``adamw``).
"""

from __future__ import annotations


def usable(model, *, config, world) -> bool:
    """Whether this run gets mixed precision without FSDP (``chosen``), no parameter being
    sharded by another strategy."""
    from torch.distributed.tensor import DTensor

    return chosen(config, world.size) and not any(isinstance(p, DTensor) for p in model.parameters())


def chosen(config, processes: int) -> bool:
    """One process and no CPU offload; bfloat16 weights without a master (``plain``), or
    compute and master dtypes differing with ``reshard_after_forward`` not set to ``true``
    (FSDP's block-by-block copies, less memory)."""
    if processes != 1 or config.fsdp_cpu_offload:
        return False
    asked_reshard = "reshard_after_forward" in config.model_fields_set and config.reshard_after_forward
    return plain(config) or (config.dtype != config.optimization_dtype and not asked_reshard)


def plain(config) -> bool:
    """Whether the model keeps its own bfloat16 parameters, no master (``PlainWeights``)."""
    return config.dtype == config.optimization_dtype == "bfloat16"


def apply(model, *, config, world):
    import torch

    from prime_core.specs import Applied

    model.to(world.device)
    if plain(config):
        weights = PlainWeights(model)
        return Applied(model, before_backward=weights.before_backward, update=weights.update)
    weights = MasterWeights(model, getattr(torch, config.dtype))
    model.register_forward_pre_hook(weights.compute)
    model.register_forward_hook(weights.after_forward)
    return Applied(model, before_backward=weights.before_backward, before_step=weights.before_step,
                   update=weights.update)


class FusedUpdate:
    """What ``adamw.step`` reads besides the masters and the compute copies: each master's
    index, the host's step counts, the launch grids, the gradients' squares taken in the last
    backward pass; and whether each optimizer's update is fused (said once, on a GPU)."""

    def __init__(self) -> None:
        from prime_plugin_fsdp.adamw import StepCounts
        from prime_plugin_fsdp.norms import GradientNorms

        self.masters: list = []
        self.copies: list = []
        self.index_of: dict[int, int] = {}
        self.fused: dict[int, str | None] = {}  # per optimizer: why its update is not fused (None: it is)
        self.step_counts = StepCounts()
        self.norms = GradientNorms(self.masters)
        self._grid: dict = {}

    def before_backward(self, _model, last: bool) -> None:
        """``Applied.before_backward``: the norm's squares are taken in the step's last backward
        pass once the update is known to be fused (from the second step on)."""
        self.norms.arm(last and bool(self.fused) and all(why is None for why in self.fused.values()))

    def fusable(self, optimizer, what: str) -> bool:
        from prime_plugin_fsdp import adamw

        key = id(optimizer)
        if key not in self.fused:
            self.fused[key] = adamw.why_not(self, optimizer)
            if self.masters and self.masters[0].device.type == "cuda":
                import logging

                logging.getLogger("prime.fsdp").info(f"{what}: AdamW fused" if self.fused[key] is None
                                                     else f"{what}: unfused update ({self.fused[key]})")
        return self.fused[key] is None

    def step_grid(self, block: int):
        """The fused update's launch grid over the masters (``adamw.grid``), built once."""
        if block not in self._grid:
            from prime_plugin_fsdp.adamw import grid

            self._grid[block] = grid([m.numel() for m in self.masters], block, self.masters[0].device)
        return self._grid[block]


class PlainWeights(FusedUpdate):
    """The model's own trainable parameters, stepped in place (module docstring)."""

    def __init__(self, model) -> None:
        super().__init__()
        for param in model.parameters():  # each once: tied parameters are one
            if param.requires_grad and param.is_floating_point():
                self.index_of[id(param)] = len(self.masters)
                param.register_post_accumulate_grad_hook(self._taker(len(self.masters)))
                self.masters.append(param)

    def _taker(self, index: int):
        def take(param) -> None:
            self.norms.take(index, param.grad)

        return take

    def update(self, _model, optimizer, max_norm: float | None):
        """``Applied.update``: AdamW fused over the parameters where it can be, returning the
        norm; otherwise ``None`` lets the trainer clip and step."""
        if not self.fusable(optimizer, "bf16 weights"):
            return None
        from prime_plugin_fsdp import adamw

        gradients = [p.grad for p in self.masters]
        for param in self.masters:
            param.grad = None
        return adamw.step(self, optimizer, max_norm, gradients)


class MasterWeights(FusedUpdate):
    """The masters, their compute copies and where each is registered (module docstring)."""

    def __init__(self, model, compute_dtype) -> None:
        import torch

        super().__init__()
        self.slots = []  # (module, name, index)
        index_of, frozen = self.index_of, {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                if not param.requires_grad or not param.is_floating_point():
                    if param.is_floating_point():
                        key = id(param)
                        if key not in frozen:
                            frozen[key] = torch.nn.Parameter(param.detach().to(compute_dtype), requires_grad=False)
                        module._parameters[name] = frozen[key]
                    continue
                index = index_of.get(id(param))
                if index is None:  # tied parameters (embeddings and LM head) are one master
                    index = index_of[id(param)] = len(self.masters)
                    copy = torch.nn.Parameter(param.detach().to(compute_dtype))
                    copy.register_post_accumulate_grad_hook(self._accumulator(index))
                    self.masters.append(param)
                    self.copies.append(copy)
                self.slots.append((module, name, index))
        self.grads = [None] * len(self.masters)  # in the master dtype
        self.pending = [None] * len(self.masters)  # one micro-batch's, in the compute dtype
        self.computing = False
        self.fresh: list | None = None  # the masters' versions when the fused update wrote the copies

    def _accumulator(self, index: int):
        def accumulate(copy) -> None:
            grad, copy.grad = copy.grad, None
            held = self.grads[index]
            if held is not None:
                held.add_(grad)
            elif self.pending[index] is None:
                self.pending[index] = grad  # converted with all the others in before_step
            else:  # a second micro-batch: from now on the sum is in the master dtype
                held = self.grads[index] = self.pending[index].to(self.masters[index].dtype)
                self.pending[index] = None
                held.add_(grad)
            self.norms.take(index, held if held is not None else self.pending[index])

        return accumulate

    def _register(self, tensors) -> None:
        for module, name, index in self.slots:
            module._parameters[name] = tensors[index]

    def compute(self, *_) -> None:
        """Before a forward pass: the copies, refreshed from the masters, go into the model.
        After the fused update, which wrote them as it stepped the masters, they are refreshed
        only if a master changed since (a checkpoint load's in-place copy raises its version)."""
        if self.computing:
            return
        import torch

        if self.fresh is None or self.fresh != self._versions():
            with torch.no_grad():
                torch._foreach_copy_(self.copies, self.masters)
        self.fresh = None
        self._register(self.copies)
        self.computing = True

    def _versions(self) -> list:
        return [(m._version, m.data_ptr()) for m in self.masters]

    def after_forward(self, *_) -> None:
        """A pass without gradients has no backward to wait for: back to the masters."""
        import torch

        if not torch.is_grad_enabled():
            self._register(self.masters)
            self.computing = False

    def before_step(self, _model=None) -> None:
        """After the step's backward passes: the masters go back into the model for the update
        and whatever reads it next. Their gradients stay here for ``update``."""
        self._register(self.masters)
        self.computing = False

    def update(self, _model, optimizer, max_norm: float | None):
        """The step's update (``Applied.update``): AdamW fused over the masters where it can be
        (``adamw``), returning the norm; otherwise the gradients go to the masters' ``grad``
        and ``None`` lets the trainer clip and step."""
        from prime_plugin_fsdp import adamw

        if not self.fusable(optimizer, "master weights"):
            self.take_gradients()
            return None
        gradients = [held if held is not None else pending for held, pending in zip(self.grads, self.pending,
                                                                                   strict=True)]
        self.grads, self.pending = [None] * len(self.masters), [None] * len(self.masters)
        norm = adamw.step(self, optimizer, max_norm, gradients)
        self.fresh = self._versions()
        return norm

    def take_gradients(self) -> None:
        """The step's gradients into the masters' ``grad``, in the master dtype."""
        self._convert_pending()
        for master, grad in zip(self.masters, self.grads, strict=True):
            master.grad = grad
        self.grads = [None] * len(self.masters)

    def _convert_pending(self) -> None:
        """The gradients of one micro-batch, cast a chunk at a time, each in one multi-tensor
        copy into one buffer (twice as fast as a cast per gradient as it is computed, and the
        backward pass holds them in the compute dtype). Each chunk's sources are freed before
        the next is cast, so the cast adds one chunk to the peak, not a copy of every gradient."""
        chunk: list[int] = []
        size = 0
        for index, grad in enumerate(self.pending):
            if grad is None:
                continue
            chunk.append(index)
            size += grad.numel()
            if size >= CHUNK_ELEMENTS:
                self._convert(chunk)
                chunk, size = [], 0
        if chunk:
            self._convert(chunk)

    def _convert(self, indices: list[int]) -> None:
        import torch

        sources = [self.pending[i] for i in indices]
        flat = torch.empty(sum(g.numel() for g in sources), dtype=self.masters[indices[0]].dtype,
                           device=sources[0].device)
        views = [part.view(g.shape) for part, g in zip(flat.split([g.numel() for g in sources]), sources,
                                                             strict=True)]
        torch._foreach_copy_(views, sources)
        for i, view in zip(indices, views, strict=True):
            self.grads[i] = view
            self.pending[i] = None


CHUNK_ELEMENTS = 1 << 26
"""Gradient elements cast together before the step (256 MiB in float32)."""
