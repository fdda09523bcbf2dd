"""Numerical parity of training strategies against a single eager process.

    python -m prime_core.parity MODEL_DIR OUT_DIR CASES.json [--reference] [--save-ckpt] [--load-ckpt]

runs each case (``{"name": ..., "model": {trainer.model keys}, "optim": {...}}``; the model is
float32, one row per forward pass (``pass_tokens = 1``), unless the case says otherwise, and
``impl`` is the core's default unless set; the RL trainer's loss, or SFT's with ``"loss": "sft"``) for
``steps`` optimizer steps on the same deterministic, variable-length packed batches, and
writes ``OUT_DIR/<name>.pt`` with the losses, gradient norms and final full weights. Run it
under torchrun for N processes; ``--reference`` builds the plain model instead (one process,
no strategies except those that change what the model computes: LoRA, the LM head, FP8), and
runs it twice: in float32 (``<name>.reference.pt``) and in float64 (``<name>.reference64.pt``,
the exact answer for this host). Parallel-strategy plugins, ours or a third party's, compare
the results with ``compare`` (see ``plugins/parallel/*/tests``).

The bound is derived, not tuned: a result passes when its error against the float64 run is
at most ``FACTOR`` times the float32 eager reference's own error against it (per weight
tensor, and per step's loss). Every float32 computation of the same training rounds
differently (reduction order across processes, fused compiled kernels, another instruction
set), and each such error is of the size of the eager reference's own; a fixed tolerance
tuned on one host fails on another whose float32 kernels round differently.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

STEPS = 3
SEQ_LEN = 96
SAMPLES = 12
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
"""The model the plugins' parity tests use (``prime_plugin_hf.tiny.build_tiny(path, **TINY)``)."""


def batch_for(step: int, vocab_size: int) -> dict:
    from prime_core.trainer.fake import FakeDataConfig, fake_batch

    return fake_batch(FakeDataConfig(batch_size=SAMPLES, length="variable"), SEQ_LEN, vocab_size,
                      random.Random(1000 + step))


FACTOR = 8.0
"""How many times the eager float32 reference's own error (against float64) a result may have."""
EPS32 = 2.0**-23
"""float32's relative rounding step: the smallest error a tensor's bound grants (one step of
its largest value)."""


def run_case(case: dict, model_dir: str, out_dir: Path, *, reference: bool, save_ckpt: bool,
             load_ckpt: bool, world, exact: bool = False) -> None:
    import torch

    from prime_core.config.checks import section_model
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer import ckpt
    from prime_core.trainer.build import Training, build_policy, full_state_dict
    from prime_core.trainer.config import OptimConfig, SchedulerConfig
    from prime_core.trainer.optim import build_optimizer, build_scheduler
    from prime_core.trainer.step import train_step

    manager = get_plugin_manager()
    # One row per forward pass unless the case stacks them: the reference and a run of several
    # processes would otherwise stack different rows, and the bound is for the strategy's own
    # rounding (stacking is checked against one row per pass in tests/test_rl_pieces.py).
    model_config = section_model("trainer", "model")(**{"name": model_dir, "dtype": "float32", "pass_tokens": 1,
                                                        **case.get("model", {})})
    optim_config = OptimConfig(**{"lr": 1e-2, "weight_decay": 0.01, **case.get("optim", {})})
    world.dims = None
    torch.manual_seed(0)
    policy = build_policy(model_config, manager, world, reference=reference)
    if exact:  # the float64 run of the reference: what float32 computations are compared against
        policy.model.double()
    policy.model.train()
    optimizer = build_optimizer(policy.model, optim_config,
                                cpu_offload=model_config.optim_cpu_offload and not reference)
    training = Training(world=world, policy=policy, optimizer=optimizer,
                        scheduler=build_scheduler(optimizer, SchedulerConfig(), None),
                        pass_tokens=model_config.pass_tokens)
    steps = case.get("steps", STEPS)
    first = 1
    if load_ckpt:
        progress = ckpt.load(out_dir / case["name"] / "checkpoints" / f"step_{case['ckpt_step']}",
                             policy.model, optimizer)
        first = progress["step"] + 1
    # SFT's loss (the masked token cross-entropy: no entropy asked of the LM head) where the case says so
    loss_fn = None if case.get("loss") == "sft" else manager.select("algorithms", "loss:default").fn
    losses, norms = [], []
    for step in range(first, steps + 1):
        sums = train_step(training, batch_for(step, policy.hf_config.vocab_size)["micro_batches"], max_norm=1.0,
                          loss_fn=loss_fn)
        norms.append(sums["grad_norm"])
        losses.append(sums["loss"])
        if save_ckpt and step == case.get("ckpt_step"):
            ckpt.save(out_dir / case["name"], step, policy.model, optimizer, {}, world=world)
    state = full_state_dict(policy, world)
    state = getattr(state, "tensors", state)  # a LoRA run publishes only its adapter
    if world.main:
        suffix = ".reference64" if exact else ".reference" if reference else ""
        torch.save({"losses": losses, "grad_norms": norms, "state": state, "applied": policy.applied,
                    "world_size": world.size, "layout": layout(policy.model, optimizer)},
                   out_dir / f"{case['name']}{suffix}.pt")


