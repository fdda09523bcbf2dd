"""The FP8 GEMM of every backend, and how a backend is chosen.

One contract for all: ``gemm(a, b, b_block=..., out_dtype=..., backend=...)`` computes
``A @ B.T`` from ``a = (q [M, Kp], scale [M, Kp / 128])`` (1×128 blocks, ``quantize_rows``)
and ``b = (q [N, Kp], scale)`` with 128×128 blocks (``b_block=128``, ``quantize_blocks``:
weights) or 1×128 blocks (``b_block=1``, ``quantize_rows``: the weight-gradient product,
where both operands are scaled along the token dimension). Products accumulate in float32
(at least); the result is ``[M, N]`` in ``out_dtype``.

- ``emulated``: dequantise both operands, then one matmul (float32 on CPU; float64 on CUDA,
  where a global TF32 setting would otherwise round the reference). Any device; the reference.
- ``torch``: ``torch.nn.functional.scaled_mm`` with the ``BlockWise1x128`` /
  ``BlockWise128x128`` recipes (cuBLASLt; PyTorch allows them on SM90 only, with cuBLAS ≥ 12.9)
  — the ``blockwise`` mode. Elsewhere (SM89, SM100+, a torch without the recipes, an older
  cuBLAS) the ``chunked`` mode: one row-wise-scaled ``torch._scaled_mm`` per 128-wide K chunk,
  summed in float32. ``chunked`` is exact to the recipe but slow (K / 128 GEMMs, each writing
  an ``[M, N]`` float32 partial): a correctness fallback, not a fast path.
- ``deep_gemm``: DeepGEMM's ``fp8_gemm_nt`` (SM90, float32 scales): the 1D2D kernel for
  128×128 weights, the 1D1D kernel (``recipe=(1, 1, 128)``, float32 output accumulated into
  zeros) for the weight gradient.
- ``auto``: per device, ``deep_gemm`` where it can run, else ``torch``; ``emulated`` off CUDA.

Availability checks never initialise CUDA: the compute capability is read from torch when
CUDA is already initialised, else from NVML (``pynvml``) or ``nvidia-smi`` (the node's first
GPU, whatever ``CUDA_VISIBLE_DEVICES`` says: advisory); when none can tell, the check passes.
``resolve`` checks the real device again at the first GEMM on it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import subprocess

BACKENDS = ("deep_gemm", "torch", "emulated")
NAMES = ("auto", *BACKENDS)
DEEP_GEMM_HINT = ("build DeepGEMM from github.com/deepseek-ai/DeepGEMM (git clone --recursive, then "
                  "./install.sh; needs CUDA >= 12.9)")
log = logging.getLogger("prime.fp8")


# ---- where each backend can run ---------------------------------------------------------

@functools.cache
def _capability_without_init() -> tuple[int, int] | None:
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0)))
        except pynvml.NVMLError as exc:
            log.debug("NVML could not tell the compute capability: %s", exc)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            major, minor = out.split()[0].split(".")
            return int(major), int(minor)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            log.debug("nvidia-smi could not tell the compute capability: %s", exc)
    return None


def capability(device=None) -> tuple[int, int] | None:
    """Compute capability of ``device`` (default: the first GPU), ``None`` when it cannot be
    known without initialising CUDA."""
    import torch

    if device is not None or torch.cuda.is_initialized():
        return torch.cuda.get_device_capability(device)
    return _capability_without_init()


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, ``None`` when it can. Cheap; no CUDA context."""
    if name == "emulated":
        return None
    import torch

    if name == "auto":
        # Off CUDA, auto means the emulated reference; on a GPU it needs FP8 tensor cores.
        cap = capability() if torch.cuda.is_available() else None
        if cap is not None and cap < (8, 9):
            return _old_gpu(cap)
        return None
    if name == "deep_gemm" and importlib.util.find_spec("deep_gemm") is None:
        return f"deep_gemm is not installed: {DEEP_GEMM_HINT}"
    if not torch.cuda.is_available():
        return f"the {name} FP8 backend needs a CUDA GPU (none visible here)"
    cap = capability()
    if cap is None:
        return None
    if name == "torch" and cap < (8, 9):
        return _old_gpu(cap)
    if name == "deep_gemm" and cap[0] != 9:
        return (f"the deep_gemm FP8 backend runs on SM90 (Hopper) only, this GPU is sm{cap[0]}{cap[1]} "
                "(DeepGEMM on SM100 takes UE8M0 scales, which this plugin does not produce); use 'torch'")
    return None


