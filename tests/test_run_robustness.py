"""What keeps a run's folder whole and its messages true: the output_dir lock, written configs
that roles do not second-guess, resume after damage (a torn metrics line, a damaged newest
checkpoint), atomic writes, full disks, log tails that show the cause, prompts that cannot fit."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_core.errors import PrimeError, storage_error
from prime_core.metrics import TORN_FILE, append_jsonl, drop_steps_from, read_jsonl
from prime_core.run_lock import OutputDirLock, lock_role

pytest_plugins = ["prime_core.testing"]


# -- the output_dir lock ---------------------------------------------------------------------


HOLD = """
import sys, time
from prime_core.run_lock import OutputDirLock
sys.argv = ["prime", "run", "held.toml"]
lock = OutputDirLock({out!r}, role={role!r}).acquire()
print("held", flush=True)
time.sleep(60)
"""


def hold(out: Path, role: str | None = None) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(out=str(out), role=role)], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_folder_is_refused_naming_its_holder_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = hold(out)
    try:
        with pytest.raises(PrimeError, match=rf"output_dir = {out} is in use by a run \(pid {holder.pid} on .*: "
                                             r"prime run held.toml\); nothing was changed"):
            OutputDirLock(out).acquire()
        with pytest.raises(PrimeError, match="in use by a run"):  # a role by hand beside a launch
            OutputDirLock(out, role="trainer").acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = OutputDirLock(out).acquire()  # the kernel freed the dead holder's lock
    try:
        assert lock.took_over and f"pid {holder.pid}" in lock.took_over
    finally:
        lock.release()
    again = OutputDirLock(out).acquire()  # released cleanly: nothing to take over
    assert again.took_over is None
    again.release()


def test_roles_by_hand_share_a_folder_but_not_a_role(tmp_path):
    out = tmp_path / "out"
    trainer = hold(out, "trainer")
    try:
        orchestrator = OutputDirLock(out, role="orchestrator").acquire()  # one run's roles coexist
        with pytest.raises(PrimeError, match="is in use by another trainer"):
            OutputDirLock(out, role="trainer").acquire()
        with pytest.raises(PrimeError, match="in use by a run"):  # no launch beside them
            OutputDirLock(out).acquire()
        orchestrator.release()
    finally:
        trainer.kill()
        trainer.wait()


def test_a_refused_launch_leaves_no_trace_and_launched_roles_lock_nothing(tmp_path, monkeypatch):
    out = tmp_path / "new" / "out"
    lock = OutputDirLock(out).acquire()
    lock.release(remove_created=True)
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("PRIME_LAUNCHER", "1:2")

    class Config:
        output_dir = out

    assert lock_role(Config(), "trainer") is None and not out.exists()


# -- the written configs are the whole truth --------------------------------------------------


def test_launched_roles_read_their_file_not_prime_variables(tmp_path, monkeypatch, installed_plugins):
    from prime_core.cli.common import load_config
    from prime_core.cli.roles import _role_environ

    path = tmp_path / "trainer.json"
    path.write_text(json.dumps({"max_steps": 2, "output_dir": str(tmp_path)}))
    monkeypatch.setenv("PRIME_MAX_STEPS", "3")
    monkeypatch.delenv("PRIME_ROLE_PROCESS", raising=False)
    assert load_config("trainer", [str(path)], environ=_role_environ("trainer")).max_steps == 3  # by hand
    monkeypatch.setenv("PRIME_ROLE_PROCESS", "1")
    assert load_config("trainer", [str(path)], environ=_role_environ("trainer")).max_steps == 2  # launched


# -- metrics and checkpoints after a crash -------------------------------------------------------


def test_a_torn_metrics_line_is_kept_aside_and_never_glued_to_the_next(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"role": "trainer", "step": 1})
    with path.open("a") as f:
        f.write('{"role": "trainer", "st')  # a crash mid-write
    append_jsonl(path, {"role": "orchestrator", "step": 1})
    assert [r["role"] for r in read_jsonl(path)] == ["trainer", "orchestrator"]
    assert drop_steps_from(path, "trainer", 5) == 0
    assert "line 2 was not a complete record" in capsys.readouterr().out
    assert (tmp_path / TORN_FILE).read_text() == '{"role": "trainer", "st\n'
    assert [json.loads(line)["role"] for line in path.read_text().splitlines()] == ["trainer", "orchestrator"]


def _save_two_checkpoints(tmp_path):
    import torch

    from prime_core.trainer import ckpt

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (1, 2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        ckpt.save(tmp_path, step, model, optimizer, {})
    return model, optimizer


@pytest.mark.parametrize("damage", ["truncated shard", "no metadata", "progress not JSON", "shard missing"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    from prime_core.trainer import ckpt

    _save_two_checkpoints(tmp_path)
    newest = tmp_path / "checkpoints" / "step_2"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_2"]  # no .tmp left
    shard = next((newest / "state").glob("*.distcp"))
    if damage == "truncated shard":
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    elif damage == "no metadata":
        (newest / "state" / ".metadata").unlink()
    elif damage == "progress not JSON":
        (newest / "progress.json").write_text("{")
    else:
        shard.unlink()
    warnings: list[str] = []
    assert ckpt.latest_usable(tmp_path, warn=warnings.append) == (1, tmp_path / "checkpoints" / "step_1")
    assert ckpt.latest_step(tmp_path, warn=warnings.append) == 1  # what the orchestrator resumes from
    (warning,) = set(warnings)
    assert "checkpoint step 2 is not usable" in warning and str(newest) in warning


def test_a_failed_checkpoint_write_is_a_message_and_leaves_the_previous_one(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from prime_core.trainer import ckpt

    model, optimizer = _save_two_checkpoints(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints" / ".step_3.tmp"))

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(PrimeError, match=r"the disk is full while writing .*\.step_3\.tmp \(the checkpoint of step 3"):
        ckpt.save(tmp_path, 3, model, optimizer, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert ckpt.latest_usable(tmp_path) == (2, tmp_path / "checkpoints" / "step_2")


def test_storage_errors_become_messages_and_others_do_not():
    full = storage_error(OSError(errno.ENOSPC, "No space left on device", "/out/weights/x"))
    assert str(full).startswith("the disk is full while writing /out/weights/x") and "--resume" in str(full)
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as exc:
            raise RuntimeError("save failed") from exc
    except RuntimeError as wrapped:
        assert "the file system is read-only" in str(storage_error(wrapped))
    wrapped_text = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert "the disk is full" in str(storage_error(wrapped_text))
    assert storage_error(ValueError("bad value")) is None
    assert storage_error(OSError(errno.ENOENT, "No such file")) is None


# -- messages that name the cause ----------------------------------------------------------------


def test_a_failure_report_shows_the_cause_and_no_request_noise(tmp_path):
    from prime_core.launch.supervise import failure_report

    log = tmp_path / "role.log"
    noise = ['HTTP Request: POST http://127.0.0.1:8000/v1/completions "HTTP/1.1 200 OK"\n' for _ in range(30)]
    access = [f'INFO:     127.0.0.1:{40000 + i} - "POST /v1/completions HTTP/1.1" 200 OK\n' for i in range(30)]
    log.write_text("starting\nWARNING something harmless: OSError: [Errno 24] ulimit\n"
                   "(EngineCore pid=1) ERROR core.py AssertionError: Not enough NUMA nodes\n"
                   "Traceback (most recent call last):\n" + "".join(noise) + "".join(access)
                   + "RuntimeError: Engine core initialization failed\n")
    report = failure_report(log, 5)
    assert report.splitlines()[:3] == ["first errors in the log:",
                                       "  (EngineCore pid=1) ERROR core.py AssertionError: Not enough NUMA nodes",
                                       "  RuntimeError: Engine core initialization failed"]
    assert "HTTP Request" not in report and "HTTP/1.1" not in report  # 60 request lines, none shown
    assert report.splitlines()[-1] == "RuntimeError: Engine core initialization failed"
    assert "ulimit" not in "".join(report.splitlines()[:3]), "a warning is no cause"


def test_a_dying_service_is_named_over_the_client_that_failed_first_and_without_one_nobody_waits(tmp_path):
    """A failure waits for other roles to fail too only while a service runs, since a dying
    server (which is what to report) makes its clients fail first; with none, the run stops at once."""
    from prime_core.launch.plan import LaunchPlan, RoleProcess
    from prime_core.launch.supervise import supervise

    def proc(role: str, code: str, service: bool = False) -> RoleProcess:
        return RoleProcess(role=role, command=[sys.executable, "-c", code], config=tmp_path / f"{role}.json",
                           log=tmp_path / "logs" / f"{role}.log", service=service)

    server_dies = "import sys, time; time.sleep(2); sys.exit(9)"
    client_fails = "import sys, time; time.sleep(0.5); sys.exit(1)"
    outcome = supervise(LaunchPlan(launcher="test", output_dir=tmp_path, processes=[
        proc("inference", server_dies, service=True), proc("orchestrator", client_fails)]))
    assert (outcome.code, outcome.failed_role) == (9, "inference"), outcome.message

    start = time.monotonic()
    outcome = supervise(LaunchPlan(launcher="test", output_dir=tmp_path, processes=[
        proc("orchestrator", "import time; time.sleep(60)"), proc("trainer", client_fails)]))
    assert (outcome.code, outcome.failed_role) == (1, "trainer")
    assert time.monotonic() - start < 5, "stopped at once, with no service whose death could explain it"

    # On a known port, a service that answers is alive and one that never has was still starting:
    # either way the failure is the client's own, no wait. One that answered and then fell silent
    # while its process runs (an inference role whose server died) is waited for and named.
    from prime_core.testing import free_ports

    def service(port: int, code: str) -> RoleProcess:
        found = proc("inference", code, service=True)
        found.port = port
        return found

    def client_after(port: int, delay: float) -> RoleProcess:
        return proc("orchestrator", f"import socket, sys, time\nwhile socket.socket().connect_ex(('127.0.0.1', "
                                    f"{port})): time.sleep(0.1)\ntime.sleep({delay}); sys.exit(1)")

    serve = ("import http.server, sys, threading, time\nserver = http.server.HTTPServer(('127.0.0.1', {port}), "
             "http.server.SimpleHTTPRequestHandler)\nthreading.Thread(target=server.serve_forever, daemon=True)"
             ".start()\ntime.sleep({serving})\nserver.shutdown(); server.server_close(); time.sleep(2); sys.exit(9)")
    starting = "import socket, time\ns = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    for what, code, delay, want, bound in (
            ("answers (/health: 404)", serve.format(port="{port}", serving=60), 0.3, (1, "orchestrator"), 6),
            ("never answered (listening, no reply)", starting, 0.3, (1, "orchestrator"), 6),
            ("answered, then silent", serve.format(port="{port}", serving=1.5), 2.0, (9, "inference"), 12)):
        port = free_ports(1)
        start = time.monotonic()
        outcome = supervise(LaunchPlan(launcher="test", output_dir=tmp_path, processes=[
            service(port, code.format(port=port)), client_after(port, delay)]))
        assert (outcome.code, outcome.failed_role) == want, (what, outcome.message)
        assert time.monotonic() - start < bound, what


# -- SFT: resume, atomic model, full disk ----------------------------------------------------------


def prime(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1"},
                                                     {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                            for i in range(32)))
    return path


def test_sft_resumes_past_a_damaged_checkpoint_and_a_torn_metrics_line(tiny, data, tmp_path):
    out = tmp_path / "sft"
    common = ["sft", "--model.name", str(tiny), "--model.dtype", "float32", "--data.path", str(data),
              "--data.batch-size", "8", "--seq-len", "64", "--optim.lr", "1e-3", "--output-dir", str(out),
              "--ckpt.interval", "1"]
    first = prime(*common, "--max-steps", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    model = (out / "model" / "model.safetensors").read_bytes()
    assert not list(out.glob(".model*")), "the model was renamed into place"
    shard = next((out / "checkpoints" / "step_3" / "state").glob("*.distcp"))
    with shard.open("r+b") as f:
        f.truncate(100)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"role": "sft", "step": 4, "lo')
    again = prime(*common, "--max-steps", "4")
    assert again.returncode == 1 and "holds a previous run (model, checkpoints, metrics.jsonl)" in again.stderr
    resumed = prime(*common, "--max-steps", "4", "--resume")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert f"checkpoint step 3 is not usable: {shard} is missing or truncated" in output
    assert "sft: resuming after step 2" in output and "line 4 was not a complete record" in output
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(out / "metrics.superseded.jsonl")] == [3]
    assert (out / TORN_FILE).read_text().startswith('{"role": "sft", "step": 4')
    assert (out / "model" / "model.safetensors").read_bytes() != model, "the model of the resumed run"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a full disk) needs root")
def test_a_full_disk_is_a_message_naming_what_was_written(tiny, data, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = prime("sft", "--model.name", str(tiny), "--model.dtype", "float32", "--data.path", str(data),
                     "--data.batch-size", "8", "--seq-len", "64", "--max-steps", "1", "--output-dir", str(disk / "o"))
        output = done.stdout + done.stderr
        assert done.returncode == 1, output
        assert "error: the disk is full while writing" in output and "(the final model, in" in output, output
        assert "free some space" in output and "Traceback" not in output
        assert not list((disk / "o").glob(".model*")), "the partial model was removed (its space given back)"
    finally:
        subprocess.run(["umount", str(disk)])


# -- a replica that may die ------------------------------------------------------------------


def _sleeper(role: str, out: Path, seconds: float, code: int = 0, **kwargs):
    from prime_core.launch.plan import RoleProcess

    return RoleProcess(role=role, command=[sys.executable, "-c", f"import time, sys; time.sleep({seconds}); "
                                                                 f"sys.exit({code})"],
                       config=out / "x.json", log=out / "logs" / f"{role}.log", **kwargs)


@pytest.mark.parametrize("may_fail", [True, False])
def test_a_replica_that_may_fail_is_noted_and_the_run_goes_on(tmp_path, may_fail):
    """``orchestrator.client.on_replica_failure = "continue"``: the launcher lets a replica's
    process die (the orchestrator goes on with the others); otherwise that ends the run."""
    from prime_core.launch.plan import LaunchPlan
    from prime_core.launch.supervise import supervise

    plan = LaunchPlan(launcher="local", output_dir=tmp_path, processes=[
        _sleeper("inference[0]", tmp_path, 60, service=True, may_fail=may_fail),
        _sleeper("inference[1]", tmp_path, 0.2, code=3, service=True, may_fail=may_fail),
        _sleeper("orchestrator", tmp_path, 2.0)])
    notes: list[str] = []
    outcome = supervise(plan, on_note=notes.append)
    if may_fail:
        assert outcome.code == 0, outcome.message
        assert notes == [f"warning: role 'inference[1]' exited with code 3; the run goes on without it "
                         f"(log: {tmp_path / 'logs' / 'inference[1].log'})"]
    else:
        assert outcome.failed_role == "inference[1]" and outcome.code == 3 and not notes


@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_roles_sharing_the_cores_get_openmp_threads_that_sleep_unless_the_user_chose(tmp_path, monkeypatch,
                                                                                     user_policy):
    """Several roles on one machine: ``OMP_WAIT_POLICY=PASSIVE`` (spinning OpenMP threads
    take the cores from the other roles'); a policy the user set is kept; a lone process gets
    nothing added."""
    from prime_core.launch.plan import LaunchPlan, RoleProcess
    from prime_core.launch.supervise import supervise

    if user_policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_policy)

    def proc(role: str) -> RoleProcess:
        code = f"import os; open({str(tmp_path / role)!r}, 'w').write(os.environ.get('OMP_WAIT_POLICY', '-'))"
        return RoleProcess(role=role, command=[sys.executable, "-c", code], config=tmp_path / f"{role}.json",
                           log=tmp_path / "logs" / f"{role}.log")

    assert supervise(LaunchPlan(launcher="test", output_dir=tmp_path, processes=[proc("a"), proc("b")])).code == 0
    assert supervise(LaunchPlan(launcher="test", output_dir=tmp_path, processes=[proc("alone")])).code == 0
    shared = user_policy or "PASSIVE"
    assert [(tmp_path / r).read_text() for r in ("a", "b", "alone")] == [shared, shared, user_policy or "-"]


# -- a rank stopped while it waits shows where it was -------------------------------------------


WAITING_RANK = """
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
from prime_core import distributed

def waiting_for_rank_one():
    distributed.init(timeout_seconds=120)

waiting_for_rank_one()
"""


def test_a_rank_stopped_by_sigterm_prints_every_threads_stack_and_still_dies_of_it():
    """torchrun stops the other ranks with SIGTERM when one times out in a collective; the rank
    it stops must say where it was (here: rank 0 of 2 waiting for rank 1 in the rendezvous,
    blocked in C), and still end as a SIGTERM ends a process."""
    import signal
    import socket

    from prime_core.testing import free_ports

    port = free_ports(1)
    rank = subprocess.Popen([sys.executable, "-c", WAITING_RANK, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # rank 0 listens once it is inside init_process_group (the handler is set before)
            assert rank.poll() is None, rank.communicate()
            assert time.monotonic() < deadline, "rank 0 never started its store"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(0.5)
        rank.send_signal(signal.SIGTERM)
        _, err = rank.communicate(timeout=60)
    finally:
        rank.kill()
    assert rank.returncode == -signal.SIGTERM, err
    assert "most recent call first" in err and "waiting_for_rank_one" in err and "in init" in err, err
