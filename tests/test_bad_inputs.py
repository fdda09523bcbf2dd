"""Bad input, as users and attackers give it: every case stops with a clear message naming the
key, file or plugin and the fix, the exit code the CLI documents (2 for a config, 1 for a run
that must not start), no traceback, and nothing already on disk changed (the whole test
folder is compared before and after). Cases where training can sensibly go on end in a
warning with a count (``test_*_warns`` below and ``test_sft.py``, ``test_rl_e2e.py``).

Most cases run the CLI in this process (fast); those that need a process of their own (the
plugin manager is built before the CLI; a lock held by another process) run ``prime``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prime_core.plugins import PluginManager, set_plugin_manager
from prime_core.testing import free_ports

ROOT = Path(__file__).resolve().parents[1]
RL = str(ROOT / "examples" / "cpu" / "rl.toml")
SFT = str(ROOT / "examples" / "cpu" / "sft.toml")


@dataclass
class Case:
    id: str
    args: list[str]
    code: int
    message: str
    """Text the output must contain (``{out}``-style placeholders filled in)."""
    prepare: object = None
    """``prepare(paths)`` before the snapshot: make the damage."""
    env: dict = field(default_factory=dict)
    process: bool = False
    """Run ``prime`` as a process of its own."""
    holder: str | None = None
    """A process holding ``{out}`` while the case runs: ``"run"`` (a launch) or a role name."""
    starts: bool = False
    """The run starts and fails there (what it cannot know before): it may add files, but
    nothing that was on disk changes."""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _copy_model(paths, name: str) -> Path:
    target = paths["tmp"] / name
    shutil.copytree(paths["model"], target)
    return target


def _previous_rl_run(paths) -> None:
    out = paths["out"]
    for name in ("rollouts/step_7/batch.json", "rollouts/step_8/batch.json", "weights/step_8/STABLE"):
        _write(out / name, "{}")
    _write(out / "metrics.jsonl", '{"role": "trainer", "step": 8}\n')


def _previous_sft_run(paths) -> None:
    _write(paths["out"] / "model" / "config.json", "{}")
    _write(paths["out"] / "metrics.jsonl", '{"role": "sft", "step": 3}\n')


def _damaged_model(damage):
    def prepare(paths):
        folder = _copy_model(paths, "damaged")
        damage(folder)
    return prepare


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _data(lines: list[str]):
    def prepare(paths):
        _write(paths["tmp"] / "bad.jsonl", "".join(line + "\n" for line in lines))
    return prepare


def _config_file(name: str, text: str):
    def prepare(paths):
        _write(paths["tmp"] / name, text)
    return prepare


def _read_only(paths) -> None:
    out = paths["out"]
    out.mkdir()
    if os.geteuid() == 0:  # root writes through permissions; an immutable folder it cannot write
        if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode:
            pytest.skip("running as root without chattr: cannot make a folder read-only")
    else:
        out.chmod(0o555)


MSG = "a number is needed (an option given without its value?)"
OK_MODEL = ["--model.name", "{model}", "--output-dir", "{out}"]
CASES = [
    # -- command line --------------------------------------------------------------------------
    Case("flag-without-value-lr", ["run", RL, *OK_MODEL, "--trainer.optim.lr", "--max-steps", "2"], 2,
         "trainer.optim.lr (from --trainer.optim.lr): Input should be a valid number"),
    Case("flag-without-value-max-steps", ["run", RL, *OK_MODEL, "--max-steps"], 2, MSG),
    Case("flag-without-value-sft", ["sft", SFT, *OK_MODEL, "--data.path", "{data}", "--optim.lr"], 2, MSG),
    Case("flag-without-value-path", ["run", RL, "--model.name", "{model}", "--output-dir"], 2,
         "output_dir (from --output-dir): Input is not a valid path for <class 'pathlib.Path'> (got True): a value "
         "is needed (an option given without its value?)"),
    Case("clean-and-resume", ["run", RL, *OK_MODEL, "--clean", "--resume"], 2,
         "clean = true and resume = true contradict each other"),
    Case("clean-and-resume-sft", ["sft", SFT, *OK_MODEL, "--data.path", "{data}", "--clean", "--resume"], 2,
         "contradict each other"),
    Case("disable-unknown-plugin", ["--disable-plugin", "nosuch", "run", RL, *OK_MODEL, "--dry-run"], 2,
         "no installed plugin is named 'nosuch'", process=True),
    Case("disable-misspelt-plugin", ["--disable-plugin", "wanbd", "plugins", "list"], 2, "(did you mean 'wandb'?)",
         process=True),
    Case("disabled-plugin-from-env", ["run", RL, *OK_MODEL, "--dry-run"], 2, "no installed plugin is named 'vllmm'",
         env={"PRIME_DISABLED_PLUGINS": "vllmm"}, process=True),
    Case("single-dash-option", ["run", RL, *OK_MODEL, "-max-steps", "3"], 2, "options take two dashes"),
    Case("empty-key", ["run", RL, *OK_MODEL, "--trainer..lr", "1"], 2, "not a valid key"),
    Case("dangling-at", ["run", RL, *OK_MODEL, "@"], 2, "'@' must be followed by a config file"),
    Case("unknown-key", ["run", RL, *OK_MODEL, "--trainer.optim.learning-rate", "1e-5"], 2, "unknown key"),
    Case("misspelt-key", ["run", RL, *OK_MODEL, "--trainer.optim.lrr", "1e-5"], 2, "(did you mean 'lr'?)"),
    Case("wrong-type", ["run", RL, *OK_MODEL, "--max-steps", "ten"], 2, "max_steps (from --max-steps ten)"),
    Case("negative-seq-len", ["run", RL, *OK_MODEL, "--seq-len", "-5"], 2, "greater than or equal to 1"),
    Case("alias-beside-its-key", ["run", RL, "{tmp}/t.toml", *OK_MODEL], 2,
         "another name of 'max_tokens', which is set too",
         prepare=_config_file("t.toml", "[orchestrator.sampling]\nmax_tokens = 5\nmax_completion_tokens = 6\n")),
    Case("api-key-in-args", ["run", RL, *OK_MODEL, "--inference.args.api_key", "s3cret"], 2,
         "a secret would be written to output_dir/configs/*.json"),
    Case("api-key-in-env", ["run", RL, *OK_MODEL, "--inference.env.VLLM_API_KEY", "s3cret"], 2,
         "VLLM_API_KEY: a secret would be written"),
    Case("token-in-env-vars", ["run", RL, *OK_MODEL, "--env-vars.HF_TOKEN", "hf_x"], 2, "HF_TOKEN: a secret"),
    Case("unknown-launcher", ["run", RL, *OK_MODEL, "--launcher", "nosuch"], 2,
         "launcher = 'nosuch': no installed plugin provides a launcher"),
    Case("unknown-environment", ["run", RL, *OK_MODEL, "--orchestrator.env", '[{"id": "chess"}]'], 2,
         "orchestrator.env[0].id = 'chess': no installed plugin provides an environment"),
    Case("unknown-environment-from-a-file", ["run", RL, "{tmp}/env.toml", *OK_MODEL], 2,
         "orchestrator.env[0].id (from {tmp}/env.toml) = 'chess': no installed plugin provides an environment",
         prepare=lambda p: _write(p["tmp"] / "env.toml", '[[orchestrator.env]]\nid = "chess"\n')),
    Case("no-environment", ["run", *OK_MODEL], 2, "orchestrator.env: no environment configured"),
    Case("unknown-loss", ["run", RL, *OK_MODEL, "--trainer.loss.type", "nosuch"], 2,
         "trainer.loss.type = 'nosuch'"),
    Case("unknown-monitor", ["run", RL, *OK_MODEL, "--monitors", '["nosuch"]'], 2, "monitors[0] = 'nosuch'"),
    Case("monitors-not-a-list", ["run", RL, *OK_MODEL, "--monitors", "nosuch"], 2,
         "monitors (from --monitors nosuch): Input should be a valid list"),
    Case("tp-on-cpu", ["run", RL, *OK_MODEL, "--inference.parallel.tp", "2"], 2,
         "inference.parallel.tp = 2: vLLM on CPU binds each of its 2 workers to a NUMA node"),
    Case("lora-rank-above-vllm", ["run", RL, *OK_MODEL, "--trainer.model.lora.rank", "1000"], 2,
         "vLLM serves adapters of rank 512 at most"),
    Case("max-tokens-above-max-model-len", ["run", RL, *OK_MODEL, "--orchestrator.sampling.max-tokens", "300"], 2,
         f"max_tokens = 300 leaves no room for a prompt in inference.model.max_model_len (from {RL}) = 256"),
    Case("batch-not-whole-groups", ["run", RL, *OK_MODEL, "--orchestrator.batch-size", "10"], 2,
         "must be a multiple of rollouts_per_example"),
    Case("port-out-of-range", ["run", RL, *OK_MODEL, "--inference.server.port", "70000"], 2,
         "inference.server.port (from --inference.server.port 70000)"),
    Case("replica-ports-past-65535", ["run", RL, *OK_MODEL, "--inference.server.port", "65535",
                                      "--inference.parallel.dp", "2"], 2, "above 65535"),
    Case("degree-not-dividing", ["run", RL, *OK_MODEL, "--trainer.model.impl", "custom", "--trainer.model.ep", "3",
                                 "--deployment.num-train-gpus", "2"], 2, "trainer.model.ep"),
    Case("expert-parallel-on-hf", ["run", RL, *OK_MODEL, "--trainer.model.ep", "2",
                                   "--deployment.num-train-gpus", "2"], 2, "the Hugging Face implementation has no "
                                                                           "expert parallel layers"),
    Case("gpu-ids-disagree", ["run", RL, *OK_MODEL, "--trainer-gpu-ids", "0,1",
                              "--deployment.num-train-gpus", "3"], 2, "num_train_gpus = 3 but trainer_gpu_ids"),
    Case("server-address-in-args", ["run", RL, *OK_MODEL, "--inference.args.port", "9000"], 2,
         "set the address with inference.server.host / inference.server.port"),
    Case("missing-api-key-file", ["run", RL, *OK_MODEL, "--inference.server.api-key-file", "{tmp}/nope"], 2,
         "file not found"),
    Case("unknown-deployment-type", ["run", RL, *OK_MODEL, "--deployment.type", "cloud"], 2, "deployment"),
    Case("dtype-not-offered", ["run", RL, *OK_MODEL, "--trainer.model.dtype", "float16"], 2,
         "trainer.model.dtype"),
    Case("log-level", ["run", RL, *OK_MODEL, "--log.level", "verbose"], 2, "log.level"),
    Case("env-var-wrong-type", ["run", RL, *OK_MODEL, "--dry-run"], 2, "max_steps (from environment)",
         env={"PRIME_MAX_STEPS": "abc"}),
    Case("env-var-flag-for-number", ["run", RL, *OK_MODEL, "--dry-run"], 2, MSG,
         env={"PRIME_TRAINER__OPTIM__LR": "true"}),
    Case("config-validate", ["config", "validate", RL, "--model.name", "{model}", "--launcher", "nosuch"], 2,
         "launcher = 'nosuch'"),
    # -- output folders ------------------------------------------------------------------------
    Case("resume-empty-folder", ["run", RL, *OK_MODEL, "--resume"], 1, "holds no earlier run to continue"),
    Case("resume-empty-folder-sft", ["sft", SFT, *OK_MODEL, "--data.path", "{data}", "--resume"], 1,
         "holds no earlier run to continue"),
    Case("previous-run", ["run", RL, *OK_MODEL], 1, "holds a previous run (rollouts, weights, metrics.jsonl)",
         prepare=_previous_rl_run),
    Case("previous-run-dry-run", ["run", RL, *OK_MODEL, "--dry-run"], 1, "holds a previous run",
         prepare=_previous_rl_run),
    Case("previous-sft-run", ["sft", SFT, *OK_MODEL, "--data.path", "{data}"], 1,
         "holds a previous run (model, metrics.jsonl)", prepare=_previous_sft_run),
    Case("output-dir-is-a-file", ["run", RL, *OK_MODEL], 1, "is a file, not a folder",
         prepare=lambda p: _write(p["out"], "not a folder")),
    Case("output-dir-under-a-file", ["run", RL, "--model.name", "{model}", "--output-dir", "{out}/sub"], 1,
         "is a file, not a folder", prepare=lambda p: _write(p["out"], "not a folder")),
    Case("output-dir-read-only", ["run", RL, *OK_MODEL], 1, "{out}", prepare=_read_only),
    Case("live-folder-second-run", ["run", RL, *OK_MODEL, "--dry-run"], 1, "is in use by a run (pid", holder="run",
         process=True),
    Case("live-folder-resume", ["run", RL, *OK_MODEL, "--resume"], 1, "is in use by a run", holder="run",
         prepare=_previous_rl_run, process=True),
    Case("live-folder-clean", ["run", RL, *OK_MODEL, "--clean"], 1, "is in use by a run", holder="run",
         prepare=_previous_rl_run, process=True),
    Case("live-folder-sft", ["sft", SFT, *OK_MODEL, "--data.path", "{data}", "--clean"], 1, "is in use by a run",
         holder="run", prepare=_previous_sft_run, process=True),
    Case("run-beside-role-by-hand", ["run", RL, *OK_MODEL, "--clean"], 1, "prime trainer", holder="trainer",
         prepare=_previous_rl_run, process=True),
    Case("second-trainer-by-hand", ["trainer", "--model.name", "{model}", "--output-dir", "{out}"], 1,
         "is in use by another trainer", holder="trainer", process=True),
    Case("role-by-hand-beside-run", ["orchestrator", "--model.name", "{model}", "--output-dir", "{out}"], 1,
         "is in use by a run", holder="run", process=True),
    # -- config files --------------------------------------------------------------------------
    Case("missing-config-file", ["run", "{tmp}/nope.toml", *OK_MODEL], 2, "config file not found"),
    Case("config-is-a-folder", ["run", "{tmp}", *OK_MODEL], 2, "config path is not a file"),
    Case("config-format", ["run", "{tmp}/rl.ini", *OK_MODEL], 2, "unsupported config format '.ini'",
         prepare=_config_file("rl.ini", "[x]\n")),
    Case("toml-syntax", ["run", "{tmp}/bad.toml", *OK_MODEL], 2, "could not parse TOML",
         prepare=_config_file("bad.toml", "max_steps = = 3\n")),
    Case("yaml-syntax", ["run", "{tmp}/bad.yaml", *OK_MODEL], 2, "could not parse YAML",
         prepare=_config_file("bad.yaml", "max_steps: [1, 2\n")),
    Case("json-syntax", ["run", "{tmp}/bad.json", *OK_MODEL], 2, "could not parse JSON",
         prepare=_config_file("bad.json", '{"max_steps": 3,}\n')),
    Case("environment-without-id", ["run", "{tmp}/env.toml", *OK_MODEL], 2, "orchestrator.env[0].id",
         prepare=_config_file("env.toml", "[[orchestrator.env]]\nargs = {digits = 1}\n")),
    Case("list-for-a-table", ["run", RL, "{tmp}/t.toml", *OK_MODEL], 2, "trainer",
         prepare=_config_file("t.toml", "trainer = [1, 2]\n")),
    Case("unknown-top-level-key", ["run", RL, "{tmp}/t.toml", *OK_MODEL], 2, "learning_rate",
         prepare=_config_file("t.toml", "learning_rate = 1e-5\n")),
    # -- model folders -------------------------------------------------------------------------
    Case("model-missing", ["run", RL, "--model.name", "{tmp}/nope", "--output-dir", "{out}"], 2,
         "model folder not found"),
    Case("model-is-a-file", ["run", RL, "--model.name", "{tmp}/file", "--output-dir", "{out}"], 2,
         "is a file: a model is a folder", prepare=lambda p: _write(p["tmp"] / "file", "x")),
    Case("model-empty", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "model folder {tmp}/damaged is empty",
         prepare=lambda p: (p["tmp"] / "damaged").mkdir()),
    Case("model-config-not-json", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "{tmp}/damaged/config.json is not valid JSON",
         prepare=_damaged_model(lambda f: (f / "config.json").write_text("{oops"))),
    Case("model-without-config", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "has no config.json", prepare=_damaged_model(lambda f: (f / "config.json").unlink())),
    Case("model-zero-byte-safetensors", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "model.safetensors is empty (0 bytes)", prepare=_damaged_model(lambda f: _truncate(f / "model.safetensors",
                                                                                             0))),
    Case("model-truncated-safetensors", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "model.safetensors is truncated", prepare=_damaged_model(lambda f: _truncate(f / "model.safetensors",
                                                                                       5000))),
    Case("model-garbage-safetensors", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "is truncated or not a safetensors file",
         prepare=_damaged_model(lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 4096))),
    Case("model-without-tokenizer", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "has no tokenizer files", prepare=_damaged_model(
             lambda f: [p.unlink() for p in f.glob("tokenizer*")])),
    Case("model-without-tokenizer-sft", ["sft", SFT, "--model.name", "{tmp}/damaged", "--output-dir", "{out}",
                                         "--data.path", "{data}"], 2, "has no tokenizer files",
         prepare=_damaged_model(lambda f: [p.unlink() for p in f.glob("tokenizer*")])),
    Case("model-without-weights", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "has no weight files", prepare=_damaged_model(lambda f: (f / "model.safetensors").unlink())),
    Case("model-missing-shard", ["run", RL, "--model.name", "{tmp}/damaged", "--output-dir", "{out}"], 2,
         "model-00002-of-00002.safetensors is missing (listed in model.safetensors.index.json)",
         prepare=_damaged_model(lambda f: (f / "model.safetensors.index.json").write_text(json.dumps(
             {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})))),
    Case("model-hub-id-not-cached", ["run", RL, "--model.name", "nosuch-org/nosuch-model", "--output-dir", "{out}"],
         2, "not in the local Hugging Face cache", env={"HF_HUB_OFFLINE": "1"}),
    # -- SFT data ------------------------------------------------------------------------------
    Case("data-missing", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/none.jsonl"], 2, "file not found"),
    Case("data-not-json", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/bad.jsonl"], 2, "bad.jsonl, line 2: not JSON",
         prepare=_data(['{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}',
                        '{"messages": ['])),
    Case("data-without-messages", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/bad.jsonl"], 2,
         "bad.jsonl, line 1: no 'messages' list", prepare=_data(['{"text": "hello"}'])),
    Case("data-last-turn-not-assistant", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/bad.jsonl"], 2,
         "line 1: the last message must be the assistant's",
         prepare=_data(['{"messages": [{"role": "user", "content": "1+1"}]}'])),
    Case("data-many-bad-lines", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/bad.jsonl"], 2, "2 more bad lines",
         prepare=_data(["[1]"] * 7)),
    Case("data-empty", ["sft", SFT, *OK_MODEL, "--data.path", "{tmp}/bad.jsonl"], 2, "has no samples",
         prepare=_data([])),
    Case("data-no-sample-fits", ["sft", SFT, *OK_MODEL, "--data.path", "{data}", "--seq-len", "8"], 2,
         "every sample's prompt is 8 tokens or longer", process=True, starts=True),
    # -- a run that cannot train ---------------------------------------------------------------
    Case("prompts-longer-than-seq-len", ["orchestrator", "--model.name", "{model}", "--output-dir", "{out}",
                                         "--seq-len", "8", "--env", '[{"id": "arithmetic"}]'], 1,
         "100 prompts in a row are 8 tokens or longer", process=True),
    Case("prompts-longer-than-seq-len-run", ["run", RL, *OK_MODEL, "--seq-len", "8", "--inference.server.port",
                                             "{port}"], 1,
         "role 'orchestrator' exited with code 1", process=True, starts=True),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def manager():
    return PluginManager(autoload=True, disabled=()).load()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under ``root``: type, size, modification time, content digest."""
    import hashlib

    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
        found[str(path.relative_to(root))] = (path.is_dir(), info.st_size, info.st_mtime_ns, digest)
    return found


