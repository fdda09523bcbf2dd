"""Supervised fine-tuning (``prime sft CONFIG``): next-token loss on the assistant turns of a
local JSONL chat dataset (``{"messages": [...]}`` per line), packed into ``seq_len`` rows,
token-level normalised. The final model is written to ``output_dir/model`` in Hugging Face
format (tokenizer included), ready to be the ``model.name`` of an RL run.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from prime_core.errors import ConfigError
from prime_core.metrics import MetricsLogger
from prime_core.orchestrator.batch import TrainingSample, pack
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt
from prime_core.trainer.model import build_model, token_logprobs
from prime_core.trainer.optim import build_optimizer, build_scheduler, clip_and_step
from prime_core.trainer.role import device_name


def chat_sample(tokenizer, messages: list[dict]) -> TrainingSample:
    """Prompt = everything before the last (assistant) message; completion = that message
    through its end-of-turn token, which is what the model must learn to produce."""
    from prime_core.orchestrator.role import prompt_token_ids

    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's")
    prompt = prompt_token_ids(tokenizer, messages[:-1])
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    full = list(full if isinstance(full, list) else full["input_ids"])
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the assistant turn")
    completion = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos in completion:
        completion = completion[: completion.index(eos) + 1]
    return TrainingSample(prompt, completion, [0.0] * len(completion), 1.0, 0.0, 0)


def load_dataset(path: Path, tokenizer) -> list[TrainingSample]:
    samples = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                samples.append(chat_sample(tokenizer, json.loads(line)["messages"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError([f"data.path: {path}, line {number}: {exc}"]) from None
    if not samples:
        raise ConfigError([f"data.path: {path} has no samples"])
    return samples


def fake_dataset(config, vocab_size: int, rng: random.Random) -> list[TrainingSample]:
    out = []
    for _ in range(config.data.batch_size * 4):
        length = config.seq_len if config.data.length == "fixed" else rng.randint(8, config.seq_len)
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        out.append(TrainingSample(ids[:1], ids[1:], [0.0] * (length - 1), 1.0, 0.0, 0))
    return out


def run(config) -> int:
    import torch
    from transformers import AutoTokenizer

    manager = get_plugin_manager()
    torch.manual_seed(config.data.seed)
    rng = random.Random(config.data.seed)
    device = device_name()
    model, impl = build_model(config.model, manager, device=device)
    model.train()
    from prime_core.hub import loading

    with loading(config.model.tokenizer or config.model.name, "model.name"):
        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or config.model.name)
    if config.data.type == "fake":
        dataset = fake_dataset(config, model.config.vocab_size, rng)
    else:
        dataset = load_dataset(config.data.path, tokenizer)
    max_steps = config.max_steps or max(1, len(dataset) // config.data.batch_size)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    metrics = MetricsLogger(config, role="sft", output_dir=config.output_dir)
    print(f"sft: {len(dataset)} samples, {max_steps} steps of {config.data.batch_size}, model {impl} on {device}",
          flush=True)

    order: list[int] = []
    for step in range(1, max_steps + 1):
        batch = []
        while len(batch) < config.data.batch_size:
            if not order:
                order = list(range(len(dataset)))
                if config.data.shuffle:
                    rng.shuffle(order)
            batch.append(dataset[order.pop()])
        rows = pack(batch, config.seq_len) if config.data.pack else [r for s in batch for r in pack([s], config.seq_len)]
        total = sum(sum(r.loss_mask) for r in rows) or 1
        start, loss_sum, tokens = time.perf_counter(), 0.0, 0
        for row in rows:
            ids = torch.tensor(row.input_ids, device=device)[None]
            pos = torch.tensor(row.position_ids, device=device)[None]
            mask = torch.tensor(row.loss_mask, dtype=torch.float32, device=device)
            logp, _ = token_logprobs(model, ids, pos, with_entropy=False)
            loss = -(logp * mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            tokens += len(row.input_ids)
        grad_norm = clip_and_step(model, optimizer, scheduler, config.optim.max_norm)
        elapsed = time.perf_counter() - start
        metrics.log(step, {"loss": loss_sum, "grad_norm": grad_norm, "lr": scheduler.get_last_lr()[0],
                           "tokens": tokens, "tokens_per_s": tokens / elapsed, "step_time": elapsed},
                    show=("loss", "grad_norm", "tokens_per_s"))
        if config.ckpt.interval and step % config.ckpt.interval == 0:
            ckpt.save(config.output_dir, step, model, optimizer, {}, keep_last=config.ckpt.keep_last)
    final = Path(config.output_dir) / "model"
    model.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    print(f"sft: final model written to {final}", flush=True)
    metrics.close()
    return 0
