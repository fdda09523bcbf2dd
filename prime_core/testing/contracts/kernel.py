"""Contract suite for kernels (``prime_core.specs.Kernel``, registered as ``op:name``).

The trainer looks kernels up by op when it builds the model (every rank, main thread): the
core attaches ``lm_head`` and ``fp8_linear``, the native model its ``rmsnorm``, ``swiglu``,
``rope``, ``attention`` and ``grouped_mm``, the ``hf`` implementation an ``hf_patch``. An
explicit choice of a kernel whose ``available()`` gives a reason fails with that reason;
``auto`` choices skip it. How each op is called, and its reference: ``kernel_ops``. ::

    from prime_core.testing.contracts.kernel import KernelContract

    class TestFusedTorch(KernelContract):
        name = "lm_head:fused_torch"
        dtypes = ("float32", "bfloat16")

It checks that ``available()`` answers ``None`` or a reason without raising or initialising
CUDA; and, where the kernel is available (or ``ignore_available`` is set, for tests against a
stand-in library), that on fresh random inputs, called as its caller calls it, it matches the
op's float64 reference (outputs and the gradients of every differentiable input) within the
dtype's tolerance, leaves its inputs unchanged, and, when its ``reference`` names another
registered kernel of the op (``fp8_linear:emulated``), agrees with that one too. An op the
suite does not know is skipped, saying so.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from prime_core.testing.contracts import Contract, check_available, expect
from prime_core.testing.contracts.kernel_ops import OPS, TOLERANCE


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def reference_kernel(manager, spec):
    """The registered kernel ``spec.reference`` names (``op:<reference>``), if it is one."""
    entry = manager.registry("kernels").get(f"{spec.op}:{spec.reference}") if spec.reference else None
    return None if entry is None or entry.spec.key == spec.key else entry.spec


def check_kernel(spec, *, dtype: str = "float32", device: str | None = None, tolerance: float | None = None,
                 reference=None, **options: Any) -> dict[str, float]:
    """Run ``spec``'s op check (``kernel_ops.OPS``); ``reference``: a kernel spec computing the
    same thing, compared where the op check uses one. Returns the largest errors."""
    expect(spec.op in OPS, f"kernel '{spec.key}': no reference for op '{spec.op}' in the suite")
    return OPS[spec.op](spec.impl, dtype=dtype, device=device or default_device(), tolerance=tolerance,
                        reference_impl=None if reference is None else reference.impl, **options)


def check_available_is_cheap(spec) -> None:
    """``available()`` answers without raising and without initialising CUDA."""
    import torch

    before = torch.cuda.is_initialized()
    check_available(spec)
    expect(before or not torch.cuda.is_initialized(),
           f"kernel '{spec.key}': available() initialised CUDA; ask torch.cuda.is_available() or the driver instead")


class KernelContract(Contract):
    """Subclass with ``name`` (``op:name``) set; see the module docstring."""

    registry = "kernels"
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    """Input dtypes the kernel is checked in (it must support them where it is available)."""
    device: ClassVar[str | None] = None
    """``None``: CUDA where visible, else the CPU."""
    ignore_available: ClassVar[bool] = False
    """Run the numerical checks although ``available()`` gives a reason (a stand-in library)."""
    tolerance: ClassVar[float | None] = None
    """``None``: the op's default for the dtype (``kernel_ops.TOLERANCE``; FP8 its own)."""
    options: ClassVar[dict[str, Any]] = {}
    """Op-specific settings, e.g. ``{"rl": False}`` for an SFT-only ``lm_head``."""

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            unknown = sorted(set(self.dtypes) - set(TOLERANCE))
            expect(not unknown, f"{type(self).__name__}.dtypes: unknown {unknown}; choose from {', '.join(TOLERANCE)}")
            metafunc.parametrize("dtype", self.dtypes)

    def test_available_answers_none_or_a_reason(self, spec):
        check_available_is_cheap(spec)

    def test_matches_the_reference(self, spec, dtype, manager):
        if spec.op not in OPS:
            pytest.skip(f"the suite has no reference for op '{spec.op}' (known: {', '.join(OPS)}); compare it "
                        "with its reference in the plugin's own tests")
        reason = spec.unavailable_reason()
        if reason and not self.ignore_available:
            pytest.skip(f"'{spec.key}' cannot run here: {reason}")
        reference = reference_kernel(manager, spec)
        if reference is not None and reference.unavailable_reason():
            reference = None  # compared where both run
        check_kernel(spec, dtype=dtype, device=self.device, tolerance=self.tolerance, reference=reference,
                     **self.options)