def layout(model, optimizer) -> dict:
    """How rank 0 holds each sharded parameter (published names): its mesh dimensions,
    placements, full and local shapes, and the local elements of its optimizer state."""
    from torch.distributed.tensor import DTensor

    from prime_core.trainer.build import clean_names

    found = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            state = optimizer.state.get(param, {})
            found[name] = {"mesh": list(param.device_mesh.mesh_dim_names or ()),
                           "placements": [str(p) for p in param.placements], "shape": list(param.shape),
                           "local_shape": list(param.to_local().shape),
                           "optim_local": sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                                              for k, v in state.items() if k != "step" and hasattr(v, "numel"))}
    return clean_names(found)


def distance(state: dict, other: dict) -> float:
    """The 2-norm of the difference of all weights of two results' ``state``."""
    return sum(float((value.double() - other[key].double()).pow(2).sum()) for key, value in state.items()) ** 0.5


def exact_path(reference: Path) -> Path:
    """The float64 run beside a float32 reference (``x.reference.pt`` -> ``x.reference64.pt``)."""
    reference = Path(reference)
    return reference.with_name(f"{reference.stem}64{reference.suffix}")


def compare(reference: Path, result: Path, *, rtol: float = 1e-4, atol: float = 2e-5,
            factor: float = FACTOR) -> dict:
    """Raise ``AssertionError`` naming the first mismatch; returns the largest differences.

    With the float64 run beside ``reference`` (``exact_path``), the bound is derived from the
    reference's own error (module docstring); without one, ``rtol`` / ``atol`` apply."""
    import torch

    ref, got = torch.load(reference, weights_only=False), torch.load(result, weights_only=False)
    exact_file = exact_path(reference)
    exact = torch.load(exact_file, weights_only=False) if exact_file.is_file() else None
    assert len(ref["losses"]) == len(got["losses"]) and ref["losses"], (ref["losses"], got["losses"])
    assert ref["state"].keys() == got["state"].keys(), set(ref["state"]) ^ set(got["state"])
    if exact is not None:
        return _compare_derived(ref, got, exact, factor)
    worst = {"loss": 0.0, "weight": 0.0}
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= atol + rtol * abs(a), f"step {step}: loss {b} vs reference {a}"
        worst["loss"] = max(worst["loss"], abs(a - b))
    for key, a in ref["state"].items():
        b = got["state"][key]
        diff = float((a.float() - b.float()).abs().max())
        assert torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol), f"{key}: max difference {diff}"
        worst["weight"] = max(worst["weight"], diff)
    return worst


def _compare_derived(ref: dict, got: dict, exact: dict, factor: float) -> dict:
    """``got`` is within ``factor`` times ``ref``'s own distance to ``exact`` (float64)."""
    worst = {"loss": 0.0, "weight": 0.0, "ratio": 0.0}
    for step, (a, b, e) in enumerate(zip(ref["losses"], got["losses"], exact["losses"], strict=True), 1):
        own, err = abs(a - e), abs(b - e)
        allowed = factor * max(own, EPS32 * abs(e))
        assert err <= allowed, (f"step {step}: loss {b} is {err:.3g} from the float64 run's {e}, "
                                f"{err / max(own, 1e-30):.1f}x the float32 eager reference's own error ({own:.3g}); "
                                f"at most {factor:g}x is allowed")
        worst["loss"] = max(worst["loss"], abs(a - b))
    for key, a in ref["state"].items():
        b, e = got["state"][key].double(), exact["state"][key].double()
        own, err = float((a.double() - e).abs().max()), float((b - e).abs().max())
        allowed = factor * max(own, EPS32 * float(e.abs().max()))
        assert err <= allowed, (f"{key}: max error {err:.3g} against the float64 run, {err / max(own, 1e-30):.1f}x the "
                                f"float32 eager reference's own ({own:.3g}); at most {factor:g}x is allowed")
        worst["weight"] = max(worst["weight"], float((a.double() - b).abs().max()))
        worst["ratio"] = max(worst["ratio"], err / max(own, EPS32 * float(e.abs().max())))
    return worst


