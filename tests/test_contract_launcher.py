"""The launcher contract suite fails on launchers that break the contract. (The first-party
launchers run it in their own tests: plugins/launchers/*/tests/test_contract.py.)"""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prime_core.launch.plan import LaunchPlan, RoleProcess, role_command
from prime_core.specs import Launcher
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import launcher as contract


def good_plan(config, *, output_dir, configs, root="rl"):
    """A minimal correct launcher: every role of the run as ``prime <role> FILE``."""
    roles = [r for r in contract.ROOT_ROLES[root] if r in configs]
    return LaunchPlan(launcher="mine", output_dir=Path(output_dir), processes=[
        RoleProcess(role=r, command=role_command(r, configs[r]), config=configs[r],
                    log=Path(output_dir) / "logs" / f"{r}.log", service=r == "inference") for r in roles])


def good_launch(plan):
    from prime_core.launch.supervise import supervise

    return supervise(plan).code


@pytest.fixture
def run(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")

    def plan_and_check(plan_fn, root="rl"):
        spec = Launcher(name="mine", plan=plan_fn, launch=good_launch)
        out = tmp_path / "run"
        config = contract.root_config(root, out, "local")
        plan, _ = contract.make_plan(spec, config, root, out, tmp_path)
        contract.check_plan(spec, plan, config, root, out)

    return plan_and_check


@pytest.mark.parametrize("root", ["rl", "sft", "inference"])
def test_a_correct_launcher_passes(run, root):
    run(good_plan, root)


def test_launch_of_a_correct_launcher_passes(tmp_path):
    contract.check_launch(Launcher(name="mine", plan=good_plan, launch=good_launch), tmp_path)


def with_processes(edit):
    def plan(config, **kwargs):
        result = good_plan(config, **kwargs)
        result.processes = edit(result.processes, Path(kwargs["output_dir"]))
        return result

    return plan


def writes_to_cwd(config, **kwargs):
    Path("plan.txt").write_text("planned")
    return good_plan(config, **kwargs)


def starts_a_process(config, **kwargs):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    return good_plan(config, **kwargs)


@pytest.mark.parametrize(("plan_fn", "message"), [
    (lambda config, **kwargs: good_plan(config, **kwargs).to_json(), "returned dict, not a .*LaunchPlan"),
    (writes_to_cwd, "plan\\(\\) wrote outside output_dir: .*plan.txt"),
    (starts_a_process, "plan\\(\\) left processes running"),
    (with_processes(lambda ps, out: [p for p in ps if p.role != "orchestrator"]), "never starts orchestrator"),
    (with_processes(lambda ps, out: [replace(p, command=[*p.command[:-1], "--config", p.command[-1]])
                                     for p in ps]), "does not end in `-m prime_core inference FILE`"),
    (with_processes(lambda ps, out: [replace(p, command=[*p.command[:-1], "/elsewhere/trainer.json"])
                                     for p in ps]), "config /elsewhere/trainer.json is not a file under output_dir"),
    (with_processes(lambda ps, out: [replace(p, command=["no-such-python", *p.command[1:]]) for p in ps]),
     "'no-such-python' is neither a file nor on PATH"),
    (with_processes(lambda ps, out: [replace(p, log=Path("/tmp/x.log")) for p in ps]), "is not under output_dir"),
])
def test_broken_plans_fail(run, plan_fn, message):
    with pytest.raises(ContractError, match=message):
        run(plan_fn)


def test_a_plan_running_a_file_that_is_not_the_roles_config_fails(run):
    # The trainer started with the orchestrator's file: `prime trainer FILE` refuses it.
    swap = with_processes(lambda ps, out: [replace(p, command=[*p.command[:-1], str(out / "configs" /
                                                                                   "orchestrator.json")])
                                           if p.role == "trainer" else p for p in ps])
    with pytest.raises(ContractError, match="`prime trainer .*orchestrator.json` would not start: ConfigError"):
        run(swap)


def test_a_launch_that_loses_the_exit_code_fails(tmp_path):
    spec = Launcher(name="mine", plan=good_plan, launch=lambda plan: good_launch(plan) and 1)
    with pytest.raises(ContractError, match="a role fails: launch\\(\\) returned 1, expected 3"):
        contract.check_launch(spec, tmp_path)