def _old_gpu(cap) -> str:
    return (f"FP8 GEMMs need FP8 tensor cores: compute capability >= 8.9 (Ada, Hopper, Blackwell); this GPU "
            f"is {cap[0]}.{cap[1]}")


@functools.cache
def resolve(name: str, device) -> str:
    """The backend that runs for ``name`` on ``device`` (``auto`` resolved); raises with the
    reason when it cannot run there."""
    if name not in NAMES:
        raise ValueError(f"unknown FP8 backend {name!r}: choose one of {', '.join(NAMES)}")
    on_cuda = device.type == "cuda"
    if name == "auto":
        if not on_cuda:
            return "emulated"
        reasons = {b: _unavailable_on(b, device) for b in ("deep_gemm", "torch")}
        for backend, reason in reasons.items():
            if reason is None:
                return backend
        raise RuntimeError("no FP8 backend can run on " + str(device) + ": "
                           + "; ".join(f"{b}: {r}" for b, r in reasons.items()))
    if name == "emulated":
        return name
    if not on_cuda:
        raise RuntimeError(f"the {name} FP8 backend needs CUDA tensors, got {device.type} ones "
                           "(use 'emulated' or 'auto' off the GPU)")
    reason = _unavailable_on(name, device)
    if reason is not None:
        raise RuntimeError(reason)
    return name


def _unavailable_on(name: str, device) -> str | None:
    reason = unavailable(name)
    if reason is not None:
        return reason
    cap = capability(device)  # CUDA is initialised by now: the tensors live there
    if cap < (8, 9):
        return _old_gpu(cap)
    if name == "deep_gemm" and cap[0] != 9:
        return f"the deep_gemm FP8 backend runs on SM90 (Hopper) only, {device} is sm{cap[0]}{cap[1]}"
    return None


# ---- the GEMMs --------------------------------------------------------------------------

def gemm(a, b, *, b_block: int, out_dtype, backend: str):
    """``A @ B.T`` (see the module docstring) with ``backend`` (``auto`` allowed), contiguous.

    Contiguous because the backends compute on operands padded to whole tiles and return the
    unpadded part, a strided view where N was padded; the custom operators of a compiled graph
    (``linear``) promise contiguous outputs, and Inductor checks that (a tiny model's 64-wide
    k_proj failed it on an H200 in stop 70). Whole 128-wide N, as in real models, copy nothing."""
    import torch

    qa, qb = a[0], b[0]
    if qa.shape[1] != qb.shape[1]:
        raise ValueError(f"FP8 GEMM operands disagree on K: {tuple(qa.shape)} and {tuple(qb.shape)}")
    if b_block not in (1, 128):
        raise ValueError(f"b_block must be 1 or 128, got {b_block}")
    m, n = qa.shape[0], qb.shape[0]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=qa.device)
    name = resolve(backend, qa.device)
    # Autocast would round the emulated matmul (and the chunk sums) to bf16: the operands are
    # already exact, the precision is the backend's to choose. Entered only when on: the context
    # manager alone costs about as much host time as the rest of this function.
    if torch.is_autocast_enabled(qa.device.type):
        with torch.autocast(qa.device.type, enabled=False):
            return _IMPLS[name](a, b, b_block=b_block, out_dtype=out_dtype).contiguous()
    return _IMPLS[name](a, b, b_block=b_block, out_dtype=out_dtype).contiguous()


def emulated_gemm(a, b, *, b_block: int, out_dtype):
    from prime_plugin_fp8.quant import dequantize_blocks, dequantize_rows

    da = dequantize_rows(*a)
    db = dequantize_blocks(*b) if b_block == 128 else dequantize_rows(*b)
    if da.is_cuda:
        da, db = da.double(), db.double()
    return (da @ db.T).to(out_dtype)


