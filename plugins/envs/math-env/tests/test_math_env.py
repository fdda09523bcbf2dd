"""math-env: right answers (written other ways) score 1 and wrong ones 0; the dataset loads from a
local file, folder or saved dataset, and offline from the local cache by its Hub id, and anything
else stops at once with the dataset and the fix named; a check that hangs is killed and no
checking process outlives its environment; the seeds' SLURM config validates."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import prime_plugin_math_env.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_plugin_math_env.check import MathChecker, final_answer

pytest_plugins = ["prime_core.testing"]
SEEDS = Path(__file__).resolve().parents[4] / "examples" / "seeds"


def load(**args):
    return plugin.prime_environments()[0].load(**{"math_verify_max_workers": 2, **args})


def all_tasks(env):
    """One task per row (drawing until every row has come up)."""
    rng, found = random.Random(0), {}
    while len(found) < len(env.rows):
        task = env.tasks(rng, 1)[0]
        found.setdefault(task.info["index"], task)
    return [found[i] for i in sorted(found)]


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_right_answers_score_one_and_wrong_ones_zero(problems_file, answers):
    RIGHT, WRONG = answers  # noqa: N806
    env = load(dataset_name=str(problems_file), dataset_subset=None)
    try:
        for task in all_tasks(env):
            gold = task.info["gold"]
            assert gold in RIGHT, "a worked solution's reference is its last box"
            for right in RIGHT[gold]:
                assert env.score(task, f"So the answer is $\\boxed{{{right}}}$.") == 1.0, (gold, right)
                assert env.score(task, f"<think>maybe \\boxed{{0}}</think>\\boxed{{{right}}}") == 1.0, "after thinking"
                assert env.score(task, right) == 0.0, "nothing boxed"
                assert env.score(task, f"<think>\\boxed{{{right}}}") == 0.0, "thinking never finished"
                second = f"\\boxed{{{right}}} no, \\boxed{{{WRONG[gold][0]}}}"
                assert env.score(task, second) == 0.0, "the last box counts"
            for wrong in WRONG[gold]:
                assert env.score(task, f"\\boxed{{{wrong}}}") == 0.0, (gold, wrong)
            assert env.score(task, task.answer) == 1.0, "the reference completion"
    finally:
        env.close()


def test_prompt_and_reference(problems_file, problems):
    env = load(dataset_name=str(problems_file), dataset_subset=None, system_prompt="Be careful.",
               instruction_prompt="Solve: ", instruction_prompt_post=" Box it.")
    task = next(t for t in all_tasks(env) if t.info["index"] == 1)
    assert task.prompt == [{"role": "system", "content": "Be careful."},
                           {"role": "user", "content": f"Solve: {problems[1]['question']} Box it."}]
    assert (task.answer, task.info["gold"]) == ("\\boxed{2}", "2")
    default = load(dataset_name=str(problems_file), dataset_subset=None).tasks(random.Random(0), 1)[0]
    assert default.prompt[0]["role"] == "user" and "inside \\boxed{}" in default.prompt[0]["content"]


def test_difficulty_filter_and_columns(problems_file, problems, answers, jsonl, tmp_path):
    env = load(dataset_name=str(problems_file), dataset_subset=None, difficulty_key="difficulty", min_avg_reward=0.35,
               max_avg_reward=0.95)
    assert sorted(env.rows["answer"]) == sorted(p["answer"] for p in problems if 0.35 <= p["difficulty"] <= 0.95)
    renamed = jsonl(tmp_path / "renamed.jsonl", [{"problem": p["question"], "solution": p["answer"]}
                                                 for p in problems])
    env = load(dataset_name=str(renamed), dataset_subset=None, question_key="problem", answer_key="solution")
    assert {t.info["gold"] for t in all_tasks(env)} == set(answers[0])
    with pytest.raises(ValueError, match=r"question_key: math-env: dataset '.*' \(split 'train'\) has no column "
                                         "'question'; its columns are problem, solution"):
        load(dataset_name=str(renamed), dataset_subset=None)
    with pytest.raises(ValueError, match="has no rows with difficulty in"):
        load(dataset_name=str(problems_file), dataset_subset=None, difficulty_key="difficulty", min_avg_reward=2.0,
             max_avg_reward=3.0)


def test_local_folders_and_saved_datasets(tmp_path, problems_file, problems, jsonl):
    import datasets

    folder = tmp_path / "repo"
    folder.mkdir()
    jsonl(folder / "test.jsonl", problems[:2])
    assert len(load(dataset_name=str(folder), dataset_subset="default", dataset_split="test").rows) == 2
    rows = datasets.load_dataset("json", data_files=str(problems_file), split="train")
    datasets.DatasetDict({"train": rows, "test": rows.select(range(3))}).save_to_disk(tmp_path / "saved")
    assert len(load(dataset_name=str(tmp_path / "saved"), dataset_split="test").rows) == 3
    rows.to_parquet(tmp_path / "rows.parquet")
    assert len(load(dataset_name=str(tmp_path / "rows.parquet")).rows) == len(problems)
    with pytest.raises(ValueError, match="the saved dataset has no split 'dev'; it has train, test"):
        load(dataset_name=str(tmp_path / "saved"), dataset_split="dev")


def test_a_hub_id_loads_offline_from_the_local_cache(offline_cache, problems):
    env = load(dataset_name="PrimeIntellect/Hendrycks-Math", dataset_subset="default")
    assert sorted(env.rows["question"]) == sorted(p["question"] for p in problems)
    assert len(load().rows) == len(problems), "the default, PrimeIntellect/INTELLECT-3-RL (math)"


@pytest.mark.parametrize(("args", "reason"), [
    ({"dataset_name": "PrimeIntellect/Not-Cached"}, "Couldn't reach 'PrimeIntellect/Not-Cached' on the Hub"),
    ({"dataset_subset": "code"}, "Couldn't find cache for PrimeIntellect/INTELLECT-3-RL for config 'code'"),
    ({"dataset_split": "test"}, "Unknown split \"test\""),
])
def test_a_dataset_that_is_not_here_stops_at_once_naming_it_and_the_fix(offline_cache, args, reason):
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        load(**args)
    message = str(err.value)
    name = args.get("dataset_name", "PrimeIntellect/INTELLECT-3-RL")
    assert message.startswith(f"math-env: cannot load dataset '{name}' (subset "), message
    assert "offline (HF_HUB_OFFLINE=1), from the local cache" in message and reason in message
    assert f"datasets.load_dataset('{name}'" in message and "set dataset_name to that path" in message
    assert "HF_HUB_OFFLINE=0" in message
    assert time.monotonic() - start < 10, "offline means no waiting on the network"


def test_bad_arguments_are_refused_by_config_validate(register_plugin, prime_cli):
    register_plugin(plugin, name="math_env")
    env = [{"id": "math-env", "args": {"dataset_nme": "x", "math_verify_timeout": 0}},
           {"id": "math-env", "args": {"min_avg_reward": 0.9, "max_avg_reward": 0.1}}]
    result = prime_cli("config", "validate", "--orchestrator.env", json.dumps(env))
    out = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "orchestrator.env[0].args.dataset_nme: environment 'math-env' has no argument 'dataset_nme' (did you mean " \
           "'dataset_name'?)" in out
    assert "orchestrator.env[0].args.math_verify_timeout: Input should be greater than or equal to 1" in out
    assert "orchestrator.env[1].args: min_avg_reward (0.9) must not exceed max_avg_reward (0.1)" in out


def test_config_validate_names_a_dataset_offline_roles_would_not_find(register_plugin, prime_cli, offline_cache):
    """Before anything starts (``prime run`` and ``--dry-run`` run these checks), from the cache's
    metadata: an id not in the cache, a subset or split the cache lacks; a cached one passes."""
    register_plugin(plugin, name="math_env")
    env = [{"id": "math-env", "args": {"dataset_name": "PrimeIntellect/Hendrycks-Math", "dataset_subset": "default"}},
           {"id": "math-env", "args": {"dataset_name": "PrimeIntellect/Not-Cached"}},
           {"id": "math_env", "args": {"dataset_split": "test"}}]
    start = time.monotonic()
    result = prime_cli("config", "validate", "--orchestrator.env", json.dumps(env), env={"HF_HUB_OFFLINE": "1"})
    out = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "orchestrator.env[0]" not in out, out
    assert ("orchestrator.env[1].args: math-env: cannot load dataset 'PrimeIntellect/Not-Cached' (subset 'math', "
            "split 'train') offline (HF_HUB_OFFLINE=1), from the local cache") in out, out
    assert ("orchestrator.env[2].args: math-env: dataset 'PrimeIntellect/INTELLECT-3-RL' (subset 'math', split "
            "'test'): the cached dataset has no split 'test'; it has train") in out, out
    assert time.monotonic() - start < 30
    online = prime_cli("config", "validate", "--orchestrator.env", json.dumps(env), env={"HF_HUB_OFFLINE": "0"})
    assert "Not-Cached" not in online.output, "roles that may download are not held to the cache"


def test_the_seeds_slurm_config_validates(installed_plugins, prime_cli):
    # HF_HUB_OFFLINE=0: on a cluster the roles download the seed's hub model, not cached here
    result = prime_cli("config", "validate", str(SEEDS / "slurm_dense_hendrycks.toml"), env={"HF_HUB_OFFLINE": "0"})
    assert result.exit_code == 0, result.output
    # The MoE seed's environment is found, and its nccl weight transport (prime-plugin-vllm's) too.
    moe = prime_cli("config", "validate", str(SEEDS / "slurm_moe_hendrycks.toml"), env={"HF_HUB_OFFLINE": "0"})
    assert moe.exit_code == 0, moe.output


def test_the_answer_is_the_last_box_after_thinking():
    assert final_answer("\\boxed{\\frac{1}{2}} then \\boxed{\\sqrt{\\frac{a}{b}}}") == "\\sqrt{\\frac{a}{b}}"
    assert final_answer("<think>\\boxed{1}</think>") is None
    assert final_answer("\\boxed{ }") is None and final_answer("\\boxed{unclosed") is None


def test_a_check_that_hangs_is_killed_and_the_next_one_runs():
    checker = MathChecker(timeout=5, workers=1)
    try:
        assert checker.check("81", "3^4")
        checker.limit = 1.0  # below math-verify's own 5 s: the parent's limit is what ends it
        (process,) = checker._running
        start = time.monotonic()
        assert checker.check("2", "9^{9^{9^{9}}}") is False
        assert time.monotonic() - start < 4 and process.poll() is not None, "killed, not waited for"
        checker.limit = 20.0
        assert checker.check("2", "2.0") and checker._running != {process}, "a new process took its place"
    finally:
        checker.close()
    assert not checker._running


def test_no_checking_process_outlives_its_environment(problems_file, tmp_path):
    # Concurrent checks from threads start workers; close() ends them all.
    from concurrent.futures import ThreadPoolExecutor

    env = load(dataset_name=str(problems_file), dataset_subset=None, math_verify_max_workers=2)
    tasks = all_tasks(env)
    with ThreadPoolExecutor(6) as pool:
        rewards = list(pool.map(lambda t: env.score(t, t.answer), tasks * 2))
    assert rewards == [1.0] * len(tasks) * 2
    processes = list(env.checker._running)
    assert 1 <= len(processes) <= 2
    env.close()
    assert all(p.poll() is not None for p in processes)
    # A program that never calls close(), and one that is killed: their checkers go with them.
    script = (f"import os, sys\nfrom prime_plugin_math_env.env import load\n"
              f"env = load(dataset_name={str(problems_file)!r}, dataset_subset=None)\n"
              "task = env.tasks(__import__('random').Random(0), 1)[0]\n"
              "assert env.score(task, task.answer) == 1.0\n"
              "print(*[p.pid for p in env.checker._running], flush=True)\n"
              "if sys.argv[1] == 'kill': os.kill(os.getpid(), 9)\n")
    for how in ("exit", "kill"):
        result = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        pids = [int(pid) for pid in result.stdout.split()]
        assert pids, result.stderr
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), f"a checker outlived a program that did {how}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_offline_end_to_end_from_the_cli(hf_home, tmp_path):
    """`prime envs sft-data` in a fresh process, offline with the cache: the seeds' dataset by its
    Hub id; a dataset not in the cache fails with the message, fast."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    prime = str(Path(sys.executable).with_name("prime"))
    args = json.dumps({"dataset_name": "PrimeIntellect/Hendrycks-Math", "dataset_subset": "default"})
    out = tmp_path / "sft.jsonl"
    result = subprocess.run([prime, "envs", "sft-data", "math-env", str(out), "--n", "4", "--args", args], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][-1]["content"].startswith("\\boxed{") for r in rows)
    start = time.monotonic()
    missing = json.dumps({"dataset_name": "PrimeIntellect/Elsewhere", "dataset_subset": "default"})
    result = subprocess.run([prime, "envs", "sft-data", "math-env", str(out), "--args", missing], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "math-env: cannot load dataset 'PrimeIntellect/Elsewhere'" in result.stderr + result.stdout
    assert time.monotonic() - start < 60
