"""``prime plugin new NAME [--kind KIND]``: write a new, installable plugin from a template.

The templates live in ``plugin_template_files/``: ``common/`` for every kind, then the
kind's own folder (its files win). ``${...}`` placeholders are filled with string.Template;
``package`` becomes the module. The ``generic`` plugin implements a config section, a CLI
command and a config check; every other kind implements one working example of its kind,
registered with lazy references, and ships tests that run prime's contract suite for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template

from prime_core import PLUGIN_API_VERSION, __version__
from prime_core.errors import PrimeError

TEMPLATE = Path(__file__).with_name("plugin_template_files")
_VALID = re.compile(r"^[a-z][a-z0-9_-]*[a-z0-9]$")


def _tokens(*tokens: str) -> str:
    """Config tokens as the arguments of a Python call."""
    return ", ".join(repr(t) for t in tokens)


def _kinds(name: str) -> dict[str, dict[str, str]]:
    """Per kind: what it is called, the hook, its code module, how a config selects it (as
    tokens for ``load_config(root, ...)``, and misspelt), and the README's usage lines."""
    return {
        "generic": {"noun": "plugin", "hook": "prime_config_sections, prime_cli_commands", "code": "config"},
        "environment": {
            "noun": "environment", "hook": "prime_environments", "code": "env", "registry": "environments",
            "root": "orchestrator", "select": _tokens("--env", json.dumps([{"id": name}])),
            "select_typo": _tokens("--env", json.dumps([{"id": name + "x"}])),
            "usage": (f'Train on it:\n\n    [[orchestrator.env]]\n    id = "{name}"\n'
                      "    args = { min_len = 3, max_len = 8 }")},
        "monitor": {
            "noun": "monitor", "hook": "prime_monitors, prime_config_sections", "code": "monitor",
            "usage": f"Switch it on per role:\n\n    [trainer.{name}]\n    every = 1\n\n    [orchestrator.{name}]"},
        "launcher": {
            "noun": "launcher", "hook": "prime_launchers", "code": "launcher", "registry": "launchers", "root": "rl",
            "select": _tokens("--launcher", name), "select_typo": _tokens("--launcher", name + "x"),
            "usage": f'Launch with it:\n\n    launcher = "{name}"          # or: prime run rl.toml --launcher {name}'},
        "kernel": {
            "noun": "kernel", "hook": "prime_kernels", "code": "kernels", "registry": "kernels", "root": "trainer",
            "key": f"swiglu:{name}",
            "select": _tokens("--model.kernels", json.dumps({"swiglu": name})),
            "select_typo": _tokens("--model.kernels", json.dumps({"swiglu": name + "x"})),
            "usage": ('Use it in native models:\n\n    [trainer.model]\n    impl = "custom"\n'
                      f'    kernels = {{ swiglu = "{name}" }}')},
        "model_impl": {
            "noun": "model implementation", "hook": "prime_model_impls", "code": "model", "registry": "model_impls",
            "root": "trainer", "select": _tokens("--model.impl", name),
            "select_typo": _tokens("--model.impl", name + "x"),
            "usage": f'Train with it:\n\n    [trainer.model]\n    impl = "{name}"'},
        "weight_transport": {
            "noun": "weight transport", "hook": "prime_weight_transports", "code": "transport",
            "registry": "weight_transports", "root": "trainer", "select": _tokens("--weight-broadcast.type", name),
            "select_typo": _tokens("--weight-broadcast.type", name + "x"),
            "usage": f'Move weights with it:\n\n    [weight_broadcast]\n    type = "{name}"'},
        "router": {
            "noun": "router", "hook": "prime_routers", "code": "router", "registry": "routers",
            "root": "orchestrator", "select": _tokens("--client.router", name),
            "select_typo": _tokens("--client.router", name + "x"),
            "usage": f'Route requests with it:\n\n    [orchestrator.client]\n    router = "{name}"'},
        "inference_backend": {
            "noun": "inference backend", "hook": "prime_inference_backends", "code": "server",
            "registry": "inference_backends", "root": "inference", "select": _tokens("--backend", name),
            "select_typo": _tokens("--backend", name + "x"),
            "usage": f'Serve with it:\n\n    [inference]\n    backend = "{name}"'},
        "parallel_strategy": {
            "noun": "parallel strategy", "hook": "prime_parallel_strategies, prime_config_sections",
            "code": "strategy", "registry": "parallel_strategies",
            "usage": f'Turn it on:\n\n    [trainer.model]\n    {name}_every = 2'},
        "algorithm": {
            "noun": "advantage estimator", "hook": "prime_algorithms", "code": "advantage", "registry": "algorithms",
            "key": f"advantage:{name}",
            "root": "orchestrator", "select": _tokens("--advantage.type", name),
            "select_typo": _tokens("--advantage.type", name + "x"),
            "usage": f'Use it:\n\n    [orchestrator.advantage]\n    type = "{name}"'},
    }


KINDS = tuple(_kinds("x"))
"""What ``--kind`` accepts."""


def names(name: str, kind: str = "generic") -> dict[str, str]:
    if not _VALID.match(name):
        raise PrimeError(
            f"plugin name {name!r} is invalid: use lower-case letters, digits, '-' or '_', "
            "starting with a letter (e.g. 'my-monitor')"
        )
    if kind not in KINDS:
        raise PrimeError(f"--kind {kind!r} is not a plugin kind the template knows: choose one of {', '.join(KINDS)}")
    short = name.replace("-", "_")
    major, minor = (__version__.split(".") + ["0"])[:2]
    return {
        "name": short,
        "kind": kind,
        "dist": f"prime-plugin-{name.replace('_', '-')}",
        "module": f"prime_plugin_{short}",
        "title": "".join(p.capitalize() for p in short.split("_")),
        "api": str(PLUGIN_API_VERSION),
        "core_range": f">={major}.{minor},<{major}.{int(minor) + 1}" if minor.isdigit() else ">=0.1",
        "key": short,  # the spec's registry key
        **_kinds(short)[kind],
    }


def create_plugin(name: str, directory: Path, kind: str = "generic") -> Path:
    values = names(name, kind)
    target = Path(directory) / values["dist"]
    if target.exists():
        raise PrimeError(f"{target} already exists; choose another name or --dir")
    sources: dict[Path, Path] = {}
    for layer in ("common", kind):
        for source in sorted((TEMPLATE / layer).rglob("*.tmpl")):
            sources[source.relative_to(TEMPLATE / layer)] = source
    for relative, source in sorted(sources.items()):
        parts = [values["module"] if p == "package" else p for p in relative.parts]
        parts[-1] = parts[-1].removesuffix(".tmpl")
        dest = target.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(Template(source.read_text(encoding="utf-8")).substitute(values), encoding="utf-8")
    return target