def _pad_rows(b, b_block: int, multiple: int = 16):
    """An FP8 operand ``(q, scale)`` with zero rows added up to a multiple of ``multiple`` (≤ 128):
    cuBLASLt and DeepGEMM's TMA need row counts 16-aligned. ``b_block = 1`` for row scales (one
    per row: padded with ones), 128 for block scales (the padding never crosses into a new
    128-row block). Returns the operand and the original row count."""
    import torch

    q, scale = b
    n = q.shape[0]
    extra = -n % multiple
    if not extra:
        return b, n
    q = torch.cat([q, q.new_zeros(extra, q.shape[1])])
    if b_block == 1:
        scale = torch.cat([scale, scale.new_ones(extra, scale.shape[1])])
    return (q, scale), n


def _out_dtype(out_dtype):
    import torch

    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


# torch: "blockwise" until a device proves it cannot (then "chunked" for that device, and
# PyTorch's reason is kept in _torch_fallbacks).
_torch_modes: dict = {}
_torch_fallbacks: dict = {}


def torch_mode(device) -> str:
    """``blockwise`` or ``chunked``: what the torch backend uses on ``device``."""
    import torch.nn.functional as F

    key = str(device)
    if key not in _torch_modes:
        recipes = getattr(F, "ScalingType", None)
        ok = (device.type == "cuda" and hasattr(F, "scaled_mm") and recipes is not None
              and hasattr(recipes, "BlockWise128x128") and capability(device)[0] == 9)
        _torch_modes[key] = "blockwise" if ok else "chunked"
    return _torch_modes[key]


def torch_gemm(a, b, *, b_block: int, out_dtype, mode: str | None = None):
    mode = mode or torch_mode(a[0].device)
    if mode == "blockwise":
        try:
            return torch_blockwise_gemm(a, b, b_block=b_block, out_dtype=out_dtype)
        except NotImplementedError as exc:  # PyTorch's "needs SM90 / cublasLt >= 12.9": never on this device
            log.warning("torch blockwise FP8 GEMM unavailable on %s (%s); using per-K-chunk _scaled_mm",
                        a[0].device, exc)
            _torch_modes[str(a[0].device)] = "chunked"
            _torch_fallbacks[str(a[0].device)] = str(exc)
        except RuntimeError as exc:  # cuBLASLt refusing this one shape
            if "cublas" not in str(exc).lower():
                raise
            log.warning("torch blockwise FP8 GEMM refused A %s x B %s (%s); per-K-chunk _scaled_mm for this call",
                        tuple(a[0].shape), tuple(b[0].shape), str(exc).splitlines()[0])
    return torch_chunked_gemm(a, b, b_block=b_block, out_dtype=out_dtype)


def blockwise_scales(a_scale, b_scale, b_block: int):
    """The scale tensors in the layouts ``scaled_mm``'s DeepSeek recipes check: 1×128 scales
    ``[rows, K / 128]`` with strides ``(1, rows)``; 128×128 scales as ``[L4, ceil(N / 128)]``
    with strides ``(1, L4)``, ``L4`` = K blocks rounded up to 4 (zero-filled)."""
    def outer_major(scale, rows: int):
        if scale.shape[0] == rows and scale.stride() == (1, rows):
            return scale  # the layout the Triton quantisers write (``triton_quant.row_scales``)
        # Built with explicit strides: .t().contiguous().t() keeps the old strides when a
        # dimension has size 1, and PyTorch's stride check then refuses a single-row scale.
        out = scale.new_zeros(rows * scale.shape[1]).as_strided((rows, scale.shape[1]), (1, rows))
        out[: scale.shape[0]] = scale
        return out

    sa = outer_major(a_scale, a_scale.shape[0])
    if b_block == 1:
        return sa, outer_major(b_scale, b_scale.shape[0])
    kb = b_scale.shape[1]
    return sa, outer_major(b_scale.t(), kb + (-kb % 4))


