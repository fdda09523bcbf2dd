"""Every bad input of ``tests/test_bad_inputs.py`` run through ``prime`` as a process, and what
came of it: a clean error, a warning (the run went on, saying so), a traceback, or silence
(accepted: it ran, or would have). Prints one line per case and the counts.

    .venv/bin/python scripts/bad_inputs_table.py                 # this checkout
    .venv/bin/python scripts/bad_inputs_table.py --code OLD      # another checkout's prime_core and plugins
                                                                 # (e.g. `git worktree add OLD <commit>`)

A case that does not stop within ``--timeout`` seconds was accepted and started: it is
stopped (its whole process tree, found by an environment tag) and counted as silent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def tagged(tag: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def stop(tag: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tagged(tag):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(3)


def code_path(code: Path | None) -> str:
    """PYTHONPATH that makes ``code``'s prime_core and plugins win over the installed ones."""
    if code is None:
        return ""
    return os.pathsep.join([str(code), *(str(p.parent) for p in sorted(code.glob("plugins/*/*/pyproject.toml")))])


def classify(case, model: Path, code: Path | None, timeout: float) -> tuple[str, str]:
    import test_bad_inputs as suite

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        paths = {"tmp": tmp_path, "out": tmp_path / "out", "model": tmp_path / "model", "data": tmp_path / "data.jsonl",
                 "port": suite.free_port()}
        shutil.copytree(model, paths["model"])
        suite._write(paths["data"], "".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{a}"},
                                                                     {"role": "assistant", "content": str(2 * a)}]})
                                            + "\n" for a in range(8)))
        if case.prepare is not None:
            case.prepare(paths)
        holder = None
        if case.holder:  # this checkout's lock: an older one ignores it
            holder = subprocess.Popen([sys.executable, "-c", suite.HOLD, str(paths["out"]), case.holder],
                                      stdout=subprocess.PIPE, text=True)
            holder.stdout.readline()
        tag = f"PRIME_CLASSIFY_{uuid.uuid4().hex}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **case.env, tag: "1"}
        if code is not None:
            env["PYTHONPATH"] = code_path(code)
        args = [suite.fill(a, paths) for a in case.args]
        try:
            done = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                                  env=env, timeout=timeout)
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            output, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode(), None
        finally:
            stop(tag)
            if holder is not None:
                holder.kill()
                holder.wait()
            if os.geteuid() == 0 and paths["out"].is_dir():
                subprocess.run(["chattr", "-i", str(paths["out"])], capture_output=True)
    if rc is None:
        return "silent", "started (stopped after the timeout)"
    if "Traceback" in output:
        last = [line for line in output.splitlines() if line.strip()][-1]
        return "traceback", last[:160]
    if rc != 0:
        first = next((line for line in output.splitlines() if line.startswith(("error", "  -"))), output[:160])
        return "clean error", first.strip()[:160]
    if "warning" in output.lower():
        return "warning", ""
    return "silent", "exit 0"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", type=Path, help="a checkout whose code to run (default: this one)")
    parser.add_argument("--timeout", type=float, default=45)
    args = parser.parse_args()
    import test_bad_inputs as suite

    from prime_plugin_hf.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny(Path(tmp) / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
        counts: dict[str, int] = {}
        for case in suite.CASES:
            outcome, detail = classify(case, model, args.code, args.timeout)
            counts[outcome] = counts.get(outcome, 0) + 1
            print(f"{case.id:<38} {outcome:<12} {detail}", flush=True)
    print(f"{len(suite.CASES)} bad inputs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
