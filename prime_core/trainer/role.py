"""The RL trainer loop (``prime trainer CONFIG``), one process or several under torchrun.

Step N: wait for ``rollouts/step_N/batch.safetensors`` (or ``batch.json``), take this rank's
share of its packed rows, compute the loss (normalised by the loss tokens of the whole step),
clip, optimise, publish
the full weights as policy version N (rank 0 writes them), log metrics, and checkpoint every
``ckpt.interval`` steps (sharded, every rank writes its part). With ``resume`` it continues
after the newest complete checkpoint; the metrics of steps that are redone are moved aside so
``metrics.jsonl`` has no gap and no repeat. With ``bench`` it trains a few steps on fake data
and prints a throughput table instead.
"""

from __future__ import annotations

import random
import threading
import time

from prime_core import distributed
from prime_core.metrics import METRICS_FILE, MetricsLogger, drop_steps_from
from prime_core.orchestrator.batch import wait_for_batch
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt, modes
from prime_core.trainer.build import full_state_dict, start_training
from prime_core.trainer.fake import FakeDataConfig, fake_batch
from prime_core.trainer.step import train_step
from prime_core.weights import remove_after

SHOW = ("loss", "reward", "entropy", "mismatch_kl", "teacher_kl", "grad_norm", "tokens_per_s")


def run(config) -> int:
    manager = get_plugin_manager()
    bench = config.bench
    fake = config.data.fake or (FakeDataConfig() if bench else None)
    max_steps = bench.total_steps if bench else config.max_steps
    training = start_training(config, "trainer", max_steps=max_steps, seed=config.seed, manager=manager)
    world, policy = training.world, training.policy
    loss_fn = config.loss.function(manager)
    rng = random.Random(fake.seed if fake else 0)
    if bench:
        return run_bench(config, training, loss_fn, fake, rng)

    transport = manager.select("weight_transports", config.weight_broadcast.type, key="weight_broadcast.type")
    publishing = Publishing(config, manager, transport, policy, world)
    publish = publishing.publish
    metrics = MetricsLogger(config, role="trainer", output_dir=config.output_dir) if world.main else None

    done = resume(config, training) if config.resume else 0
    if done:
        publish(done, wait=True)  # the orchestrator reloads inference from here
    print(f"trainer: model {config.model.name} ({policy.impl}) on {world.size} × {world.device}, "
          f"strategies {', '.join(policy.applied) or 'none'}, steps {done + 1}..{config.max_steps}", flush=True)

    step = done
    while config.max_steps is None or step < config.max_steps:
        step += 1
        vocab = policy.hf_config.vocab_size
        waiting = time.perf_counter()
        if fake:
            batch = fake_batch(fake, config.seq_len, vocab, rng)
        else:
            batch = wait_for_batch(config.output_dir, step, timeout=config.batch_timeout)
        start = time.perf_counter()
        mode = batch.get("training_mode", "rl")
        step_loss, step_kwargs = (loss_fn, config.loss.kwargs) if mode == "rl" else modes.loss_for(
            mode, config.loss, manager)
        modes.check_teacher_logprobs(mode, batch["micro_batches"], step)
        sums = train_step(training, batch["micro_batches"], max_norm=config.optim.max_norm, loss_fn=step_loss,
                          loss_kwargs=step_kwargs, temperature=batch.get("temperature") or 1.0)
        elapsed = time.perf_counter() - start
        publish(step)
        published = time.perf_counter()
        if world.main:
            info = batch.get("info", {})
            record = {
                "loss": sums["loss"], "entropy": sums["entropy"], "mismatch_kl": sums["mismatch_kl"],
                "is_masked": sums["is_masked"], "grad_norm": sums["grad_norm"],
                "lr": training.scheduler.get_last_lr()[0], "tokens": sums["tokens"],
                "loss_tokens": sums["loss_tokens"], "step_time": elapsed,
                # the rest of the trainer's wall time: waiting for the batch, and publishing on this
                # thread (the gather; a background write's join)
                "wait_time": start - waiting, "publish_time": published - start - elapsed,
                "tokens_per_s": sums["tokens"] / elapsed if elapsed else 0.0,
                "reward": info.get("reward", float("nan")),
                "off_policy_max": info.get("off_policy_max", 0),
                "policy_version_min": min(info.get("versions") or [0]),
                "policy_version_max": max(info.get("versions") or [0]),
            }
            if publishing.written is not None:  # of the last version whose write finished
                record["weights_write_time"] = publishing.written
            if any("teacher_logprobs" in row for row in batch["micro_batches"]):
                # Mean over the trained tokens of log p_teacher - log p_student (prime-rl's teacher_kl).
                record["teacher_kl"] = sums["teacher_kl"]
            metrics.log(step, record, show=SHOW)
        if config.ckpt.interval and step % config.ckpt.interval == 0:
            publishing.wait()  # the weights of this step are on disk before its checkpoint exists
            path = ckpt.save(config.output_dir, step, policy.model, training.optimizer, {}, world=world,
                             keep_last=config.ckpt.keep_last, keep_interval=config.ckpt.keep_interval)
            if world.main:
                manager.hook.prime_on_checkpoint(step=step, path=str(path))
    publishing.wait()
    if metrics:
        metrics.close()
    distributed.shutdown()
    return 0


