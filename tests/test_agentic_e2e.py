"""Multi-turn, tool-using rollouts end to end with real vLLM on this CPU machine.

One vLLM server (``prime inference``, the tiny model after the tool example's SFT warm-up)
serves every test of this module, in this order: token-exact multi-turn rollouts with the
trainer's log-probabilities matching vLLM's; faults (an environment that raises, a tool that
hangs, unknown tools, malformed calls) counted while the run goes on; ``prime eval`` on the
running server; and, last because it changes the served weights, the tool example's RL run
(``examples/tools``), where the policy learns to call the tool, with its eval at the
configured steps.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_core import hookimpl
from prime_core.orchestrator.batch import batch_file, read_batch
from prime_core.orchestrator.tools import Tool
from prime_core.testing import inference_server, records

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tools"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.last,  # its model is the warm-up scripts/test.sh starts in the background
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install.sh)"),
]
pytest_plugins = ["prime_core.testing"]


def prime(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"prime {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tool example's model: tiny, warmed up on calculator conversations (30% with the
    tool) for the example's 500 steps, which it needs to copy the tool's result reliably (300
    steps: 28%), in rows of 256 tokens as the example packs them (its samples are at most 194):
    the example's own ``examples/tools/run.sh``, with ``WARM_ONLY=1``. ``scripts/test.sh``
    starts it in the background before its first pytest run (``PRIME_TOOL_WARMUP``, its output
    folder); this waits for it there."""
    started = os.environ.get("PRIME_TOOL_WARMUP", "off")
    if started != "off":
        return _started_warm_up(Path(started))
    root = tmp_path_factory.mktemp("tool-model")
    env = {**os.environ, "OUT": str(root), "WARM_ONLY": "1", "PYTHON": sys.executable,
           "PRIME": str(Path(sys.executable).with_name("prime")),
           "SFT_STEPS": os.environ.get("PRIME_TOOL_SFT_STEPS", "500")}
    result = subprocess.run(["bash", str(EXAMPLE / "run.sh")], env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (f"examples/tools/run.sh exited {result.returncode}:\n{result.stdout}\n"
                                    f"{result.stderr}")
    return root / "sft" / "model"


def _started_warm_up(root: Path, timeout: float = 1800) -> Path:
    deadline = time.monotonic() + timeout
    while not (root / "rc").exists():
        assert time.monotonic() < deadline, f"the tool warm-up started by scripts/test.sh in {root} " \
                                            f"did not finish in {timeout:.0f} s; its log: {root / 'log'}"
        time.sleep(1)
    log = (root / "log").read_text() if (root / "log").exists() else "(no log)"
    rc = (root / "rc").read_text().strip()
    assert rc == "0", f"examples/tools/run.sh (started by scripts/test.sh) exited {rc}:\n{log}"
    return root / "sft" / "model"


@pytest.fixture(scope="module")
def server(tool_model, tmp_path_factory):
    """``prime inference`` on the tool model, for the whole module."""
    with inference_server(tool_model, tmp_path_factory.mktemp("server"), "--model.dtype", "float32",
                          "--model.enforce-eager", "--model.max-model-len", "512") as url:
        yield url


def client(url: str):
    from prime_core.inference.backend import select_backend

    return select_backend("auto", key="orchestrator.client.backend").client(url, api_key=None, timeout=120)


def test_the_warm_model_calls_the_tool_sometimes_and_copies_its_result(tool_model):
    """What RL starts from, exactly (examples/tools/probe.py): the warm model makes the right
    call in a fifth of first turns and copies the tool's result most of the time, so calling
    the tool is what RL can reward (0.21 and 0.84 after the example's SFT)."""
    spec = importlib.util.spec_from_file_location("tools_probe", EXAMPLE / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.probe(tool_model, n=32)
    assert found["p_call"] > 0.08 and found["p_copy"] > 0.5 and found["p_direct"] < 0.05, found


def test_multi_turn_rollouts_are_token_exact_and_on_policy(tool_model, server):
    """Calculator episodes against vLLM: the trained tokens are exactly the sampled ones, the
    tool turns have mask 0, and the trainer's log-probabilities on the packed multi-turn
    samples equal vLLM's (mismatch KL near zero on-policy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_core.orchestrator.batch import pack
    from prime_core.orchestrator.episode import Episode, Limits, env_tools, run_episode
    from prime_core.orchestrator.hermes import parse
    from prime_core.trainer.model import predicted_logprobs
    from prime_core.trainer.step import prediction_tensors
    from prime_plugin_tasks.calculator import Calculator

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    env = Calculator(digits=3)
    tasks = env.tasks(random.Random(0), 12)
    sampler = client(server)
    sampled: dict[str, list] = {}

    async def record(request):
        samples = await sampler.sample(request)
        sampled.setdefault(request.session_id, []).extend(samples)
        return samples

    async def main():
        episodes = [Episode(task=t, sampler=record, tokenizer=tokenizer, parse=parse,
                            limits=Limits(max_turns=3, max_tokens=512, turn_max_tokens=96),
                            tools=env_tools(env, t), session_id=f"exact-{i}") for i, t in enumerate(tasks)]
        try:
            return await asyncio.gather(*(run_episode(env, t, e) for t, e in zip(tasks, episodes, strict=True)))
        finally:
            await sampler.close()

    outcomes = asyncio.run(main())
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    with_tools = [o for o in outcomes if o.episode.tool_calls]
    assert with_tools, "the warmed-up model calls the calculator in some episodes"
    samples = []
    for o in outcomes:
        got = [(t, lp) for s in sampled[o.episode.session_id] for t, lp in zip(s.token_ids, s.logprobs, strict=True)]
        recorded = [(t, lp) for seg in o.episode.trajectory.segments
                    for t, m, lp in zip(seg.ids, seg.mask, seg.logprobs, strict=True) if m]
        assert recorded == got, "trained tokens are exactly vLLM's, with its log-probabilities"
        samples += o.episode.trajectory.samples(advantage=1.0, reward=o.reward, version=0)
    # ChatML keeps the prefix, so a trajectory is one sample, except where a sampled turn's text
    # does not re-encode to its tokens (a random model can sample bytes that are not UTF-8):
    # that trajectory is split, each part still exact (checked above), and counted.
    whole = [o for o in outcomes if o.episode.trajectory.splits == 0]
    assert len(whole) >= 0.75 * len(outcomes), [o.episode.trajectory.splits for o in outcomes]
    assert all(len(o.episode.trajectory.segments) == 1 + o.episode.trajectory.splits for o in outcomes)
    whole_with_tools = [o for o in with_tools if o in whole]
    assert whole_with_tools, "some tool-calling trajectories are one sample"
    for o in whole_with_tools:
        (segment,) = o.episode.trajectory.segments
        text = tokenizer.decode([t for t, m in zip(segment.ids, segment.mask, strict=True) if not m])
        assert "<|im_start|>tool\n" in text, "the tool's turn is in the sample, untrained"
        turns = [m["role"] for m in o.episode.messages][len(o.episode.task.prompt):]
        assert turns[:2] == ["assistant", "tool"]

    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    kl, tokens = 0.0, 0
    with torch.no_grad():
        for row in pack(samples, 2048):
            t, _ = prediction_tensors(vars(row), "cpu")
            logp, _ = predicted_logprobs(model, t["input_ids"][None], t["position_ids"][None], t["targets"])
            mask = t["loss_mask"].bool()
            log_ratio = logp[mask] - t["inference_logprobs"][mask]
            kl += float((log_ratio.exp() - log_ratio - 1).sum())
            tokens += int(mask.sum())
    assert tokens == sum(sum(s.mask) for s in samples)
    assert kl / tokens < 1e-3, f"trainer and vLLM disagree on multi-turn samples: mismatch KL {kl / tokens:.2e}"


class Faulty:
    """Calculator tasks with faults: rollouts whose answer is odd raise in the environment;
    the tools are a calculator that hangs (``slow_calculator``) and no ``calculator``, so the
    model's usual call is an unknown tool."""

    def __init__(self):
        from prime_plugin_tasks.calculator import Calculator

        self.inner = Calculator(digits=3)
        self.tools = [Tool(name="slow_calculator", fn=lambda expression: time.sleep(3600),
                           parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]

    def tasks(self, rng, n):
        return self.inner.tasks(rng, n)

    def score_episode(self, task, episode):
        if int(task.answer) % 2 and episode.turns:
            raise RuntimeError("this environment fails on purpose")
        return self.inner.score(task, episode.completion)


class SlowTools(Faulty):
    """Every call to ``calculator`` hangs (the tool timeout answers it)."""

    def __init__(self):
        super().__init__()
        self.tools = [Tool(name="calculator", fn=lambda expression: time.sleep(3600),
                           parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]

    def score_episode(self, task, episode):
        return self.inner.score(task, episode.completion)


def test_faults_fail_one_rollout_each_and_the_run_goes_on(tool_model, server, register_plugin, tmp_path, capsys):
    """An environment that raises drops its group (counted as env_errors), a hanging tool
    times out, unknown tools and calls cut off mid-way are answered with error turns; the
    orchestrator writes every step."""
    from prime_core.orchestrator.config import OrchestratorConfig
    from prime_core.orchestrator.role import Orchestrator
    from prime_core.specs import Environment

    class Plugin:
        @hookimpl
        def prime_environments(self):
            return [Environment(name="faulty", load=Faulty), Environment(name="slow_tools", load=SlowTools)]

    import prime_plugin_vllm.plugin as vllm_plugin

    register_plugin(Plugin(), name="faults")
    register_plugin(vllm_plugin, name="vllm")  # the sampling client of the server this module runs
    out = tmp_path / "faults"
    config = OrchestratorConfig.model_validate({
        "model": {"name": str(tool_model)}, "output_dir": str(out), "client": {"base_url": [server]},
        "env": [{"id": "faulty"}, {"id": "slow_tools"}], "batch_size": 32, "rollouts_per_example": 4,
        "max_steps": 2, "seq_len": 512, "sampling": {"max_tokens": 60},  # 60 tokens cut some calls off
        "rollout": {"max_turns": 3, "tool_timeout": 1.0}})
    orchestrator = Orchestrator(config)
    orchestrator.wait_healthy()
    started = time.monotonic()
    asyncio.run(orchestrator.run(start=1))
    steps = records(out, "orchestrator")
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["env_errors"] for r in steps) > 0 and sum(r["failed_groups"] for r in steps) > 0
    assert sum(r["tool_errors"] for r in steps) > 0
    log = capsys.readouterr().out
    assert "environment 'faulty':" in log and "RuntimeError: this environment fails on purpose" in log
    batches = [read_batch(batch_file(out, s)) for s in (1, 2)]
    assert all(b["micro_batches"] for b in batches)
    assert time.monotonic() - started < 600, "hanging tools do not hang the run"


def test_prime_eval_on_a_running_server(tool_model, server, tmp_path):
    out = tmp_path / "eval"
    result = prime("eval", str(EXAMPLE / "rl.toml"), "--no-inference", "--orchestrator.client.base-url", server,
                   "--model.name", str(tool_model), "--output-dir", str(out),
                   "--orchestrator.eval.num-examples", "8", "--orchestrator.eval.rollouts-per-example", "4",
                   check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "eval" / "results.json").read_text())
    metrics = results["environments"]["calculator"]
    assert set(metrics) >= {"avg@4", "pass@1", "pass@2", "pass@4", "env_errors"}
    assert 0.0 <= metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"] <= 1.0
    assert "calculator: avg@4" in result.stdout


def test_tool_example_learns_to_call_the_tool_with_eval_and_on_policy_samples(tool_model, server, tmp_path,
                                                                              installed_plugins):
    """The tool example's RL run (shortened), on the module's server: every step trains, eval
    records appear at steps 0, interval and the last step, the first step trains on vLLM's own
    log-probabilities (mismatch KL ~ 0), and the policy learns to call the tool: tool calls per
    sample and the reward rise (0.29 -> 0.95 and 0.23 -> 0.65 in the example's first 20 steps;
    0.26 -> 0.77 and 0.24 -> 0.58 from steps 1-2 to 8-10 of this test in one run; the margins
    asked leave several times the noise of these means at batch 64). examples/tools/report.py
    reads the run. Then the server serves step 10's policy, and a new run from scratch on it
    samples from the base model again (its probe is the first run's first)."""
    out, steps = tmp_path / "rl", 10
    prime("run", str(EXAMPLE / "rl.toml"), "--model.name", str(tool_model), "--output-dir", str(out),
          "--no-inference", "--orchestrator.client.base-url", server, "--max-steps", str(steps),
          "--orchestrator.batch-size", "64", "--orchestrator.eval.interval", "5",
          "--orchestrator.eval.num-examples", "8", timeout=1500)
    trainer, orchestrator, evals = records(out, "trainer"), records(out, "orchestrator"), records(out, "eval")
    assert [r["step"] for r in orchestrator] == [r["step"] for r in trainer] == list(range(1, steps + 1))
    assert [r["step"] for r in evals] == [0, 5, 10], "eval at step 0, every interval and the last step"
    for r in evals:
        assert 0.0 <= r["eval/calculator/pass@1"] <= r["eval/calculator/pass@4"] <= 1.0
        assert r["eval/calculator/avg@4"] == pytest.approx(r["eval/calculator/pass@1"])  # 0/1 rewards
    assert abs(trainer[0]["mismatch_kl"]) < 1e-3, f"trainer and vLLM disagree: {trainer[0]['mismatch_kl']}"
    assert all(r["env_errors"] == 0 for r in orchestrator)
    calls = [r["tool_calls"] / r["samples"] for r in orchestrator]
    rewards = [r["reward"] for r in orchestrator]
    assert sum(calls[-3:]) / 3 > sum(calls[:2]) / 2 + 0.2, f"the policy learns to call the tool: {calls}"
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.1, f"the reward rises with the tool: {rewards}"
    report = subprocess.run([sys.executable, str(EXAMPLE / "report.py"), str(out)], capture_output=True, text=True,
                            check=True).stdout
    assert "sampled reward: first" in report and "eval at step 10:" in report

    from prime_core.orchestrator.config import OrchestratorConfig
    from prime_core.orchestrator.role import Orchestrator

    again = tmp_path / "again"
    config = OrchestratorConfig.model_validate({
        "model": {"name": str(tool_model)}, "output_dir": str(again), "client": {"base_url": [server]},
        "env": [{"id": "calculator", "args": {"digits": 3, "operations": "+"}}], "batch_size": 8,
        "rollouts_per_example": 8, "max_steps": 1, "seq_len": 512, "rollout": {"tool_parser": "hermes"}})
    asyncio.run(Orchestrator(config).run(start=1))
    probes = [orchestrator[0]["probe_logprob"], records(again, "orchestrator")[0]["probe_logprob"],
              orchestrator[-1]["probe_logprob"]]
    assert probes[1] == pytest.approx(probes[0], abs=1e-4) and abs(probes[2] - probes[0]) > 1e-3, probes
