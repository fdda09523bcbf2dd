"""A real one-node SLURM cluster on localhost for the tests that submit jobs.

Uses Debian's slurm packages when they are installed (``slurmctld``, ``slurmd``, ``sbatch``
on PATH; CI installs them): writes a slurm.conf into a temporary directory (this machine's
CPUs and memory, one partition, ``auth/none``, no cgroups, no accounting), starts slurmctld
and slurmd in the foreground as background processes, waits until ``sinfo`` shows the node
idle, and stops both afterwards. Clients find the cluster through ``SLURM_CONF``, which the
fixture sets for the tests and the processes they start. Tests skip, saying why, only where
the daemons cannot be started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"}


@dataclass
class SlurmCluster:
    conf: Path
    root: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job_id: str, timeout: float) -> str:
        """Poll until the job reaches a terminal state; return it."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(1)
        self.run("scancel", job_id)
        raise AssertionError(f"job {job_id} still {state} after {timeout:.0f} s")

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def daemon_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("log/*")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def _why_not() -> str | None:
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun")
               if shutil.which(tool) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not on PATH): apt-get install slurmctld slurmd "
                "slurm-client (CI does)")
    if os.geteuid() != 0:
        return "the localhost SLURM cluster runs its daemons as root (slurmd starts jobs); run the tests as root"
    return None


def write_conf(root: Path) -> Path:
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    memory = max(256, int(_memory_mb() * 0.8))  # below what slurmd measures, or the node drains
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=primetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
    return conf


@pytest.fixture(scope="module")  # the daemons stop when the module that submits is done
def slurm_cluster():
    why = _why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="prime-slurm-"))  # short: slurmd's socket path has a length limit
    conf = write_conf(root)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        for argv, log in (([shutil.which("slurmctld"), "-D", "-i", "-f", str(conf)], "slurmctld.out"),
                          ([shutil.which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], "slurmd.out")):
            with open(root / "log" / log, "w") as out:
                daemons.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True))
        cluster = SlurmCluster(conf=conf, root=root, env=env)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            if any(d.poll() is not None for d in daemons):
                break
            state = cluster.run("sinfo", "-h", "-n", "localhost", "-o", "%T").stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        if state != "idle":
            pytest.skip(f"the localhost SLURM cluster did not come up (node state {state or 'unknown'}):\n"
                        f"{cluster.daemon_logs()}")
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(conf)
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
            for job in cluster.jobs():
                cluster.run("scancel", job)
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(root, ignore_errors=True)
