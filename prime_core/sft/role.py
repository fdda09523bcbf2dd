"""Supervised fine-tuning (``prime sft CONFIG``): next-token loss on the assistant turns of a
local JSONL chat dataset (``{"messages": [...]}`` per line), packed into ``seq_len`` rows,
token-level normalised. The final model is written to ``output_dir/model`` in Hugging Face
format (tokenizer included), ready to be the ``model.name`` of an RL run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from prime_core.errors import ConfigError
from prime_core.metrics import MetricsLogger
from prime_core.orchestrator.batch import TrainingSample, pack
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt
from prime_core.trainer.build import full_state_dict, start_training
from prime_core.trainer.fake import fake_samples
from prime_core.trainer.optim import build_scheduler
from prime_core.trainer.step import StepClock, queue_train_step
from prime_core.weights import Adapter, record_plugins


def chat_sample(tokenizer, messages: list[dict]) -> TrainingSample:
    """Prompt = everything before the last (assistant) message; completion = that message
    through its end-of-turn token, which is what the model must learn to produce."""
    from prime_core.orchestrator.role import prompt_token_ids

    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's")
    prompt = prompt_token_ids(tokenizer, messages[:-1])
    return _split(tokenizer, prompt, _input_ids(tokenizer.apply_chat_template(messages, tokenize=True)))


CHUNK = 1024
"""Chats per batched ``apply_chat_template`` call in ``load_dataset`` (memory stays bounded)."""


def _batched_samples(tokenizer, chats: list[list[dict]]) -> list[TrainingSample]:
    """``chat_sample`` of each chat, the same token ids: the prompts, then the whole chats, go
    through ``apply_chat_template`` as one batch each, so transformers' per-call work is paid once
    and the tokenizer's Rust encoder spreads the batch over the cores (16,000 tool-example chats:
    5.3-5.9 s chat by chat, 3.2-3.9 s here). Raises on any chat that ``chat_sample`` might refuse."""
    # A batch would render the empty prompt of a lone assistant turn that chat_sample refuses.
    if not all(isinstance(m, list) and len(m) >= 2 and all(isinstance(message, dict) for message in m)
               and m[-1].get("role") == "assistant" for m in chats):
        raise ValueError("a chat for chat_sample alone")
    prompts = tokenizer.apply_chat_template([m[:-1] for m in chats], add_generation_prompt=True, tokenize=True)
    fulls = tokenizer.apply_chat_template(chats, tokenize=True)
    return [_split(tokenizer, list(prompt), list(full))
            for prompt, full in zip(_input_ids(prompts), _input_ids(fulls), strict=True)]


def _input_ids(out) -> list:
    return list(out if isinstance(out, list) else out["input_ids"])  # transformers 5 returns a BatchEncoding


def _split(tokenizer, prompt: list[int], full: list[int]) -> TrainingSample:
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the assistant turn")
    completion = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos in completion:
        completion = completion[: completion.index(eos) + 1]
    return TrainingSample(prompt, completion, [0.0] * len(completion), 1.0, 0.0, 0)


def load_dataset(path: Path, tokenizer) -> list[TrainingSample]:
    """One sample per non-blank line, in order. A line seen before is the same sample again, not
    tokenised twice: data of small tasks repeats (8,000 sums of one digit are 100 chats)."""
    order: list[str] = []
    chats: dict[str, tuple[int, list]] = {}  # each distinct line: its first number, its messages
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if line not in chats:
                try:
                    chats[line] = (number, json.loads(line)["messages"])
                except (ValueError, KeyError, TypeError) as exc:
                    _line_samples(tokenizer, list(chats.values()), path)  # an earlier bad line is named first
                    raise ConfigError([f"data.path: {path}, line {number}: {exc}"]) from None
            order.append(line)
    if not order:
        raise ConfigError([f"data.path: {path} has no samples"])
    made = dict(zip(chats, _line_samples(tokenizer, list(chats.values()), path), strict=True))
    return [made[line] for line in order]


def _line_samples(tokenizer, lines: list[tuple[int, list]], path) -> list[TrainingSample]:
    """The samples of numbered chats, ``CHUNK`` at a time in one batch each; a chunk that fails
    goes chat by chat, so that the error names its line as ``chat_sample`` words it."""
    samples = []
    for start in range(0, len(lines), CHUNK):
        chunk = lines[start:start + CHUNK]
        try:
            samples += _batched_samples(tokenizer, [messages for _, messages in chunk])
            continue
        except Exception:  # noqa: BLE001 - found again below, chat by chat
            pass
        for number, messages in chunk:
            try:
                samples.append(chat_sample(tokenizer, messages))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError([f"data.path: {path}, line {number}: {exc}"]) from None
    return samples


def run(config) -> int:
    from transformers import AutoTokenizer

    from prime_core import distributed
    from prime_core.hub import loading

    _refuse_unlaunched_processes(config)
    manager = get_plugin_manager()
    rng = random.Random(config.data.seed)
    bench = config.bench
    max_steps = bench.total_steps if bench else config.max_steps
    training = start_training(config, "sft", max_steps=max_steps, seed=config.data.seed, manager=manager)
    world, policy = training.world, training.policy
    with loading(config.model.tokenizer or config.model.name, "model.name"):
        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or config.model.name)
    from prime_core.config.shared import use_chat_template

    use_chat_template(tokenizer, config.model)
    if config.data.type == "fake" or bench:
        dataset = fake_samples(config.data.batch_size * 4, config.seq_len, policy.hf_config.vocab_size,
                               config.data.length, rng)
        fit = {"samples_dropped": 0, "samples_cut": 0}
    elif config.data.type == "sft":
        from prime_core.sft.hf import load_samples

        dataset, fit = fitting(load_samples(config.data, tokenizer), config.seq_len, config.data.name)
    else:
        dataset, fit = fitting(load_dataset(config.data.path, tokenizer), config.seq_len, config.data.path)
    if not bench and max_steps is None:
        max_steps = max(1, len(dataset) // config.data.batch_size)
        training.scheduler = build_scheduler(training.optimizer, config.scheduler, max_steps)
    meter = None
    if bench:
        from prime_core.bench import BenchMeter

        meter = BenchMeter.for_run(config, training, role="sft", data=config.data.length, pipelined=True)
    done = _resume(config, training) if config.resume and not bench else 0
    metrics = MetricsLogger(config, role="sft", output_dir=config.output_dir) if world.main and not bench else None
    print(f"sft: {len(dataset)} samples, {max_steps} steps of {config.data.batch_size}, model {policy.impl} on "
          f"{world.size} × {world.device}, strategies {', '.join(policy.applied) or 'none'}", flush=True)

    batches = _batches(dataset, config.data, rng)
    for _ in range(done):  # the data order of the run this one continues
        next(batches)
    _train(config, training, batches, range(done + 1, max_steps + 1), meter=meter, metrics=metrics, fit=fit)
    if meter:
        meter.report()
    else:
        _write_model(policy, world, tokenizer, Path(config.output_dir) / "model")
    if metrics:
        metrics.close()
    distributed.shutdown()
    return 0


def _train(config, training, batches, steps: range, *, meter, metrics, fit: dict) -> None:
    """The optimizer steps ``steps``, each queued before the one before it is read; every step
    is logged (``metrics``) or measured (``meter``), and read before a checkpoint is saved."""
    world, policy = training.world, training.policy
    clock = meter.clock if meter else StepClock(world.device)

    def finish(step: int, started, ended, read, lr: float) -> None:
        """Reads ``step`` (queued between marks ``started`` and ``ended``) and logs it."""
        sums = read()
        if meter:
            meter.end_step(step, started, ended, sums["rows"])
            if world.main:
                print(f"bench step {step}/{steps[-1]}: loss {sums['loss']:.4f}", flush=True)
            return
        elapsed = clock.step_time(started, ended)
        if metrics:
            metrics.log(step, {"loss": sums["loss"], "grad_norm": sums["grad_norm"], "lr": lr,
                               "tokens": sums["tokens"], "tokens_per_s": sums["tokens"] / elapsed,
                               "step_time": elapsed, **fit},
                        show=("loss", "grad_norm", "tokens_per_s"))

    pending = None
    for step in steps:
        batch = next(batches)
        if config.data.pack:
            packed = pack(batch, config.seq_len)
        else:
            packed = [row for sample in batch for row in pack([sample], config.seq_len)]
        start = meter.start_step(step) if meter else clock.mark()
        # Queued before the step before it is read: the device works on that one's update while
        # the host starts this one.
        try:
            read = queue_train_step(training, [row.as_dict() for row in packed], max_norm=config.optim.max_norm)
        except BaseException:
            if pending:  # the step before is logged, not lost with this one
                finish(*pending)
            raise
        queued = (step, start, clock.mark(), read, training.scheduler.get_last_lr()[0])
        if pending:
            finish(*pending)
        pending = queued
        if not meter and config.ckpt.interval and step % config.ckpt.interval == 0:
            finish(*pending)  # nothing else is queued when the weights are saved
            pending = None
            ckpt.save(config.output_dir, step, policy.model, training.optimizer, {}, world=world,
                      keep_last=config.ckpt.keep_last, keep_interval=config.ckpt.keep_interval)
    if pending:
        finish(*pending)


def fitting(samples: list[TrainingSample], seq_len: int, path) -> tuple[list[TrainingSample], dict]:
    """The samples that can teach something in ``seq_len`` tokens, and how many did not fit:
    a sample whose prompt fills ``seq_len`` has no trained token left and is dropped; a longer
    one has its tail cut. Both are counted (a warning, and in every step's metrics)."""
    kept = [s for s in samples if len(s.prompt_ids) < seq_len]
    dropped, cut = len(samples) - len(kept), sum(len(s) > seq_len for s in kept)
    if not kept:
        raise ConfigError([f"data.path: in {path}, every sample's prompt is {seq_len} tokens or longer, so "
                           f"nothing is left to train on within seq_len = {seq_len}: raise seq_len"])
    if dropped or cut:
        print(f"warning: {path}: {dropped} of {len(samples)} samples have a prompt of seq_len = {seq_len} tokens or "
              f"more and are left out; {cut} more are longer than seq_len and lose their tail (raise seq_len to "
              "train on all of them)", flush=True)
    return kept, {"samples_dropped": dropped, "samples_cut": cut}


def _resume(config, training) -> int:
    """``--resume``: load the newest usable checkpoint and return its step (0 without one);
    metric lines of steps that are redone move to ``metrics.superseded.jsonl``."""
    from prime_core.metrics import METRICS_FILE, drop_steps_from

    world = training.world
    found = ckpt.latest_usable(config.output_dir, warn=None if world.main else lambda text: None,
                               step=config.ckpt.resume_step)
    done = 0
    if found:
        done, path = found
        ckpt.load(path, training.policy.model, training.optimizer, skip_optimizer=config.ckpt.skip_optimizer)
        for _ in range(done):
            training.scheduler.step()
    if world.main:
        moved = drop_steps_from(Path(config.output_dir) / METRICS_FILE, "sft", done + 1)
        print(f"sft: resuming after step {done}" + (f" from {found[1]}" if found else " (no usable checkpoint)")
              + f"; {moved} superseded metric lines moved aside", flush=True)
    return done


def _refuse_unlaunched_processes(config) -> None:
    import os

    from prime_core.launch.config import trainer_processes

    processes, keys = trainer_processes(config.deployment)
    if processes > 1 and "WORLD_SIZE" not in os.environ:
        # `prime sft` typed by a user goes through a launcher, which starts the processes.
        raise ConfigError([f"{keys} asks for {processes} trainer processes but this is one process "
                           "started without torchrun: run `prime sft CONFIG` (its launcher starts them), "
                           "or start this command under torchrun"])


def _batches(dataset: list[TrainingSample], data, rng: random.Random):
    """``data.batch_size`` samples at a time, through the dataset in (shuffled) epochs."""
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < data.batch_size:
            if not order:
                order = list(range(len(dataset)))
                if data.shuffle:
                    rng.shuffle(order)
            batch.append(dataset[order.pop()])
        yield batch


def _write_model(policy, world, tokenizer, final: Path) -> None:
    """The trained model (or LoRA adapter) with its tokenizer, in Hugging Face format, written
    to a temporary folder, fsynced and renamed into place (a crash never leaves half a model)."""
    import shutil

    from prime_core.run_dir import fsync_tree, replace_dir, writing

    state = full_state_dict(policy, world)  # collective
    if not world.main:
        return
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp, "the final model"):
        if isinstance(state, Adapter):  # LoRA: the adapter alone (PEFT layout)
            state.save(tmp)
        else:
            policy.model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        record_plugins(tmp)
        fsync_tree(tmp)
    replace_dir(tmp, final)
    print(f"sft: final model written to {final}", flush=True)
