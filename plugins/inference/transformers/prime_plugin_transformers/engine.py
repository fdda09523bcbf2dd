"""One model served by transformers' ``ContinuousBatchingManager`` (paged attention).

The manager runs its generation loop in a background thread; this module is the glue around
it, called from many HTTP handler threads at once:

- ``sample``: ``n`` requests of one prompt are added to the manager, each with its own
  temperature, top-p, token limit and stop tokens (the model's end-of-sequence tokens plus the
  request's), and the manager returns the sampled tokens with the log-probability of each under
  the distribution it was sampled from (temperature and top-p applied). A request at
  temperature 0 is sampled with top-p ~0 (only the most likely token survives) and its
  log-probabilities, which that gives as 0, are computed again from the unscaled logits by one
  forward pass, as vLLM returns them for greedy requests.
- ``load_weights``: the new tensors (a published folder read into host buffers, views of the
  trainer's shared slot with ``weight_broadcast.type = 'ipc'``, or buckets received from the
  trainer's group with ``nccl``) are copied into the live model while it is not in use:
  the manager's ``pause()`` where transformers has it (5.19: requests keep their KV cache and
  continue on the new weights, as with vLLM), otherwise new requests wait and the running ones
  finish first (5.17).
- A dispatcher thread hands every finished output to the request waiting for it; if the
  generation loop dies, every waiting request fails with its error and ``alive()`` turns false.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from prime_plugin_transformers import received_weights, shared_weights
from prime_plugin_transformers.admission import Gate
from prime_plugin_transformers.params import Params
from prime_plugin_transformers.usage import Usage
from prime_plugin_transformers.weights import apply, stage

log = logging.getLogger("prime.transformers")

PLACEHOLDER_TEMPERATURE, PLACEHOLDER_TOP_P = 0.5, 0.5
"""transformers builds a per-request temperature (top-p) processor only when the manager's own
value is not the neutral 1.0; every request then sets its own value, so these are never used."""
GREEDY_ATTEMPTS = 3


class _Pending:
    __slots__ = ("done", "output", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.output = None
        self.error: str | None = None


def resolve_dtype(name: str, model_dir: str):
    import torch

    if name != "auto":
        return getattr(torch, name)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def choose_attention(requested: str | None, dtype) -> str:
    """``inference.args.attn_implementation``, or by default torch's flash varlen kernel where it
    runs (a CUDA GPU, bf16 / fp16) and ``sdpa`` elsewhere."""
    from prime_plugin_transformers import torch_flash

    if requested not in (None, torch_flash.NAME):
        return requested
    why = torch_flash.unavailable_reason(dtype)
    if why is None:
        torch_flash.register()
        return torch_flash.NAME
    if requested is not None:
        raise ValueError(f"inference.args.attn_implementation = {requested!r}: {why}; use 'sdpa'")
    return "sdpa"


class Engine:
    """Loads ``config.model`` (an ``inference`` config) and serves it; ``use_pause=False``
    forces the drain path that transformers versions without ``pause()`` take."""

    def __init__(self, config, *, use_pause: bool | None = None) -> None:
        self.config = config
        self.model = None
        self.tokenizer = None
        self.manager = None
        self.version: int | None = None
        """The step of the weights served (``None``: those the server started with)."""
        self.weights_path = str(config.model.name)
        self._use_pause = use_pause
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._exclusive_lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._staging: dict = {}  # host copies of the weights being loaded, reused from load to load
        self._mapped = shared_weights.Mapped()  # the trainer's shared slots (weight_broadcast.type = 'ipc')
        self._receiving = received_weights.Receiving(  # the trainer's group (weight_broadcast.type = 'nccl')
            f"transformers server on port {config.server.port}")
        self._gate = Gate()
        self._stopping = threading.Event()
        self._start_lock = threading.Lock()
        self._dispatcher: threading.Thread | None = None
        self._generation = 0
        """Counts weight loads, so that a greedy request notices one between sampling and scoring."""
        self._usage = Usage()

    # -- start and stop ----------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from prime_plugin_transformers.cb_config import MODEL_ARGS, cb_fields, settings

        cfg = self.config
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = resolve_dtype(cfg.model.dtype, cfg.model.name)
        model_args = {k.replace("-", "_"): v for k, v in cfg.args.items() if k.replace("-", "_") in MODEL_ARGS}
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.model.name, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=choose_attention(model_args.get("attn_implementation"), dtype)).to(device).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name,
                                                           trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as exc:  # a folder without tokenizer files: token ids only, no text
            log.warning("no tokenizer for %s (%s): samples come without text", cfg.model.name, exc)
        text_config = self.model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = cfg.model.max_model_len or getattr(text_config, "max_position_embeddings", 1 << 30)
        self.eos_token_ids = self._eos_token_ids()
        fields = cb_fields()
        cb = settings(cfg, self.model, device=device, fields=fields)
        generation = GenerationConfig(do_sample=True, temperature=PLACEHOLDER_TEMPERATURE, top_p=PLACEHOLDER_TOP_P,
                                      top_k=None, eos_token_id=self.eos_token_ids or None)
        self.manager = self.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**cb))
        self.manager.warmup()  # CUDA graphs / compile, when on; nothing on a CPU
        with self._start_lock:  # no generation thread may start after stop()
            if self._stopping.is_set():
                return
            self.manager.start()
        if self._use_pause is None:
            self._use_pause = hasattr(self.manager, "pause")
        self._dispatcher = threading.Thread(target=self._dispatch, name="prime-cb-dispatch", daemon=True)
        self._dispatcher.start()
        log.info("serving %s (%s, %s, attention %s) in %.1f s; continuous batching: %s; weight updates %s",
                 cfg.model.name, device, str(dtype).removeprefix("torch."), self.model.config._attn_implementation,
                 time.perf_counter() - started, self._describe_cache(cb),
                 "pause generation" if self._use_pause else "drain running requests")

    def _eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config.get_text_config(), self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else value or [])
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    def _describe_cache(self, cb: dict) -> str:
        cache = getattr(getattr(self.manager, "batch_processor", None), "cache", None)
        sized = {k: getattr(cache, k) for k in ("num_blocks", "max_batch_tokens") if hasattr(cache, k)}
        return ", ".join(f"{k}={v}" for k, v in {**cb, **sized}.items())

    def alive(self) -> bool:
        manager = self.manager
        return (manager is not None and not self._stopping.is_set() and manager.is_running()
                and manager.background_thread_status.fatal_error is None)

    def death(self) -> str:
        """Why the generation loop is not running."""
        manager = self.manager
        error = manager.background_thread_status.fatal_error if manager is not None else None
        if error is not None:
            return f"the generation loop died: {type(error).__name__}: {error}"
        return "the engine is stopped" if self._stopping.is_set() else "the generation loop is not running"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the generation loop (requests still running fail) and the dispatcher. Idempotent."""
        with self._start_lock:
            self._stopping.set()
            manager = self.manager
        if manager is not None and manager.is_running():
            manager.stop(block=True, timeout=timeout, hard_stop=True)
        if self._dispatcher is not None:
            self._dispatcher.join(timeout)
        self._fail_pending("the engine was stopped")
        self._receiving.close()
        if manager is not None:
            with self._lock:
                if self._usage.samples or self._usage.running:
                    self._log_usage()

    # -- results -----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while not self._stopping.is_set():
            output = self.manager.get_result(timeout=0.1)
            if output is None:
                if not self.manager.is_running():
                    self._fail_pending(self.death())
                    time.sleep(0.1)
                continue
            if not output.is_finished():
                continue
            with self._lock:
                pending = self._pending.pop(output.request_id, None)
            if pending is not None:
                pending.output = output
                pending.done.set()

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.error = reason
            p.done.set()

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, body: dict) -> list[dict[str, Any]]:
        params = Params.parse(body, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        for _ in range(GREEDY_ATTEMPTS):
            generation = self._generation
            outputs = self._generate(params)
            if not params.greedy:
                return [self._sample(params, output.generated_tokens, output.logprobs) for output in outputs]
            with self._exclusive():
                if generation == self._generation:  # no weight update since these were sampled
                    return [self._sample(params, o.generated_tokens, self._logprobs(params.prompt_ids,
                                                                                     o.generated_tokens))
                            for o in outputs]
        raise RuntimeError(f"the weights changed {GREEDY_ATTEMPTS} times while a greedy sample was scored")

    def _generate(self, params: Params) -> list:
        if not self.alive():
            raise RuntimeError(self.death())
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids)) or [-1]
        waiting: list[_Pending] = []
        with self._gate.admitted():
            with self._lock:
                self._usage.begin()
            try:
                for _ in range(params.n):
                    waiting.append(self._add(params, stops))
                for pending in waiting:
                    pending.done.wait()
            finally:
                with self._lock:
                    self._usage.end([p.output for p in waiting if p.output is not None])
        errors = [p.error or p.output.error for p in waiting if p.error or p.output.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        return [p.output for p in waiting]

    def _add(self, params: Params, stops: list[int]) -> _Pending:
        request_id, pending = f"prime-{uuid.uuid4().hex}", _Pending()
        with self._lock:
            self._pending[request_id] = pending
        added = self.manager.add_request(list(params.prompt_ids), request_id=request_id,
                                         max_new_tokens=params.max_tokens, eos_token_id=stops,
                                         **params.processor_kwargs())
        if added is None:  # the manager refused it: it is stopping or dead
            with self._lock:
                self._pending.pop(request_id, None)
            raise RuntimeError(self.death())
        return pending

    def _sample(self, params: Params, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
        tokens = [int(t) for t in tokens]
        stops = set(self.eos_token_ids) | set(params.stop_token_ids)
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"the engine returned {len(tokens)} tokens but {len(logprobs)} log-probabilities")
        return {"token_ids": tokens, "logprobs": [float(lp) for lp in logprobs],
                "finish_reason": "stop" if tokens and tokens[-1] in stops else "length", "text": self.decode(tokens)}

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        known = [t for t in tokens if t < len(self.tokenizer)]  # a model's vocabulary may be padded
        return self.tokenizer.decode(known, skip_special_tokens=True)

    def _logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """Log-probabilities of ``tokens`` after ``prompt`` from the unscaled logits (one forward
        pass; the caller holds the model exclusively)."""
        import torch

        if not tokens:
            return []
        ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=self.model.device)
        with torch.no_grad(), self._standard_attention():
            logits = self.model(ids, logits_to_keep=len(tokens)).logits[0].float()
        picked = logits.log_softmax(-1).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])
        return picked[:, 0].tolist()

    @contextmanager
    def _standard_attention(self):
        """A plain forward pass needs the model's own attention, not the paged variant the
        manager may have switched it to (transformers 5.17)."""
        current = self.model.config._attn_implementation
        if not current.startswith("paged|"):
            yield
            return
        self.model.set_attn_implementation(current.removeprefix("paged|"))
        try:
            yield
        finally:
            self.model.set_attn_implementation(current)

    # -- weights -----------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self):
        """The model to oneself: the generation loop paused (or drained), one holder at a time."""
        with self._exclusive_lock:
            if not self.alive():
                raise RuntimeError(self.death())
            with self.manager.pause() if self._use_pause else self._gate.drained():
                yield

    def load_weights(self, path: str, step: int | None = None) -> dict[str, Any]:
        folder = Path(path)
        with self._staging_lock:  # one load at a time: they share the staging buffers
            started = time.perf_counter()
            with self._staged(folder) as staged:  # read while the model serves: only the copy pauses it
                read = time.perf_counter()
                with self._exclusive():
                    paused = time.perf_counter()
                    how = apply(self.model, staged)
                    self._generation += 1
                    with self._lock:
                        self._log_usage()
            done = time.perf_counter()
        step = staged.step if staged.step is not None else step
        self.version, self.weights_path = step, str(folder)
        seconds, waited, pause = done - started, paused - read, done - paused
        log.info("loaded weights of step %s from %s in %.2f s (read %.2f s while serving, %.2f s waiting for the "
                 "model, %.3f s paused; %s)", step, folder, seconds, read - started, waited, pause, how)
        return {"step": step, "path": str(folder), "seconds": seconds, "waited": waited, "paused": pause,
                "how": how}

    def _staged(self, folder: Path):
        """The version in ``folder`` made ready to copy in: a folder of files read into host
        buffers, views of the trainer's shared slot with its lock held (``ipc``), or the buckets
        received from the trainer's group (``nccl``)."""
        if shared_weights.is_shared(folder):
            return shared_weights.staged(self.model, folder, self._mapped)
        if received_weights.is_broadcast(folder):
            return nullcontext(self._receiving.staged(self.model, folder))
        return nullcontext(stage(self.model, folder, self._staging))

    def _log_usage(self) -> None:
        """One line on what the weights being replaced served (caller holds ``_lock``)."""
        used = self._usage.take()
        rate = f"{used['tokens'] / used['busy']:.1f} tokens/s, {used['samples'] / used['busy']:.2f} samples/s" \
            if used["busy"] > 0 else "idle"
        log.info("served %d samples, %d tokens on the weights of step %s in %.3f s busy (%s)", used["samples"],
                 used["tokens"], self.version if self.version is not None else 0, used["busy"], rate)

    def info(self) -> dict[str, Any]:
        return {"model": str(self.config.model.name), "weights": self.weights_path, "version": self.version,
                "alive": self.alive(), "max_model_len": self.max_model_len, "vocab_size": self.vocab_size}
