"""Contract suite for launchers (``prime_core.specs.Launcher``).

``prime run`` / ``prime sft`` / ``prime inference`` (typed by a user, in the main thread)
validate the config, then call ``spec.plan(config, output_dir=..., configs=..., root=...)``:
``config`` is the validated root config, ``root`` is ``"rl"``, ``"sft"`` or ``"inference"``
and ``configs`` maps the root (and each role of an RL run) to the JSON file under
``output_dir/configs/`` the core writes *after* ``plan`` returns. ``--dry-run`` stops there;
otherwise the core calls ``spec.launch(plan)`` and exits with the code it returns. This suite
does the same::

    from prime_core.testing.contracts.launcher import LauncherContract

    class TestSlurm(LauncherContract):
        name = "slurm"
        config_args = {"rl": ["--slurm.job-name", "t"], "sft": [...], "inference": [...]}
        launches_here = False                # launch() submits to a cluster

It checks that ``plan`` returns a ``LaunchPlan`` of this launcher for every root in ``roots``,
starts nothing and writes nothing outside ``output_dir`` (a script-writing launcher writes
its script there); that every process (or the script) starts each role of the run as
``prime <role> FILE`` (``python -m prime_core <role> FILE``, under torchrun or not) with FILE
a config under ``output_dir`` that loads as that role's config, logs under ``output_dir`` and
a JSON-able plan; and, where ``launches_here``, that ``launch`` of a small plan returns the
failing role's exit code (0 when all succeed), stops the other roles, and stops a service
role once the others finish.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from prime_core.testing.contracts import Contract, ContractError, Files, expect

ROOT_ROLES = {"rl": ("inference", "orchestrator", "trainer"), "sft": ("sft",), "inference": ("inference",)}
"""The role processes each root starts (an RL run without inference uses external servers)."""
_ROLE_CALL = re.compile(r"-m\s+prime_core\s+(\w+)\s+(\S+)")


def root_config(root: str, output_dir: Path, launcher: str, tokens=()):
    from prime_core.cli.common import load_config

    return load_config(root, [*tokens, "--output-dir", str(output_dir), "--launcher", launcher])


def _children() -> set[int] | None:
    """Live child processes of this process (Linux), ``None`` where that cannot be read."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    found = set()
    for task in tasks.iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            return None
    return found


def make_plan(spec, config, root: str, output_dir: Path, watched: Path):
    """``plan`` as the core calls it; checks it starts and writes nothing it should not."""
    from prime_core.launch.plan import LaunchPlan, role_config_paths

    paths = role_config_paths(config, output_dir, root)
    files, before = Files(watched), _children()
    plan = spec.plan(config, output_dir=output_dir, configs=dict(paths), root=root)
    expect(isinstance(plan, LaunchPlan), f"launcher '{spec.name}': plan() returned {type(plan).__name__}, "
                                         "not a prime_core.launch.plan.LaunchPlan")
    outside = files.written(allowed=output_dir)
    expect(not outside, f"launcher '{spec.name}': plan() wrote outside output_dir: "
                        + ", ".join(map(str, outside[:5])))
    logs = output_dir / "logs"
    expect(not (logs.is_dir() and any(logs.rglob("*"))), f"launcher '{spec.name}': plan() started roles "
                                                          f"({logs} has files); only launch() may")
    after = _children()
    if before is not None and after is not None:
        expect(not after - before, f"launcher '{spec.name}': plan() left processes running "
                                   f"({sorted(after - before)}); only launch() may start any")
    return plan, paths


def _calls(plan) -> list[tuple[str, str, str]]:
    """``(role, file, where)`` of every ``-m prime_core <role> <file>`` the plan runs."""
    calls = []
    for process in plan.processes:
        expect(isinstance(process.command, list) and process.command
               and all(isinstance(a, str) for a in process.command),
               f"process '{process.role}': command must be a non-empty list of strings, got {process.command!r}")
        argv = process.command
        expect(os.path.isfile(argv[0]) or shutil.which(argv[0]),
               f"process '{process.role}': {argv[0]!r} is neither a file nor on PATH")
        found = _ROLE_CALL.findall(shlex.join(argv))
        expect(len(found) == 1 and found[0][0] == process.role and argv[-3:] == ["prime_core", *found[0]],
               f"process '{process.role}': {shlex.join(argv)!r} does not end in `-m prime_core "
               f"{process.role} FILE` (the `prime {process.role} FILE` a user would type)")
        calls.append((*found[0], f"process '{process.role}'"))
    if plan.script is not None:
        calls += [(role, file.strip("'\""), f"script {plan.script}")
                  for role, file in _ROLE_CALL.findall(Path(plan.script).read_text())]
    return calls


