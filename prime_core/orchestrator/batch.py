"""Training samples, their packing into ``seq_len`` micro-batches, and the step files that
carry them from the orchestrator to the trainer.

A micro-batch is one row of at most ``seq_len`` tokens holding several samples back to back;
``position_ids`` restart at 0 at each sample, which is how the trainer rebuilds the
block-diagonal attention mask so samples never attend to each other. Per-token arrays are
aligned with ``input_ids``: ``loss_mask[t]`` says whether token ``t`` is trained on (a token
the policy sampled: in a multi-turn sample the environment's and tools' turns between model
turns have mask 0), ``inference_logprobs[t]`` is the sampler's log-probability of token ``t``
and ``advantages[t]`` its advantage; ``teacher_logprobs[t]`` (on-policy distillation) the teacher's
log-probability of token ``t``.

Step files live at ``output_dir/rollouts/step_N/``: ``batch.safetensors`` (typed arrays, the
default) or ``batch.json`` (``orchestrator.batch_format = "json"``, for debugging), written
atomically; ``prime_core.orchestrator.batch_format`` describes both. The trainer reads
whichever is there and gets each row's fields as numpy arrays.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from prime_core.run_dir import atomic_write_bytes


@dataclass
class TrainingSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    advantage: float
    reward: float
    version: int
    """The policy version (trainer step) the completion was sampled with."""
    env: str = ""
    completion_mask: list[int] | None = None
    """Per completion token, 1 where the policy sampled it, 0 for environment and tool turns
    of a multi-turn trajectory; ``None``: every completion token was sampled."""
    teacher_logprobs: list[float] | None = None
    """Per completion token, the teacher's log-probability of it (on-policy distillation), 0.0
    where the policy did not sample it (mask 0); ``None``: no teacher scored it."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def mask(self) -> list[int]:
        return [1] * len(self.completion_ids) if self.completion_mask is None else list(self.completion_mask)


