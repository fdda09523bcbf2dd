"""Contract suite for monitors (metric sinks, ``prime_core.specs.Monitor``).

Every role process (``trainer``, ``orchestrator``, ``sft``) calls, in its main thread,
``spec.make(config, output_dir=..., role=...)`` once with its validated config, then
``sink.log(metrics, step)`` once per step and ``sink.close()`` at the end. The roles of a run
share ``output_dir`` and log at the same time. This suite does the same::

    from prime_core.testing.contracts.monitor import MonitorContract

    class TestJsonl(MonitorContract):
        name = "jsonl"

        def logged(self, output_dir):         # optional: what the sink recorded
            return [(r["step"], r) for r in read_jsonl(output_dir / "metrics.jsonl")]

It checks that ``make`` returns an object with ``log`` and ``close``; that ``log`` takes the
values the core sends (flat: floats, ints, strings, ``None``, NaN and infinities; nested
values such as ``env_rewards`` arrive flattened to ``"env_rewards/NAME"`` keys) without
changing the dict (the same dict goes to the other sinks and
to ``prime_on_step_end``); that two roles logging into one ``output_dir`` at once work; that
nothing is written outside ``output_dir`` (working directory, ``HOME`` and the temporary
directory are watched); and, when the subclass implements ``logged``, that every step and
value logged was recorded.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from prime_core.testing.contracts import Contract, ContractError, Files, expect, role_config

ROLES = ("trainer", "orchestrator", "sft")

STEPS = (
    (1, {"loss": 0.5, "grad_norm": 1.25, "lr": 1e-5, "tokens": 1024, "step_time": 0.125}),
    (2, {"reward": 0.25, "probe_logprob": None, "env_rewards/env_a": 0.5, "env_rewards/env_b": 0.0,
         "dropped": 0, "weights_version": 1}),
    (3, {"loss": float("nan"), "grad_norm": float("inf"), "mismatch_kl": -0.0, "entropy": 2.5}),
)
"""What roles log: scalars, an unknown probe (None), non-finite values after a bad step, and
the orchestrator's per-environment rewards."""


def make_sink(spec, config, output_dir: Path, role: str):
    sink = spec.make(config, output_dir=output_dir, role=role)
    for method in ("log", "close"):
        expect(callable(getattr(sink, method, None)),
               f"monitor '{spec.name}': make() returned {type(sink).__name__}, which has no {method}() method")
    return sink


def log_steps(spec, sink, steps=STEPS) -> None:
    for step, metrics in steps:
        before = repr(metrics)
        try:
            sink.log(metrics, step)
        except Exception as exc:
            raise ContractError(f"monitor '{spec.name}': log(metrics, {step}) raised {type(exc).__name__}: {exc} "
                                f"for {before}") from exc
        expect(repr(metrics) == before, f"monitor '{spec.name}': log() changed the metrics dict it was given")


def check_roles(spec, output_dir: Path, watched: Path, roles=ROLES) -> None:
    """Each role makes a sink, logs ``STEPS`` and closes it; nothing lands outside ``output_dir``."""
    files = Files(watched)
    for role in roles:
        config = role_config(role, output_dir)
        sink = make_sink(spec, config, output_dir, role)
        log_steps(spec, sink)
        sink.close()
    outside = files.written(allowed=output_dir)
    expect(not outside, f"monitor '{spec.name}' wrote outside output_dir: {', '.join(map(str, outside[:5]))}")


_ROLE_PROCESS = """
import sys
from pathlib import Path
from prime_core.plugins import get_plugin_manager
from prime_core.testing.contracts import role_config
name, role, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
sink = get_plugin_manager().select("monitors", name).make(role_config(role, out), output_dir=out, role=role)
for step in range(1, steps + 1):
    sink.log({"value": float(step), "role_marker": role == "trainer"}, step)
sink.close()
"""


def check_concurrent_roles(spec, output_dir: Path, steps: int = 20, *, processes: bool = False) -> None:
    """Two roles log into one ``output_dir`` at the same time: as two processes of the installed
    plugin (``processes``, as in a run), or as two threads of ``spec`` (any spec)."""
    errors: list[BaseException | str] = []

    def role(name: str) -> None:
        try:
            if processes:
                done = subprocess.run([sys.executable, "-c", _ROLE_PROCESS, spec.name, name, str(output_dir),
                                       str(steps)], capture_output=True, text=True, timeout=300, check=False)
                if done.returncode:
                    errors.append(f"the {name} process failed: {done.stderr.strip()[-2000:]}")
                return
            sink = make_sink(spec, role_config(name, output_dir), output_dir, name)
            for step in range(1, steps + 1):
                sink.log({"value": float(step), "role_marker": name == "trainer"}, step)
            sink.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=role, args=(name,)) for name in ("trainer", "orchestrator")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300 if processes else 60)
    expect(not any(t.is_alive() for t in threads), f"monitor '{spec.name}': two roles logging at once hung")
    if errors:
        error = errors[0]
        cause = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        raise ContractError(f"monitor '{spec.name}': two roles logging at once failed: {cause}") from (
            error if isinstance(error, BaseException) else None)


def _same(got, want) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, float) and not math.isfinite(want):
        # Text formats spell them out ("nan", "inf").
        spelled = {str(want).lower(), repr(want).lower(), str(want).lower().replace("inf", "infinity")}
        return str(got).lower() in spelled or (
            isinstance(got, float) and (math.isnan(got) if math.isnan(want) else got == want))
    if isinstance(want, float) and isinstance(got, int | float) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12)  # sinks may store float32
    return got == want


def check_recorded(spec, records, steps=STEPS) -> None:
    """``records`` (``[(step, metrics), ...]`` read back from the sink) hold every value logged."""
    by_step: dict[int, dict] = {}
    for step, metrics in records:
        by_step.setdefault(step, {}).update(metrics)
    for step, metrics in steps:
        expect(step in by_step, f"monitor '{spec.name}': nothing recorded for step {step}")
        for key, value in metrics.items():
            if value is None and key not in by_step[step]:
                continue  # "not measured yet" may be recorded as nothing
            expect(key in by_step[step] and _same(by_step[step][key], value),
                   f"monitor '{spec.name}': step {step} {key} = {value!r} was recorded as "
                   f"{by_step[step].get(key, '(missing)')!r}")


class MonitorContract(Contract):
    """Subclass with ``name`` set; override ``logged`` to check what the sink recorded."""

    registry = "monitors"
    roles: ClassVar[tuple[str, ...]] = ROLES
    """The roles whose configs the sink is made with."""
    role_processes: ClassVar[bool] = False
    """Run the two-roles-at-once check as two processes of the installed plugin, as a run does
    (for sinks that keep one session per process)."""

    def logged(self, output_dir: Path) -> list[tuple[int, dict]] | None:
        """What the sink recorded under ``output_dir`` as ``(step, metrics)`` pairs, for sinks
        that can be read back; ``None`` skips that check."""
        return None

    def test_every_role_logs_and_writes_only_under_output_dir(self, spec, sandbox):
        check_roles(spec, sandbox / "run", sandbox, self.roles)

    def test_two_roles_log_at_once(self, spec, sandbox):
        check_concurrent_roles(spec, sandbox / "run", processes=self.role_processes)

    def test_what_was_logged_is_recorded(self, spec, sandbox):
        out = sandbox / "run"
        sink = make_sink(spec, role_config("trainer", out), out, "trainer")
        log_steps(spec, sink)
        sink.close()
        records = self.logged(out)
        if records is None:
            pytest.skip("logged() is not implemented: what this sink records is not read back")
        check_recorded(spec, records)
