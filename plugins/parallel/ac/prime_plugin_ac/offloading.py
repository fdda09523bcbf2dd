"""Activation offloading (``trainer.model.ac_offloading``).

Each transformer block runs its forward pass under saved-tensor hooks that copy every tensor
autograd keeps for the backward pass into pinned CPU memory, on a side CUDA stream, and bring
it back when the backward pass needs it. With activation checkpointing the kept tensors are
only the block inputs, so the two combine into the smallest footprint. At most
``max_inflight_activations`` copies are in flight at once: the forward pass waits for the
oldest before starting another, which bounds the GPU memory held by tensors not yet copied.
Parameters are never copied (they stay resident or are re-gathered by FSDP), nor are tensors
smaller than ``MIN_BYTES`` on a GPU. On a CPU the copy still happens (into a separate buffer),
so the mechanism is exercised and tested there.
"""

from __future__ import annotations

from collections import deque

MIN_BYTES = 1 << 20


class _Offloaded:
    __slots__ = ("host", "device", "event")

    def __init__(self, host, device, event=None) -> None:
        self.host, self.device, self.event = host, device, event


class Offloader:
    def __init__(self, max_inflight: int, pin_memory: bool = True) -> None:
        self.max_inflight = max_inflight
        self.pin_memory = pin_memory
        self.pending: deque = deque()
        self.streams: dict = {}

    def pack(self, tensor):
        import torch

        if isinstance(tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
            return tensor
        if tensor.device.type != "cuda":
            return _Offloaded(tensor.detach().clone(), tensor.device)
        if tensor.numel() * tensor.element_size() < MIN_BYTES:
            return tensor
        stream = self.streams.get(tensor.device)
        if stream is None:
            stream = self.streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.pending.append((event, tensor))  # keeps the source alive until copied
        while len(self.pending) > self.max_inflight:
            self.pending.popleft()[0].synchronize()
        return _Offloaded(host, tensor.device, event)

    def unpack(self, packed):
        import torch

        if not isinstance(packed, _Offloaded):
            return packed
        if packed.event is None:
            return packed.host
        torch.cuda.current_stream(packed.device).wait_event(packed.event)
        return packed.host.to(packed.device, non_blocking=True)

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft()[0].synchronize()


def _wrapper_class():
    import torch

    class OffloadedBlock(torch.nn.Module):
        """Runs the wrapped block with its saved activations offloaded."""

        def __init__(self, block, offloader: Offloader) -> None:
            super().__init__()
            self._offload_wrapped_module = block
            self._offloader = offloader
            # The compile strategy compiles the block inside the hooks, which are a graph break
            # to dynamo (and the block inside may be a checkpoint that compiles its own block).
            self.compile = block.compile

        def __getattr__(self, name: str):
            # Transparent, as torch's checkpoint wrapper is: the model reads its blocks' parts.
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._offload_wrapped_module, name)

        def forward(self, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self._offloader.pack, self._offloader.unpack):
                return self._offload_wrapped_module(*args, **kwargs)

    return OffloadedBlock


def apply(model, *, config, **_):
    from prime_core.trainer.model import transformer_blocks

    offloader = Offloader(config.ac_offloading.max_inflight_activations, config.ac_offloading.pin_memory)
    wrapper = _wrapper_class()
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks[:config.ac_offloading.blocks]):
        blocks[index] = wrapper(block, offloader)
    model.register_forward_hook(lambda *_: offloader.drain())
    return model