def too_few_gpus(processes: int) -> bool:
    """Whether this machine has GPUs but fewer than ``processes``: NCCL takes one GPU per
    process, so such a parity run goes to the CPU (gloo), and its reference with it."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() < processes


def run(model_dir, out_dir: Path, cases: list[dict], *, processes: int = 1, reference: bool = False,
        save_ckpt: bool = False, load_ckpt: bool = False, timeout: float = 600, cpu: bool = False,
        fresh: bool = False) -> None:
    """Run ``cases`` in ``processes`` gloo/NCCL processes (torchrun; where no GPU is visible, ranks
    forked with torch already imported: ``prime_core.testing.ranks``) or as the reference; on
    the CPU with gloo, GPUs hidden, when ``cpu``.

    One process (the reference, or a checkpoint resumed in one) runs in this process
    (``run_here``) unless GPUs are to be hidden: a fresh interpreter would spend most of its
    time importing torch and transformers (about 8 of a tiny reference's 10 seconds on 2 cores).
    ``fresh``: a new process all the same (one that sees the environment as it is now, where
    this process imported something under an earlier one)."""
    import os
    import sys

    from prime_core.testing import ranks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if processes == 1 and not (cpu or fresh):
        run_here(model_dir, out_dir, cases, reference=reference, save_ckpt=save_ckpt, load_ckpt=load_ckpt)
        return
    spec = out_dir / f"cases-{processes}-{'ref' if reference else 'run'}.json"
    spec.write_text(json.dumps(cases))
    argv = [str(model_dir), str(out_dir), str(spec)]
    argv += [flag for flag, on in (("--reference", reference), ("--save-ckpt", save_ckpt),
                                   ("--load-ckpt", load_ckpt)) if on]
    # faulthandler: a rank that crashes in native code prints its Python stack.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    for attempt in (1, 2):
        done = ranks.launch(processes, "prime_core.parity:main", argv, timeout=timeout, env=env, fresh=fresh,
                            log_dir=out_dir / f"ranks-{spec.stem}")
        if done.returncode < 0:  # a forked rank's signal (or one that killed torchrun itself)
            crash = -done.returncode
        else:
            crash = killed_by_signal(done.stderr) if done.returncode and processes > 1 else None
        if crash is None or attempt == 2:
            break
        # Gloo on a loaded 2-core machine has segfaulted a rank mid-collective, once in many CI
        # runs; a rerun is the same computation from the same seed, and a second crash fails.
        import warnings

        warnings.warn(f"parity run: a rank died of signal {crash}; running it once more. Its log:\n"
                      f"{(done.stdout + done.stderr)[-6000:]}", stacklevel=2)
    if done.returncode:
        sys.stderr.write(done.stdout[-12000:] + done.stderr[-8000:])
        raise AssertionError(f"parity run failed ({done.returncode}): {' '.join(map(str, done.args))}")


def killed_by_signal(torchrun_stderr: str) -> int | None:
    """The signal a rank died of, from torchrun's report ("failed (exitcode: -11) local_rank:
    2"), or None when every rank that failed exited on its own."""
    import re

    found = re.search(r"exitcode: -(\d+)\)", torchrun_stderr)
    return int(found.group(1)) if found else None


def check(model_dir, out_dir: Path, cases: list[dict], *, processes: int, **tolerance) -> dict[str, dict]:
    """Run ``cases`` as the reference and in ``processes`` processes, ``compare`` each, and
    return every case's result (``losses``, ``state``, ``applied``, ... plus ``worst``)."""
    import torch

    out_dir = Path(out_dir)
    run(model_dir, out_dir, cases, reference=True)
    run(model_dir, out_dir, cases, processes=processes)
    results = {}
    for case in cases:
        worst = compare(out_dir / f"{case['name']}.reference.pt", out_dir / f"{case['name']}.pt", **tolerance)
        results[case["name"]] = {**torch.load(out_dir / f"{case['name']}.pt", weights_only=False), "worst": worst}
    return results


def run_cases(cases: list[dict], model_dir, out_dir: Path, *, reference: bool, save_ckpt: bool, load_ckpt: bool,
              world) -> None:
    """Each case in turn; a float32 reference also runs in float64 (the exact answer)."""
    for case in cases:
        run_case(case, str(model_dir), out_dir, reference=reference, save_ckpt=save_ckpt, load_ckpt=load_ckpt,
                 world=world)
        if reference and not load_ckpt and case.get("model", {}).get("dtype", "float32") == "float32":
            run_case(case, str(model_dir), out_dir, reference=True, save_ckpt=False, load_ckpt=False, world=world,
                     exact=True)
        if world.main:
            print(f"parity case {case['name']}: done", flush=True)


def run_here(model_dir, out_dir: Path, cases: list[dict], **flags) -> None:
    """``run_cases`` in this process, as one process; the caller's random state is restored
    and a process group the cases started (a strategy's one-process mesh) is torn down."""
    import torch
    import torch.distributed as dist

    from prime_core import distributed

    had_group = dist.is_available() and dist.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        try:
            run_cases(cases, model_dir, Path(out_dir), world=distributed.init(), **flags)
        finally:
            if not had_group and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_core.parity")
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("cases", type=Path)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--save-ckpt", action="store_true")
    parser.add_argument("--load-ckpt", action="store_true")
    args = parser.parse_args(argv)

    from prime_core import distributed

    world = distributed.init()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run_cases(json.loads(args.cases.read_text()), args.model_dir, args.out_dir, reference=args.reference,
              save_ckpt=args.save_ckpt, load_ckpt=args.load_ckpt, world=world)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    from prime_core.distributed import exit_process

    exit_process(main())