@dataclass
class MicroBatch:
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    inference_logprobs: list[float] = field(default_factory=list)
    teacher_logprobs: list[float] | None = None
    """The teacher's log-probability of each token (0.0 where the loss mask is 0, and for
    samples no teacher scored); ``None`` when no sample of the row has them."""

    def add(self, sample: TrainingSample) -> None:
        n_prompt, n_completion = len(sample.prompt_ids), len(sample.completion_ids)
        if sample.teacher_logprobs is not None and self.teacher_logprobs is None:
            self.teacher_logprobs = [0.0] * len(self.input_ids)
        if self.teacher_logprobs is not None:
            teacher = sample.teacher_logprobs or [0.0] * n_completion
            # Only sampled tokens (mask 1) carry a teacher term: env and tool turns are not the policy's.
            self.teacher_logprobs += [0.0] * n_prompt + [t if m else 0.0 for t, m in zip(teacher, sample.mask,
                                                                                         strict=True)]
        self.input_ids += sample.prompt_ids + sample.completion_ids
        self.position_ids += list(range(n_prompt + n_completion))
        mask = sample.mask
        self.loss_mask += [0] * n_prompt + mask
        self.advantages += [0.0] * n_prompt + [sample.advantage * m for m in mask]
        self.inference_logprobs += [0.0] * n_prompt + list(sample.completion_logprobs)

    def __len__(self) -> int:
        return len(self.input_ids)

    def as_dict(self) -> dict:
        """The row as the trainer takes it, ``{field: list}``: shallow, the lists themselves
        (``dataclasses.asdict`` would deep-copy every token's value, once per row and step)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def pack(samples: list[TrainingSample], seq_len: int) -> list[MicroBatch]:
    """First-fit-decreasing into rows of at most ``seq_len`` tokens. A sample longer than
    ``seq_len`` is cut to it (its tail is not trained on)."""
    rows: list[MicroBatch] = []
    for sample in sorted(samples, key=len, reverse=True):
        if len(sample) > seq_len:
            keep = max(0, seq_len - len(sample.prompt_ids))
            teacher = sample.teacher_logprobs[:keep] if sample.teacher_logprobs is not None else None
            sample = TrainingSample(sample.prompt_ids[:seq_len], sample.completion_ids[:keep],
                                    sample.completion_logprobs[:keep], sample.advantage, sample.reward,
                                    sample.version, sample.env, sample.mask[:keep], teacher)
        for row in rows:
            if len(row) + len(sample) <= seq_len:
                row.add(sample)
                break
        else:
            row = MicroBatch()
            row.add(sample)
            rows.append(row)
    return rows


def rollout_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def write_batch(output_dir: Path, step: int, micro_batches: list[MicroBatch], *, temperature: float,
                info: dict, training_mode: str = "rl", format: str = "binary") -> Path:
    """Write the batch of ``step`` atomically in ``format`` (``binary`` or ``json``).
    ``training_mode`` (prime-rl 0.6's, ``orchestrator.training_mode``) tells the trainer which
    loss the batch is for (``prime_core.trainer.modes``)."""
    from prime_core.orchestrator.batch_format import FORMATS

    chosen = FORMATS[format]
    folder = rollout_dir(output_dir, step)
    for other in FORMATS.values():  # left by an earlier run in another format: never read it
        if other is not chosen:
            (folder / other.filename).unlink(missing_ok=True)
    path = folder / chosen.filename
    header = {"step": step, "temperature": temperature, "info": info, "training_mode": training_mode}
    atomic_write_bytes(path, chosen.encode(header, micro_batches))
    return path


def batch_file(output_dir: Path, step: int) -> Path | None:
    """The file the batch of ``step`` was written to, ``None`` while there is none."""
    from prime_core.orchestrator.batch_format import FORMATS

    folder = rollout_dir(output_dir, step)
    return next((folder / f.filename for f in FORMATS.values() if (folder / f.filename).exists()), None)


def read_batch(path: Path) -> dict:
    """``{"step", "temperature", "info", "micro_batches": [{field: numpy array}, ...]}`` from a
    step file of either format; a damaged one raises a ``PrimeError`` naming it."""
    from prime_core.errors import PrimeError
    from prime_core.orchestrator.batch_format import BatchFileError, format_of

    path = Path(path)
    chosen = format_of(path)
    if chosen is None:
        raise PrimeError(f"{path} is not a step batch file", hint="step batches are rollouts/step_N/batch.safetensors "
                                                                 "or batch.json")
    try:
        return chosen.decode(path.read_bytes())
    except BatchFileError as exc:
        raise PrimeError(f"cannot read the batch {path}: {exc}",
                         hint="the orchestrator writes each batch whole (through a temporary name), so it was "
                              "damaged afterwards (the disk, a copy, another program); restart the run with --resume: "
                              "the orchestrator writes every batch after the last checkpoint again") from None


def wait_for_batch(output_dir: Path, step: int, *, poll: float = 0.1, timeout: float | None = None) -> dict:
    """Block until the batch of ``step`` exists, then return it (``read_batch``); after
    ``timeout`` seconds raise a ``PrimeError`` naming the folder waited for and who writes it."""
    from prime_core.errors import PrimeError

    start = time.monotonic()
    while (path := batch_file(output_dir, step)) is None:
        if timeout is not None and time.monotonic() - start > timeout:
            raise PrimeError(f"waited {timeout:g} s for the batch of step {step}: the orchestrator has not written "
                             f"{rollout_dir(output_dir, step)}/batch.safetensors (or batch.json)",
                             hint="see the orchestrator's log (output_dir/logs/orchestrator.log); raise "
                                  "trainer.batch_timeout if its steps take that long")
        time.sleep(poll)
    return read_batch(path)


def remove_batches_from(output_dir: Path, step: int) -> None:
    """On resume: batches of ``step`` and later were made for a run that is being redone."""
    root = Path(output_dir) / "rollouts"
    if not root.is_dir():
        return
    for path in root.glob("step_*"):
        try:
            n = int(path.name.split("_", 1)[1])
        except ValueError:
            continue
        if n >= step:
            shutil.rmtree(path, ignore_errors=True)
