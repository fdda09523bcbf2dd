"""``trainer.model.kernels`` picks kernels by op (``{rmsnorm = "liger"}``): each choice must
be a registered ``op:name`` kernel that can run here, checked by ``prime config validate``
before anything starts rather than when the model is built."""

from __future__ import annotations

from typing import Any

from prime_core.errors import PluginError


def kernel_choice_problems(config: Any, root: str, manager) -> list[str]:
    holder = {"rl": lambda: getattr(getattr(config, "trainer", None), "model", None)}.get(
        root, lambda: getattr(config, "model", None))
    model = holder()
    prefix = "trainer.model" if root == "rl" else "model"
    problems = []
    for op, name in (getattr(model, "kernels", None) or {}).items():
        try:
            manager.select("kernels", f"{op}:{name}", key=f"{prefix}.kernels.{op}", shown=name)
        except PluginError as exc:
            problems.append(str(exc))
    return problems