HOLD = textwrap.dedent("""
    import sys, time
    from prime_core.run_lock import OutputDirLock
    out, role = sys.argv[1], sys.argv[2]
    sys.argv = ["prime", role, "(a test holding the folder)"]
    lock = OutputDirLock(out, role=None if role == "run" else role).acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def fill(text: str, paths: dict) -> str:
    for key, value in paths.items():
        text = text.replace(f"{{{key}}}", str(value))
    return text


def run_prime(args: list[str], env: dict, *, process: bool, prime_cli, manager):
    if process:
        full = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
        done = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                              env=full, timeout=300)
        return done.returncode, done.stdout + done.stderr
    set_plugin_manager(manager)
    try:
        result = prime_cli(*args, env={"HF_HUB_OFFLINE": "1", **env})
    finally:
        set_plugin_manager(None)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        return 99, result.output + "".join(traceback.format_exception(result.exception))
    return result.exit_code, result.output


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(case, tmp_path, model, manager, prime_cli, monkeypatch):
    for name in ("PRIME_DISABLED_PLUGINS", "PRIME_ROLE_PROCESS", "PRIME_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    paths = {"tmp": tmp_path, "out": tmp_path / "out", "model": tmp_path / "model", "data": tmp_path / "data.jsonl",
             "port": free_ports(1)}
    shutil.copytree(model, paths["model"])
    _write(paths["data"], "".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{a}"},
                                                           {"role": "assistant", "content": str(2 * a)}]}) + "\n"
                                  for a in range(8)))
    if case.prepare is not None:
        case.prepare(paths)
    holder = None
    if case.holder:
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(paths["out"]), case.holder],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    args = [fill(a, paths) for a in case.args]
    before = snapshot(tmp_path)
    try:
        code, output = run_prime(args, case.env, process=case.process, prime_cli=prime_cli, manager=manager)
    finally:
        if holder is not None:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
        if os.geteuid() == 0 and paths["out"].is_dir():
            subprocess.run(["chattr", "-i", str(paths["out"])], capture_output=True)
    after = snapshot(tmp_path)
    assert "Traceback" not in output, output
    assert fill(case.message, paths) in output, output
    assert code == case.code, output
    if case.starts:
        after = {path: info for path, info in after.items() if path in before and path != "out"}
        before = {path: info for path, info in before.items() if path != "out"}
    assert after == before, f"the disk changed: {set(after.items()) ^ set(before.items())}"
