"""The hook catalogue: every hook of DESIGN.md exists, is documented with an example, and
every registry hook is backed by a typed spec."""

import dataclasses
import inspect

import pytest

from prime_core import hookspecs, specs
from prime_core.plugins import REGISTRIES

CATALOGUE = [
    "prime_config_sections", "prime_model_impls", "prime_parallel_strategies", "prime_ep_backends",
    "prime_kernels", "prime_inference_backends", "prime_routers", "prime_launchers", "prime_environments",
    "prime_tool_parsers", "prime_weight_transports", "prime_algorithms", "prime_monitors", "prime_cli_commands",
    "prime_configure", "prime_validate_config", "prime_on_step_end", "prime_on_weights_published",
    "prime_on_checkpoint", "prime_select_launcher", "prime_trainer_defaults", "prime_services",
]


@pytest.mark.parametrize("name", CATALOGUE)
def test_hook_is_specified_and_documented(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn)
    assert doc and "Example::" in doc and "@hookimpl" in doc, f"{name} needs a docstring with an example"
    assert "Called" in doc or "called" in doc, f"{name}'s docstring must say when it is called"


LIFECYCLE = {"prime_configure", "prime_validate_config", "prime_on_step_end", "prime_on_weights_published",
             "prime_on_checkpoint", "prime_select_launcher", "prime_trainer_defaults", "prime_services"}


def test_catalogue_is_complete_and_nothing_else():
    defined = {n for n, f in vars(hookspecs).items() if n.startswith("prime_") and callable(f)}
    assert defined == set(CATALOGUE)


def test_every_registry_hook_has_a_frozen_spec_type():
    assert {r.hook for r in REGISTRIES.values()} == set(CATALOGUE) - LIFECYCLE
    for reg in REGISTRIES.values():
        assert dataclasses.is_dataclass(reg.spec) and reg.spec.__dataclass_params__.frozen
        assert issubclass(reg.spec, specs.Spec)


def test_specs_are_frozen_and_names_checked():
    launcher = specs.Launcher(name="local", plan=lambda c: None, launch=lambda p: 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        launcher.name = "other"
    with pytest.raises(ValueError, match="invalid"):
        specs.Launcher(name="Bad Name", plan=print, launch=print)
    kernel = specs.Kernel(name="fused", op="lm_head", impl=print)
    assert kernel.key == "lm_head:fused"


def test_available_reports_reasons_and_survives_broken_checks():
    def broken():
        raise ImportError("no deep_ep")

    ok = specs.EPBackend(name="torch", make=print)
    missing = specs.EPBackend(name="deepep", make=print, available=lambda: "deep_ep is not installed")
    crashing = specs.EPBackend(name="x", make=print, available=broken)
    assert ok.unavailable_reason() is None
    assert missing.unavailable_reason() == "deep_ep is not installed"
    assert "ImportError" in crashing.unavailable_reason()


def test_lazy_references_import_on_first_read_and_fail_clearly():
    import sys

    from prime_core.errors import PluginError

    sys.modules.pop("colorsys", None)
    kernel = specs.Kernel(op="lm_head", name="x", impl="colorsys:rgb_to_hsv", available="colorsys:hsv_to_rgb")
    assert "colorsys" not in sys.modules  # nothing imported at registration
    assert kernel.impl(1.0, 0.0, 0.0)[0] == 0.0 and kernel.impl is kernel.impl
    assert "colorsys" in sys.modules
    with pytest.raises(ValueError, match="not a reference"):
        specs.Kernel(op="a", name="b", impl="no_colon_here")
    broken = specs.Kernel(op="a", name="b", impl="prime_no_such_module:fn")
    with pytest.raises(PluginError, match="cannot load 'prime_no_such_module:fn'"):
        _ = broken.impl  # resolved on first use
    backend = specs.EPBackend(name="x", make=print, available="prime_no_such_module:f")
    assert "cannot load" in backend.unavailable_reason()
