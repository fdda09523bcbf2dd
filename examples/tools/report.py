"""Print what an RL run of the tool example did: mean sampled reward over the first and last
steps, how often the policy called the tool, the eval results (avg@k, pass@k) at each evaluated
step, the orchestrator's own CPU time per step, and the wall times.

    python examples/tools/report.py outputs/tools/rl [--sft-seconds S --rl-seconds S] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("role") == "orchestrator"]
    evals = [r for r in rows if r.get("role") == "eval"]
    k = max(1, min(5, len(steps) // 4))

    def mean(key, part):
        values = [r[key] for r in part if isinstance(r.get(key), int | float)]
        return sum(values) / len(values) if values else float("nan")

    per_rollout = [r["tool_calls"] / r["samples"] for r in steps if r.get("samples")]
    return {
        "steps": len(steps), "window": k,
        "reward_first": mean("reward", steps[:k]), "reward_last": mean("reward", steps[-k:]),
        "tool_calls_per_sample_first": sum(per_rollout[:k]) / k if per_rollout else None,
        "tool_calls_per_sample_last": sum(per_rollout[-k:]) / k if per_rollout else None,
        "env_errors": sum(r.get("env_errors", 0) for r in steps),
        "orchestrator_cpu_s_per_step": mean("orchestrator_cpu_s", steps[1:]),
        "step_time_s": mean("step_time", steps[1:]),
        "eval": {r["step"]: {key.split("/", 1)[1]: value for key, value in r.items()
                             if key.startswith("eval/") and "@" in key} for r in evals},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--sft-seconds", type=int)
    parser.add_argument("--rl-seconds", type=int)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    s = summary(args.run)
    s.update(sft_seconds=args.sft_seconds, rl_seconds=args.rl_seconds)
    k = s["window"]
    print(f"sampled reward: first {k} steps {s['reward_first']:.3f} -> last {k} steps {s['reward_last']:.3f} "
          f"({s['steps']} steps); tool calls per sample {s['tool_calls_per_sample_first']:.2f} -> "
          f"{s['tool_calls_per_sample_last']:.2f}")
    for step, metrics in sorted(s["eval"].items()):
        print(f"eval at step {step}: " + ", ".join(f"{key} {value:.3f}" for key, value in sorted(metrics.items())))
    print(f"orchestrator CPU per step {s['orchestrator_cpu_s_per_step']:.2f} s of {s['step_time_s']:.2f} s per step; "
          f"env errors {s['env_errors']}")
    if args.rl_seconds is not None:
        print(f"wall time: model + SFT {args.sft_seconds} s, RL {args.rl_seconds} s")
    if args.json:
        args.json.write_text(json.dumps(s, indent=2) + "\n")


if __name__ == "__main__":
    main()