def check_plan(spec, plan, config, root: str, output_dir: Path) -> None:
    """What the plan starts is what the run needs, each role runnable on its own."""
    from prime_core.cli.common import load_config
    from prime_core.launch.plan import write_plan, write_role_configs

    expect(plan.launcher == spec.name, f"plan.launcher is {plan.launcher!r}, not {spec.name!r}")
    expect(Path(plan.output_dir) == output_dir, f"plan.output_dir is {plan.output_dir}, not {output_dir}")
    write_role_configs(config, output_dir, root)  # what the core does once plan() returns
    json.loads(write_plan(plan).read_text())
    if plan.script is not None:
        script = Path(plan.script)
        expect(script.is_file() and script.is_relative_to(output_dir),
               f"plan.script {script} must be a file under output_dir")
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        expect(check.returncode == 0, f"plan.script {script} is not valid bash: {check.stderr[-500:]}")
    for process in plan.processes:
        expect(Path(process.log).is_relative_to(output_dir),
               f"process '{process.role}': log {process.log} is not under output_dir")
        expect(all(isinstance(k, str) and isinstance(v, str) for k, v in process.env.items()),
               f"process '{process.role}': env must map strings to strings")
    if plan.inline:
        expect(len(plan.processes) == 1 and plan.processes[0].role == root,
               f"an inline plan runs exactly one '{root}' process in this process")
    calls = _calls(plan)
    wanted = [r for r in ROOT_ROLES[root] if r != "inference" or root != "rl" or getattr(config, "inference", None)]
    started = {role for role, _, _ in calls}
    expect(set(wanted) <= started, f"launcher '{spec.name}': the {root} plan never starts "
                                   f"{', '.join(sorted(set(wanted) - started))}")
    for role, file, where in calls:
        expect(role in ROOT_ROLES[root], f"{where}: role '{role}' is not one a {root} run has")
        path = Path(file)
        expect(path.is_file() and path.is_relative_to(output_dir),
               f"{where}: config {file} is not a file under output_dir")
        try:
            load_config(role, [str(path)])
        except Exception as exc:
            raise ContractError(f"{where}: `prime {role} {file}` would not start: {type(exc).__name__}: {exc}") \
                from exc


def _timed_launch(spec, plan, timeout: float) -> int:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_catch(spec.launch, plan)), daemon=True)
    thread.start()
    thread.join(timeout)
    expect(not thread.is_alive(), f"launcher '{spec.name}': launch() did not return within {timeout:.0f} s")
    if isinstance(result[0], BaseException):
        raise ContractError(f"launcher '{spec.name}': launch() raised {type(result[0]).__name__}: {result[0]}") \
            from result[0]
    return result[0]


def _catch(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
        return exc


def check_launch(spec, output_dir: Path, timeout: float = 60.0) -> None:
    """``launch`` of small plans: the exit code, failure stopping the others, services."""
    from prime_core.launch.plan import LaunchPlan, RoleProcess

    def process(role: str, code: str, *, service: bool = False) -> RoleProcess:
        return RoleProcess(role=role, command=[sys.executable, "-c", code], config=output_dir / f"{role}.json",
                           log=output_dir / "logs" / f"{role}.log", service=service)

    sleep = "import time; time.sleep(120)"
    cases = [
        ("every role succeeds", [process("trainer", "print('done')")], 0),
        ("a role fails", [process("trainer", "import sys; sys.exit(3)")], 3),
        ("a role fails while another runs", [process("orchestrator", sleep),
                                             process("trainer", "import sys, time; time.sleep(0.5); sys.exit(7)")], 7),
        ("a service outlives the workers", [process("inference", sleep, service=True),
                                            process("trainer", "print('done')")], 0),
    ]
    for what, processes, want in cases:
        plan = LaunchPlan(launcher=spec.name, output_dir=output_dir, processes=processes)
        start = time.monotonic()
        code = _timed_launch(spec, plan, timeout)
        expect(isinstance(code, int) and not isinstance(code, bool),
               f"launcher '{spec.name}': launch() returned {code!r}, not an exit code")
        expect(code == want, f"launcher '{spec.name}': {what}: launch() returned {code}, expected {want}")
        expect(time.monotonic() - start < timeout / 2,
               f"launcher '{spec.name}': {what}: launch() waited for a role it should have stopped")


class LauncherContract(Contract):
    """Subclass with ``name`` set; see the module docstring."""

    registry = "launchers"
    roots: ClassVar[tuple[str, ...]] = ("rl", "sft", "inference")
    """The roots this launcher plans (one refusing a root should say so with a PrimeError)."""
    config_args: ClassVar[dict[str, list[str]]] = {}
    """Extra ``--key value`` tokens per root, e.g. the ``[slurm]`` table the launcher needs."""
    launches_here: ClassVar[bool] = True
    """Whether ``launch`` runs processes on this machine (a SLURM launcher submits instead)."""

    def pytest_generate_tests(self, metafunc):
        if "root" in metafunc.fixturenames:
            metafunc.parametrize("root", self.roots)

    def test_plan_starts_nothing_and_writes_only_under_output_dir(self, spec, root, sandbox):
        out = sandbox / "run"
        make_plan(spec, root_config(root, out, self.name, self.config_args.get(root, ())), root, out, sandbox)

    def test_plan_starts_every_role_as_prime_role_file(self, spec, root, sandbox):
        out = sandbox / "run"
        config = root_config(root, out, self.name, self.config_args.get(root, ()))
        plan, _ = make_plan(spec, config, root, out, sandbox)
        check_plan(spec, plan, config, root, out)

    def test_launch_returns_the_exit_code(self, spec, sandbox):
        if not self.launches_here:
            pytest.skip("launches_here = False: launch() does not run processes on this machine")
        check_launch(spec, sandbox / "run")
