"""The RL trainer loop (``prime trainer CONFIG``), one process on one CPU or GPU.

Step N: wait for ``rollouts/step_N/batch.json``, compute the loss over its micro-batches
(token-level normalisation over the whole step), clip, optimise, publish the weights as
policy version N, log metrics, and checkpoint every ``ckpt.interval`` steps. With
``resume`` it continues after the newest complete checkpoint; the metrics of steps that are
redone are moved aside so ``metrics.jsonl`` has no gap and no repeat.
"""

from __future__ import annotations

import time

from prime_core.metrics import METRICS_FILE, MetricsLogger, drop_steps_from
from prime_core.orchestrator.batch import wait_for_batch
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt
from prime_core.trainer.model import build_model, token_logprobs
from prime_core.trainer.optim import build_optimizer, build_scheduler, clip_and_step
from prime_core.weights import remove_after

SHOW = ("loss", "reward", "entropy", "mismatch_kl", "grad_norm", "tokens_per_s")


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_step(model, batch: dict, loss_fn, loss_kwargs: dict, device: str) -> dict:
    """Forward and backward over every micro-batch of one step; returns summed diagnostics."""
    import torch

    micro_batches = batch["micro_batches"]
    temperature = batch.get("temperature", 1.0) or 1.0
    total_tokens = sum(sum(mb["loss_mask"]) for mb in micro_batches) or 1
    sums = {"loss": 0.0, "entropy": 0.0, "mismatch_kl": 0.0, "is_masked": 0.0}
    for mb in micro_batches:
        input_ids = torch.tensor([mb["input_ids"]], dtype=torch.long, device=device)
        position_ids = torch.tensor([mb["position_ids"]], dtype=torch.long, device=device)
        mask, inference_logprobs, advantages = (torch.tensor(mb[key], dtype=torch.float32, device=device)
                                                for key in ("loss_mask", "inference_logprobs", "advantages"))
        logp, entropy = token_logprobs(model, input_ids, position_ids, temperature=temperature)
        loss_tok, extra = loss_fn(logp, inference_logprobs, advantages, **loss_kwargs)
        loss = (loss_tok * mask).sum() / total_tokens
        loss.backward()
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float((entropy * mask).sum()) / total_tokens
        for key in ("mismatch_kl", "is_masked"):
            if key in extra:
                sums[key] += float((extra[key] * mask).sum()) / total_tokens
    sums["loss_tokens"] = total_tokens
    sums["tokens"] = sum(len(mb["input_ids"]) for mb in micro_batches)
    return sums


def run(config) -> int:
    import torch

    manager = get_plugin_manager()
    torch.manual_seed(config.seed)
    device = device_name()
    model, impl = build_model(config.model, manager, device=device)
    model.train()
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, config.max_steps)
    loss_fn = manager.select("algorithms", f"loss:{config.loss.type}", key="trainer.loss.type",
                             shown=config.loss.type).fn
    transport = manager.select("weight_transports", config.weight_broadcast.type, key="weight_broadcast.type")
    publisher = transport.publisher(config, output_dir=config.output_dir)
    metrics = MetricsLogger(config, role="trainer", output_dir=config.output_dir)

    done = 0
    if config.resume:
        found = ckpt.complete_checkpoints(config.output_dir)
        if found:
            done, path = found[-1]
            ckpt.load(path, model, optimizer)
            for _ in range(done):
                scheduler.step()
        remove_after(config.output_dir, done)  # weights a crashed run published after its checkpoint
        moved = drop_steps_from(config.output_dir / METRICS_FILE, "trainer", done + 1)
        print(f"resuming after step {done}" + (f" from {path}" if found else " (no complete checkpoint)")
              + f"; {moved} superseded metric lines moved aside", flush=True)
        if done:
            publisher.publish(model, done)  # the orchestrator reloads inference from here
    print(f"trainer: model {config.model.name} ({impl}) on {device}, steps {done + 1}..{config.max_steps}",
          flush=True)

    step = done
    while config.max_steps is None or step < config.max_steps:
        step += 1
        batch = wait_for_batch(config.output_dir, step)
        start = time.perf_counter()
        sums = train_step(model, batch, loss_fn, config.loss.kwargs, device)
        grad_norm = clip_and_step(model, optimizer, scheduler, config.optim.max_norm)
        elapsed = time.perf_counter() - start
        publisher.publish(model, step)
        manager.hook.prime_on_weights_published(step=step, path=str(config.output_dir / "weights" / f"step_{step}"))
        info = batch.get("info", {})
        record = {
            "loss": sums["loss"], "entropy": sums["entropy"], "mismatch_kl": sums["mismatch_kl"],
            "is_masked": sums["is_masked"], "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
            "tokens": sums["tokens"], "loss_tokens": sums["loss_tokens"], "step_time": elapsed,
            "tokens_per_s": sums["tokens"] / elapsed if elapsed else 0.0,
            "reward": info.get("reward", float("nan")),
            "off_policy_max": info.get("off_policy_max", 0), "policy_versions": info.get("versions", []),
        }
        metrics.log(step, record, show=SHOW)
        if config.ckpt.interval and step % config.ckpt.interval == 0:
            path = ckpt.save(config.output_dir, step, model, optimizer, {}, keep_last=config.ckpt.keep_last)
            manager.hook.prime_on_checkpoint(step=step, path=str(path))
    metrics.close()
    return 0