class Publishing:
    """Publishes each version through the weight transport (the gathering is collective; rank 0
    writes). A transport that can publish in a thread writes version N while step N+1 trains:
    one version in flight at a time, ``prime_on_weights_published`` fired and a failure raised
    from the trainer's thread when it is joined (at the next publish, or ``wait``). LoRA
    adapters, which are small, are written in place."""

    def __init__(self, config, manager, transport, policy, world) -> None:
        self.config, self.manager, self.policy, self.world = config, manager, policy, world
        self.publisher = transport.publisher(config, output_dir=config.output_dir) if world.main else None
        self.background = world.main and transport.publishes_in_background and policy.exporter is None
        self.on_device = transport.device_tensors
        self.thread: threading.Thread | None = None
        self.step: int | None = None
        self.error: BaseException | None = None
        self.buffers: dict = {}  # host copies of the weights, reused: one version in flight at a time
        self.written: float | None = None
        """Seconds the last joined version took to write (a metric of the step that joined it)."""
        self._seconds: float | None = None

    def publish(self, step: int, *, wait: bool = False) -> None:
        self.wait()
        state = full_state_dict(self.policy, self.world, into=self.buffers if self.background else None,
                                on_device=self.on_device)  # collective
        if self.world.main:
            self.step, self.error = step, None
            if self.background:
                self.thread = threading.Thread(target=self._write, args=(state,), name=f"prime-publish-{step}")
                self.thread.start()
            else:
                self._write(state)
            if wait or not self.background:
                self.wait()
        distributed.barrier(self.world)

    def _write(self, state) -> None:
        started = time.perf_counter()
        try:
            self.publisher.publish(self.policy.model, self.step, state)
        except BaseException as exc:  # noqa: BLE001 - raised in the trainer's thread by wait()
            self.error = exc
        self._seconds = time.perf_counter() - started

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.step is None:
            return
        step, error, self.step, self.error = self.step, self.error, None, None
        if error is not None:
            raise error
        self.written = self._seconds
        self.manager.hook.prime_on_weights_published(
            step=step, path=str(self.config.output_dir / "weights" / f"step_{step}"))


def resume(config, training) -> int:
    """Load the newest usable checkpoint (a damaged newer one is skipped, with a warning) and
    return its step, 0 without one; weights published and metrics logged after it are dropped."""
    world, policy = training.world, training.policy
    found = ckpt.latest_usable(config.output_dir, warn=_say if world.main else _quiet, step=config.ckpt.resume_step)
    done = 0
    if found:
        done, path = found
        changes = ckpt.plugin_changes(path)
        if changes and world.main:
            print(f"warning: resuming from {path} with other plugins than wrote it: {'; '.join(changes)}", flush=True)
        ckpt.load(path, policy.model, training.optimizer, skip_optimizer=config.ckpt.skip_optimizer)
        for _ in range(done):
            training.scheduler.step()
    if world.main:
        remove_after(config.output_dir, done)  # weights a crashed run published after its checkpoint
        moved = drop_steps_from(config.output_dir / METRICS_FILE, "trainer", done + 1)
        print(f"resuming after step {done}" + (f" from {found[1]}" if found else " (no complete checkpoint)")
              + f"; {moved} superseded metric lines moved aside", flush=True)
    return done


def _say(text: str) -> None:
    print(text, flush=True)


def _quiet(text: str) -> None:
    pass


def run_bench(config, training, loss_fn, fake, rng) -> int:
    from prime_core.bench import BenchMeter

    def show(step, sums):
        if training.world.main:
            print(f"bench step {step}/{config.bench.total_steps}: loss {sums['loss']:.4f}", flush=True)

    meter = BenchMeter.for_run(config, training, role="trainer", data=fake.length)
    meter.run_fake_steps(training, fake, config.seq_len, rng, loss_fn=loss_fn, max_norm=config.optim.max_norm,
                         loss_kwargs=config.loss.kwargs, on_step=show)
    meter.report()
    distributed.shutdown()
    return 0
