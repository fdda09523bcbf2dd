"""``orchestrator.env[i].args`` against what each environment declares it takes, so that a
typo or a wrong type stops ``prime config validate`` (and every run) before anything starts.

An environment declares its arguments with ``Environment.args``, a pydantic model; values
are validated strictly (no coercion), since the orchestrator hands them to ``load`` as
written. Without a model, the names are checked against ``load``'s signature.
"""

from __future__ import annotations

import inspect
from typing import Any

from prime_core.errors import PrimeError, did_you_mean


def env_args_problems(config: Any, root: str, manager) -> list[str]:
    """One message per bad argument of every configured environment (unknown environments
    are reported by the ``orchestrator.env[i].id`` check already)."""
    envs = configured_envs(config, root)
    if not envs:
        return []
    try:
        entries = manager.registry("environments")
    except PrimeError:
        return []  # two plugins claim one name: reported with the orchestrator.env[i].id check
    problems: list[str] = []
    for where, env in envs:
        name = manager.resolve("environments", env.id)
        if name in entries:
            problems.extend(check_env_args(entries[name].spec, env.args, f"{where}.args"))
    return problems


def configured_envs(config: Any, root: str) -> list[tuple[str, Any]]:
    """``(where, env)`` for every environment an RL or orchestrator config samples or evaluates,
    ``where`` its key (``orchestrator.env[0]``, ``orchestrator.eval.env[1]``)."""
    orchestrator = {"rl": lambda: getattr(config, "orchestrator", None), "orchestrator": lambda: config}.get(root)
    section = orchestrator() if orchestrator else None
    if section is None:
        return []
    return [(f"{key}[{i}]", env)
            for key, envs in (("orchestrator.env", getattr(section, "env", None)),
                              ("orchestrator.eval.env", getattr(getattr(section, "eval", None), "env", None)))
            for i, env in enumerate(envs or [])]


def check_env_args(spec, args: dict[str, Any], where: str) -> list[str]:
    """Messages ``"<where>.<key>: what is wrong; the fix"`` for ``args`` given to ``spec``."""
    try:
        model = spec.args
    except PrimeError as exc:
        return [f"{where}: environment '{spec.name}' declares its arguments badly: {exc}"]
    if model is not None:
        return _against_model(model, spec.name, args, where)
    return _against_signature(spec, args, where)


def _describe(model) -> str:
    fields = model.model_fields
    if not fields:
        return "it takes no arguments"
    parts = []
    for name, info in fields.items():
        kind = getattr(info.annotation, "__name__", str(info.annotation))
        parts.append(f"{name}: {kind}" + ("" if info.is_required() else f" = {info.default!r}"))
    return "it takes " + ", ".join(parts)


def _against_model(model, env: str, args: dict[str, Any], where: str) -> list[str]:
    from pydantic import ValidationError

    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    if model.model_config.get("extra") == "allow":
        known |= set(args)  # passed through: the model's own validators check them
    problems = [f"{where}.{key}: environment '{env}' has no argument '{key}'{did_you_mean(key, known)}; "
                f"{_describe(model)}" for key in args if key not in known]
    try:
        model.model_validate({k: v for k, v in args.items() if k in known}, strict=True)
    except ValidationError as exc:
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"])
            given = f" (got {error['input']!r})" if error["type"] != "missing" and path else ""
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{where}{'.' + path if path else ''}: {message}{given}; {_describe(model)}")
    return problems


def _against_signature(spec, args: dict[str, Any], where: str) -> list[str]:
    try:
        signature = inspect.signature(spec.load)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return []
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []  # takes anything; load() itself reports bad arguments when the run starts
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = [f"{where}.{key}: environment '{spec.name}' has no argument '{key}'{did_you_mean(key, names)}; "
                f"it takes {', '.join(names) or 'no arguments'}" for key in args if key not in names]
    problems += [f"{where}.{name}: environment '{spec.name}' needs this argument; add it to "
                 f"[[orchestrator.env]] args" for name, p in params.items()
                 if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in args]
    return problems
