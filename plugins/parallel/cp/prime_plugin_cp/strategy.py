"""The ``cp`` parallel strategy: every attention kernel of the model becomes a CP kernel.

Native models (``impl = "custom"``) keep their attention kernel in ``attention_fn`` on every
attention module (``prime_core.trainer.packing`` has the contract). The core splits each
packed row across the CP ranks and calls the model with the rank's tokens; ``apply`` wraps
each ``attention_fn`` so that attention still covers the whole row: ``ring`` passes keys and
values around the CP group and runs its block kernel (torch's cuDNN attention and flash
varlen on GPUs in bf16, the eager float32 reference elsewhere: ``cp_ring_kernel``; the model's
own kernel is not used), ``ulysses`` exchanges heads for tokens and runs the model's own kernel on whole rows.
"""

from __future__ import annotations


class CPAttention:
    """An ``attention_fn(q, k, v, packing, scale)`` over the tokens of a whole CP group."""

    def __init__(self, style: str, group, inner, ring_kernel: str = "auto") -> None:
        self.style, self.group, self.inner, self.ring_kernel = style, group, inner, ring_kernel

    def __call__(self, q, k, v, packing, scale):
        if self.style == "ring":
            from prime_plugin_cp.ring import ring_attention

            return ring_attention(q, k, v, packing, scale, self.group, kernel=block_kernel(self.ring_kernel, q))
        from prime_plugin_cp.ulysses import ulysses_attention

        return ulysses_attention(q, k, v, packing, scale, self.group, self.inner)

    def __repr__(self) -> str:
        return f"CPAttention({self.style}, inner={self.inner!r})"


def block_kernel(setting: str, q):
    """The ring's ``BlockKernel`` for ``trainer.model.cp_ring_kernel`` and these queries."""
    from prime_plugin_cp.block import EAGER

    if setting == "eager":
        return EAGER
    kernels = _fused_kernels(q)
    if setting == "auto":
        for name in ("cudnn", "flash") if _hopper(q) else ("flash",):
            kernel, reason = kernels[name]
            if reason is None:
                return kernel
        return EAGER
    kernel, reason = kernels[setting]
    if reason is not None:
        raise ValueError(f"trainer.model.cp_ring_kernel = {setting!r} cannot run here: {reason}; set it to 'auto' "
                         "or 'eager'")
    return kernel


def _fused_kernels(q) -> dict:
    """``{name: (kernel, why it cannot run on q or None)}``."""
    from prime_plugin_cp.cudnn_block import CUDNN, cudnn_unavailable
    from prime_plugin_cp.flash_block import FLASH, unavailable

    return {"flash": (FLASH, unavailable(q)), "cudnn": (CUDNN, cudnn_unavailable(q))}


def _hopper(q) -> bool:
    """cuDNN's attention is measured faster than flash-attention 2 on Hopper (H100/H200)."""
    import torch

    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9


def cp_group(mesh, world, cp: int):
    """The CP process group from the mesh the core passes."""
    if mesh is None:
        raise RuntimeError(f"trainer.model.cp = {cp}: the core passed no 'cp' device mesh to the cp strategy "
                           "(it builds one for strategies whose mesh_dims name 'cp')")
    names = mesh.mesh_dim_names or ()
    size = mesh.size(names.index("cp")) if "cp" in names else mesh.size()
    if size != cp:
        raise ValueError(f"trainer.model.cp = {cp} but the CP device mesh has {size} ranks")
    return mesh.get_group("cp") if "cp" in names else mesh.get_group()


def apply(model, *, mesh, config, world):
    import torch

    targets = [(name, module) for name, module in model.named_modules() if hasattr(module, "attention_fn")]
    if not targets:
        raise ValueError(
            f"trainer.model.cp = {config.cp} needs a model implementation whose attention modules expose "
            f"attention_fn (the CP contract in prime_core.trainer.packing); {type(model).__name__} has none: "
            "use impl = 'custom'")
    if config.cp_style == "ring" and config.cp_ring_kernel in ("flash", "cudnn"):
        device = getattr(world.device, "type", str(world.device))
        if device != "cuda" or config.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"trainer.model.cp_ring_kernel = {config.cp_ring_kernel!r} needs a GPU computing in "
                             f"bfloat16 or float16 (this run: {device}, {config.dtype}); set it to 'auto' or 'eager'")
    group = cp_group(mesh, world, config.cp)
    for name, module in targets:
        inner = module.attention_fn
        if isinstance(inner, CPAttention):
            raise RuntimeError(f"{name}.attention_fn is already context-parallel (cp applied twice)")
        if isinstance(inner, torch.nn.Module):
            raise TypeError(f"{name}.attention_fn is a module ({type(inner).__name__}); the cp strategy wraps a "
                            "plain function and would move its parameters")
        module.attention_fn = CPAttention(config.cp_style, group, inner, config.cp_ring_kernel)
    return model
