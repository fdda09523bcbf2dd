"""The arguments of the ``verifiers`` environment. ``taskset`` is the taskset's verifiers config,
as prime-rl's ``[orchestrator.train.source.env.taskset]`` table gives it: its ``id`` (an
installed taskset package, resolved by verifiers' own loader) and the fields of that taskset's
config class. ``prime config validate`` resolves the id and validates those fields with
verifiers, importing it only when an environment of this kind is configured."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from prime_core.config.base import Section


class VerifiersArgs(Section):
    taskset: str | dict[str, Any]
    """The taskset's config: ``{ id = "my-taskset", <its config fields> }``, or just the id."""
    limit: int | None = Field(default=None, ge=1)
    """Use the first ``limit`` tasks of the taskset (required for an infinite one)."""
    answer_field: str | None = None
    """A field of the tasks' data holding a reference completion (for ``prime envs sft-data``)."""

    _resolved: tuple[type, Any] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _taskset(self) -> VerifiersArgs:
        self._resolved = resolve(self.taskset)
        return self

    def resolved(self) -> tuple[type, Any]:
        """``(Taskset subclass, its validated config)``."""
        return self._resolved


def resolve(taskset: str | dict[str, Any]) -> tuple[type, Any]:
    from pydantic import ValidationError
    from verifiers.v1 import taskset_config_type
    from verifiers.v1.utils.loaders import taskset_class

    data = {"id": taskset} if isinstance(taskset, str) else dict(taskset)
    ident = data.get("id")
    if not isinstance(ident, str) or not ident:
        raise ValueError("taskset.id: name the verifiers taskset to run (an installed package exporting its Taskset "
                         "subclass in __all__), e.g. taskset = { id = \"my-taskset\" }")
    try:
        cls = taskset_class(ident)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"taskset.id: {exc}") from None
    try:
        config = taskset_config_type(ident).model_validate(data)
    except ValidationError as exc:
        problems = [f"taskset.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ValueError("; ".join(problems)) from None
    problem = unsupported(cls, config)
    if problem:
        raise ValueError(f"taskset: verifiers taskset '{ident}' {problem}")
    return cls, config


def unsupported(cls: type, config: Any) -> str | None:
    """Why prime's single-turn rollouts cannot run this taskset, from its classes and config."""
    import verifiers.v1 as vf

    task_cls = cls.task_type()
    if cls.toolsets(config) or task_cls.toolsets(config.task):
        return ("gives the model tools (toolsets): tool calls need a multi-turn harness, which prime's verifiers "
                "adapter does not run yet (see its README)")
    if config.task.judges:
        return "scores with LLM judges (task.judges), which need a judge model server; remove them"
    if task_cls.NEEDS_CONTAINER:
        return "needs a container runtime (NEEDS_CONTAINER), which prime's single-turn rollouts do not provide"
    hooks = [name for name in ("setup", "finalize", "stage_verifier")
             if getattr(task_cls, name) is not getattr(vf.Task, name)]
    if hooks:
        return (f"prepares each task in a runtime ({', '.join(hooks)}), which prime's single-turn rollouts do not "
                "provide")
    return None