def torch_blockwise_gemm(a, b, *, b_block: int, out_dtype):
    import torch.nn.functional as F

    # cuBLASLt's blockwise kernels (CUDA 13, H200) refuse row counts that are not whole
    # 128-row tiles on either side ("CUBLAS_STATUS_NOT_SUPPORTED"): pad both with zero rows.
    a, m = _pad_rows(a, 1, multiple=128)
    b, n = _pad_rows(b, b_block, multiple=128)
    sa, sb = blockwise_scales(a[1], b[1], b_block)
    a, b = (a[0].contiguous(), a[1]), (b[0].contiguous(), b[1])  # cuBLASLt: A row-major, B.T column-major
    recipe_b = F.ScalingType.BlockWise128x128 if b_block == 128 else F.ScalingType.BlockWise1x128
    out = F.scaled_mm(a[0], b[0].t(), scale_a=sa, scale_recipe_a=F.ScalingType.BlockWise1x128,
                      scale_b=sb, scale_recipe_b=recipe_b, output_dtype=_out_dtype(out_dtype))
    return out[:m, :n].to(out_dtype)


# Row-wise _scaled_mm writes float32 through cuBLASLt (SM90+, cuBLAS >= 12.9) but only
# bf16 through its CUTLASS fallback (SM89, older cuBLAS): found out once per device.
_chunk_dtypes: dict = {}


def torch_chunked_gemm(a, b, *, b_block: int, out_dtype):
    """One row-wise ``torch._scaled_mm`` per 128-wide K chunk, each chunk's block scales
    becoming the per-row (A) and per-column (B) scales, summed in float32. Runs on CPU too."""
    import torch

    from prime_plugin_fp8.quant import BLOCK

    a, m = _pad_rows(a, 1)
    b, n = _pad_rows(b, b_block)
    (qa, sa), (qb, sb) = a, b
    if b_block == 128:
        sb = sb.repeat_interleave(BLOCK, dim=0)[: qb.shape[0]]
    out = torch.zeros(qa.shape[0], qb.shape[0], dtype=torch.float32, device=qa.device)
    key = str(qa.device)
    for j in range(qa.shape[1] // BLOCK):
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        args = (qa[:, cols], qb[:, cols].t(), sa[:, j : j + 1].contiguous(), sb[:, j][None].contiguous())
        dtype = _chunk_dtypes.get(key, torch.float32)
        try:
            partial = torch._scaled_mm(*args, out_dtype=dtype)
        except (RuntimeError, ValueError):
            if dtype != torch.float32 or not qa.is_cuda:
                raise
            _chunk_dtypes[key] = torch.bfloat16
            partial = torch._scaled_mm(*args, out_dtype=torch.bfloat16)
        _chunk_dtypes.setdefault(key, dtype)
        out += partial
    return out[:m, :n].to(out_dtype)


@functools.cache
def deep_gemm_jit_note() -> None:
    """Said once a process, at the first DeepGEMM GEMM: why a run's first steps can be slow."""
    import os

    cache = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
    log.info("fp8: DeepGEMM compiles a kernel for each GEMM layout at its first use (seconds each; rows of "
             "varying length meet new ones for many steps) and keeps them in %s (DG_JIT_CACHE_DIR): keep it on "
             "storage that outlives the run", cache)


def deep_gemm_gemm(a, b, *, b_block: int, out_dtype):
    import deep_gemm
    import torch

    deep_gemm_jit_note()

    b, n = _pad_rows(b, b_block)
    m = a[0].shape[0]
    if b_block == 128:
        # The 1D2D kernel writes bf16 only.
        out = torch.empty(m, b[0].shape[0], dtype=torch.bfloat16, device=a[0].device)
        deep_gemm.fp8_gemm_nt(a, b, out, recipe=(1, 128, 128), disable_ue8m0_cast=True)
    else:
        # The 1D1D (weight-gradient) kernel accumulates into a float32 C = D. Its row blocks are
        # whole 64-row WGMMAs: for fewer rows DeepGEMM picks a block its kernel rejects.
        a, m = _pad_rows(a, 1, 64)
        out = torch.zeros(a[0].shape[0], b[0].shape[0], dtype=torch.float32, device=a[0].device)
        deep_gemm.fp8_gemm_nt(a, b, out, c=out, recipe=(1, 1, 128), disable_ue8m0_cast=True)
    return out[:m, :n].to(out_dtype)


_IMPLS = {"emulated": emulated_gemm, "torch": torch_gemm, "deep_gemm": deep_gemm_gemm}
