"""``prime_core.testing.ranks``: forked ranks meet over gloo as torchrun's would, their output
and exit codes come back, and a failed, crashed or timed-out run leaves no rank behind."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from prime_core.testing.ranks import available, launch

pytestmark = pytest.mark.skipif(not available(), reason="ranks are forked only on Linux with no GPU visible")

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    import helper  # from the script's own folder, as `python worker.py` finds it

    mode, pids = sys.argv[1], sys.argv[2]
    open(os.path.join(pids, os.environ["RANK"]), "w").write(str(os.getpid()))
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {rank}/{size} local {os.environ['LOCAL_RANK']} sum {total.item():g} threads "
          f"{torch.get_num_threads()} cwd {os.path.basename(os.getcwd())} {helper.WORD}", flush=True)
    if mode == "fail" and rank == 1:
        sys.exit(3)
    if mode == "crash" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode != "ok":
        time.sleep(600)  # rank 0 (and in "hang" every rank) waits until stopped
    from prime_core.distributed import exit_process, shutdown

    shutdown()
    exit_process(0)  # as a trainer rank ends: gloo's threads can abort a finalising interpreter
""")


@pytest.fixture
def worker(tmp_path):
    (tmp_path / "helper.py").write_text("WORD = 'found'\n")
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "pids").mkdir()
    (tmp_path / "here").mkdir()
    return tmp_path


def _gone(pids) -> bool:
    for pid_file in pids.iterdir():
        try:
            os.kill(int(pid_file.read_text()), 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_ranks_meet_over_gloo_with_torchrun_s_environment(worker):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = launch(3, str(worker / "worker.py"), ["ok", str(worker / "pids")], timeout=120, env=env,
                  cwd=worker / "here")
    assert done.returncode == 0, done.stdout
    for rank in range(3):
        assert f"rank {rank}/3 local {rank} sum 6 threads 1 cwd here found" in done.stdout, done.stdout
    assert _gone(worker / "pids")


@pytest.mark.parametrize(("mode", "code"), [("fail", 3), ("crash", -9)])
def test_a_failed_rank_stops_the_others(worker, mode, code):
    started = time.monotonic()
    done = launch(2, str(worker / "worker.py"), [mode, str(worker / "pids")], timeout=120)
    assert done.returncode == code, done.stdout
    assert time.monotonic() - started < 60, "rank 0 was stopped, not left in its barrier"
    assert _gone(worker / "pids")


def test_a_run_past_its_timeout_is_stopped(worker):
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        launch(2, str(worker / "worker.py"), ["hang", str(worker / "pids")], timeout=10)
    assert "sum 3" in raised.value.output
    assert _gone(worker / "pids")


def test_module_targets_and_fresh_runs_go_through_torchrun_s_command(worker, monkeypatch):
    """``fresh``: torchrun, whose ranks import everything themselves."""
    done = launch(2, str(worker / "worker.py"), ["ok", str(worker / "pids")], timeout=120, fresh=True)
    assert done.returncode == 0 and "torch.distributed.run" in done.args, done.stdout + done.stderr
    assert "rank 1/2 local 1 sum 3" in done.stdout
    assert _gone(worker / "pids")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: calls.append(command))
    launch(1, "prime_core.parity:main", ["a", "b"], timeout=1)
    assert calls == [[sys.executable, "-m", "prime_core.parity", "a", "b"]]
