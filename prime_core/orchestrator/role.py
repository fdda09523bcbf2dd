"""The orchestrator loop (``prime orchestrator CONFIG``).

It keeps groups of ``rollouts_per_example`` completions in flight on the inference replicas
(through the inference backend's client: token ids in, token ids and per-token
log-probabilities out; the router picks the replica), scores each group with its
environment's rubric, turns rewards into advantages with the selected estimator, and every
``batch_size`` samples packs a step batch for the trainer.

Rollouts are episodes (``episode``): an environment may talk with the policy for several
turns and call tools; each rollout's tokens become one training sample, or several where the
chat template breaks the token prefix (``trajectory``). A rollout whose environment raises
fails alone: its group is dropped (``env_errors``, ``failed_groups``) and another is sampled.
With ``[orchestrator.eval]`` the policy is evaluated at step 0 and every ``interval`` steps,
beside training, on the same servers (``eval``).

Training modes (prime-rl 0.6's ``training_mode``) with a teacher (``orchestrator.teacher``, a
frozen model on servers of its own): ``opd`` (and ``rl`` with ``trainer.loss.teacher_tau``) asks
the teacher for its log-probability of every token the policy sampled (a prefill of prompt +
completion, ``score_with_teacher``) and the samples carry them to the trainer, where they enter
the advantage (``prime_core.trainer.modes``); ``sft`` samples the training rollouts from the
teacher instead (the policy's servers still serve evaluations and take each new policy).

Asynchrony: every group remembers the policy version it was sampled with. The batch of step
N is handed over only once policy ``N-1-async_level`` is loaded for inference, and groups
whose lag ``(N-1) - version`` exceeds ``max_off_policy_steps`` are dropped and counted. New
weights published by the trainer are loaded into every replica as soon as they appear. A run
that starts from scratch first loads the base model into every replica (policy v0): servers the
run did not start may still serve an earlier run's policy.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field

from prime_core.errors import ConfigError, PrimeError
from prime_core.hub import model_folder
from prime_core.inference.client import SampleRequest
from prime_core.metrics import METRICS_FILE, MetricsLogger, drop_steps_from
from prime_core.orchestrator import filters
from prime_core.orchestrator.batch import TrainingSample, pack, remove_batches_from, write_batch
from prime_core.orchestrator.coalesce import Coalescer, Sampler
from prime_core.orchestrator.episode import Episode, Limits, Outcome, env_tools, run_episode
from prime_core.orchestrator.pool import ReplicaPool
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt
from prime_core.weights import remove_after

SHOW = ("reward", "off_policy_max", "dropped", "env_errors", "weights_version", "sample_tokens_per_s", "replicas_up")
FIT_ATTEMPTS = 100


@dataclass
class Group:
    env: str
    version: int
    samples: list[TrainingSample]
    rewards: list[float]
    outcomes: list[Outcome]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def load_envs(configs, manager, key: str) -> list[tuple[str, object]]:
    """``(name, environment)`` for each ``[[orchestrator.env]]``-shaped entry of ``configs``."""
    envs = []
    for i, env in enumerate(configs):
        spec = manager.select("environments", env.id, key=f"{key}[{i}].id")
        try:
            envs.append((env.name or env.id, spec.load(**env.args)))
        except (TypeError, ValueError) as exc:
            raise ConfigError([f"{key}[{i}].args: {exc}"]) from None
    return envs


def prompt_token_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class Orchestrator:
    def __init__(self, config) -> None:
        from transformers import AutoTokenizer

        self.config = config
        manager = get_plugin_manager()
        if not config.env:
            raise ConfigError(["orchestrator.env: no environment configured; add one, e.g. "
                               "[[orchestrator.env]] id = \"NAME\" with a NAME `prime plugins list` shows"])
        self.envs = load_envs(config.env, manager, "orchestrator.env")
        self.eval_envs = []
        if config.eval is not None:  # their own environments, or training's (the same objects)
            self.eval_envs = (load_envs(config.eval.env, manager, "orchestrator.eval.env") if config.eval.env
                              else self.envs)
        parser = manager.select("tool_parsers", config.rollout.tool_parser, key="orchestrator.rollout.tool_parser")
        self.parse = parser.parse
        self.limits = Limits(max_turns=config.rollout.max_turns, max_tokens=config.rollout.max_tokens or config.seq_len,
                             turn_max_tokens=config.sampling.max_tokens, tool_timeout=config.rollout.tool_timeout)
        from prime_core.hub import loading

        name = config.model.tokenizer or config.model.name
        with loading(name, "model.tokenizer" if config.model.tokenizer else "model.name"):
            self.tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=config.model.trust_remote_code)
        from prime_core.config.shared import use_chat_template

        use_chat_template(self.tokenizer, config.model)
        from prime_core.inference.backend import describe, select_backend

        backend = select_backend(config.client.backend, key="orchestrator.client.backend", manager=manager)
        print(f"inference backend: {describe(backend, config.client.backend)}", flush=True)
        key = config.client.api_key()
        # One client per replica URL (and admin URL); the router chooses among the replicas.
        self.pool = ReplicaPool(config.client,
                                lambda url: backend.client(url, api_key=key, timeout=config.client.timeout),
                                manager.select("routers", config.client.router, key="orchestrator.client.router"))
        self.pool.on_back = self._catch_up
        self.clients = self.pool.clients
        self.teacher = teacher_pool(config, manager)
        # Training rollouts: the teacher's in hard distillation (sft), the policy's otherwise.
        self.rollouts = self.teacher if config.training_mode == "sft" and self.teacher is not None else self.pool
        transport = manager.select("weight_transports", config.weight_broadcast.type, key="weight_broadcast.type")
        self.weights = transport.loader(config, output_dir=config.output_dir)
        self.loads_every_version = transport.loads_every_version
        self.advantages = manager.select("algorithms", f"advantage:{config.advantage.type}",
                                         key="orchestrator.advantage.type", shown=config.advantage.type).fn
        self.version = 0
        self.loaded: tuple[int, str] | None = None
        """The policy every replica up serves: ``(step, path)`` of its last ``load_weights``."""
        self.probe: float | None = None
        self._load_lock = asyncio.Lock()
        self._loading: asyncio.Task | None = None
        """A load started by the loop, which samples on meanwhile."""
        self.dropped_total = 0
        self._next_env = 0
        self._groups = 0
        self.failed_in_a_row = 0
        self.evals: set[asyncio.Task] = set()
        self.evaluated: set[int] = set()
        self.ratios = [env.ratio for env in config.env] if config.env and config.env[0].ratio is not None else None
        self.pre_filters = list(config.pre_batch_filters)
        if config.buffer.online_difficulty_filtering:  # prime-rl 0.5's spelling of the same thing
            from prime_core.orchestrator.config import BatchFilterConfig

            self.pre_filters.append(BatchFilterConfig(type="zero_advantage", enforce=True))
        self.window = _Window()
        self.fit = {"prompts_too_long": 0, "completions_capped": 0}
        """Rollouts that could not fit seq_len as asked (totals, in the metrics)."""
        for name, env in self.envs:  # before waiting for anything: a config that cannot train stops here
            self._task_that_fits(name, env, random.Random(config.seed))

    # ------------------------------------------------------------------ inference

    def wait_healthy(self) -> None:
        self.pool.wait_healthy()
        if self.teacher is not None:
            self.teacher.wait_healthy()

    async def load_base_weights(self) -> None:
        """Serve the base model (policy v0) on every replica before a run from scratch samples,
        as prime-rl resets its servers: one this run did not start may serve an earlier run's
        policy. Without the base model's weights here, say so and go on."""
        name = self.config.model.name
        try:
            folder = model_folder(name, download=False)
        except (OSError, ValueError):  # a hub id not in this machine's cache (the servers' may hold it)
            folder = None
        if folder is None or not any(folder.glob("*.safetensors")):
            print(f"note: no weights of {name} here, so the inference servers were not reset to the base model: "
                  "if one served another run's policy, restart it", flush=True)
            return
        async with self._load_lock:
            notes = await self.pool.fan_out(lambda client: client.load_weights(0, str(folder)))
            self.loaded = (0, str(folder))
        print(f"loaded the base model (policy v0) into {len(notes)} inference server(s)", flush=True)

    async def load_newest_weights(self, minimum: int = 0) -> None:
        async with self._load_lock:  # one load at a time; a caller that waited looks again
            latest = self.weights.latest()
            if latest is None or latest[0] <= self.version or latest[0] < minimum:
                return
            step, path = latest
            # Every replica serves the same policy; the backend decides how (reload, adapter).
            notes = await self.pool.fan_out(lambda client: client.load_weights(step, str(path)))
            self.version, self.loaded = step, (step, str(path))
            self.probe = await self.probe_logprob()
        served = f" as {notes[0]}" if notes and notes[0] else ""
        print(f"loaded policy v{step} into {len(notes)} inference server(s){served} "
              f"(probe logprob {self.probe:.4f})", flush=True)

    def _load_in_background(self) -> None:
        """Start loading a newer published version unless one is loading. The loop goes on
        submitting and collecting meanwhile, so the servers are not left to drain while they
        read the new weights; a group started before the load completes counts as sampled by
        the old version (its lag can only be overstated)."""
        task = self._loading
        if task is not None:
            if not task.done():
                return
            self._loading = None
            task.result()  # a failed load stops the run with its own error
        latest = self.weights.latest()
        if latest is not None and latest[0] > self.version:
            self._loading = asyncio.create_task(self.load_newest_weights())

    async def _catch_up(self, client) -> None:
        """A replica that answers again serves the current policy before it gets requests."""
        if self.loaded is not None:
            await client.load_weights(*self.loaded)

    async def probe_logprob(self) -> float:
        """Sum of log-probabilities of a fixed greedy completion: changes when the weights do."""
        task = self.envs[0][1].tasks(random.Random(0), 1)[0]
        request = SampleRequest(prompt_ids=prompt_token_ids(self.tokenizer, task.prompt), n=1, temperature=0.0,
                                max_tokens=8, session_id="probe")
        (sample,) = await self.pool.sample(request)
        return float(sum(sample.logprobs))

    # ------------------------------------------------------------------ sampling

    def episode(self, env, task, session_id: str, *, temperature: float | None = None,
                seed: int | None = None, sampler: Sampler | None = None) -> Episode:
        sampling = self.config.sampling
        return Episode(task=task, sampler=sampler or self.pool.sample, tokenizer=self.tokenizer, parse=self.parse,
                       limits=self.limits, tools=env_tools(env, task), session_id=session_id,
                       temperature=sampling.temperature if temperature is None else temperature,
                       top_p=sampling.top_p, seed=seed)

    async def sample_group(self, rng: random.Random) -> Group:
        if self.ratios is not None:
            name, env = rng.choices(self.envs, weights=self.ratios)[0]
        else:
            name, env = self.envs[self._next_env % len(self.envs)]
            self._next_env += 1
        self._groups += 1
        group = self._groups
        task, prompt_ids = self._task_that_fits(name, env, rng)
        version = self.version
        seed = self.config.sampling.seed
        turn_max = self.config.sampling.max_tokens
        if turn_max is not None and turn_max > self.config.seq_len - len(prompt_ids):
            self.fit["completions_capped"] += 1  # sampled up to seq_len, never cut afterwards
        # The group is one session: a router keeps its rollouts, which share their prompt, on
        # one replica, and their first turns go as one request (``Coalescer``).
        shared = Coalescer(self.rollouts.sample)
        episodes = [self.episode(env, task, f"group-{group}", sampler=shared.sample,
                                 seed=None if seed is None else (seed * 1_000_003 + group * 7919 + i * 104_729) % 2**31)
                    for i in range(self.config.rollouts_per_example)]
        outcomes = await asyncio.gather(*(run_episode(env, task, episode) for episode in episodes))
        if any(o.error is not None for o in outcomes):
            return Group(name, version, [], [], list(outcomes))
        rewards = [o.reward for o in outcomes]
        advantages = self.advantages(rewards)
        samples = [s for o, adv in zip(outcomes, advantages, strict=True)
                   for s in o.episode.trajectory.samples(advantage=float(adv), reward=o.reward, version=version,
                                                         env=name)]
        if self.config.scores_with_teacher():
            await self.score_with_teacher(samples, session=f"group-{group}")
        return Group(name, version, samples, rewards, list(outcomes))

    async def score_with_teacher(self, samples: list[TrainingSample], *, session: str) -> None:
        """The teacher's log-probability of every token the policy sampled (on-policy
        distillation): one prefill of prompt + completion per sample on the teacher's server,
        as prime-rl asks its teacher (``prompt_logprobs``); tokens the policy did not sample
        (environment and tool turns) get 0.0 and no teacher term."""
        start = time.perf_counter()

        async def one(i: int, sample: TrainingSample) -> None:
            ids = sample.prompt_ids + sample.completion_ids
            logprobs = await self.teacher.prompt_logprobs(ids, session_id=f"{session}-teacher-{i}")
            if len(logprobs) != len(ids):
                raise PrimeError(f"the teacher's server returned {len(logprobs)} log-probabilities for {len(ids)} "
                                 "tokens")
            tail = logprobs[len(sample.prompt_ids):]
            sample.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(tail, sample.mask, strict=True)]

        await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        self.window.teacher_s += time.perf_counter() - start

    def _task_that_fits(self, name: str, env, rng: random.Random):
        """A task whose prompt leaves room for a completion in ``seq_len`` (its tokens trained
        on): longer prompts are skipped and counted, with a warning; when none of
        ``FIT_ATTEMPTS`` in a row fits, the run stops naming the environment and the fix."""
        seq_len = self.config.seq_len
        for _ in range(FIT_ATTEMPTS):
            task = env.tasks(rng, 1)[0]
            prompt_ids = prompt_token_ids(self.tokenizer, task.prompt)
            if len(prompt_ids) < seq_len:
                return task, prompt_ids
            if not self.fit["prompts_too_long"]:
                print(f"warning: environment '{name}': a prompt of {len(prompt_ids)} tokens leaves no room for a "
                      f"completion in seq_len = {seq_len}; such prompts are skipped and counted "
                      "(prompts_too_long in the metrics)", flush=True)
            self.fit["prompts_too_long"] += 1
        raise PrimeError(f"environment '{name}': {FIT_ATTEMPTS} prompts in a row are {seq_len} tokens or longer, "
                         f"leaving nothing to train on within seq_len = {seq_len}",
                         hint="raise seq_len (and inference.model.max_model_len with it)")

    # ------------------------------------------------------------------ eval

    def maybe_evaluate(self, metrics_log: MetricsLogger | None) -> None:
        """Start an evaluation of the loaded policy when its version is due (0, then every
        ``interval``); it runs beside training and logs when it is done."""
        config = self.config.eval
        if config is None or metrics_log is None or self.version in self.evaluated:
            return
        if self.version % config.interval or (self.version == 0 and config.skip_first_step):
            return
        self.evaluated.add(self.version)
        task = asyncio.create_task(self._evaluate(self.version, metrics_log))
        self.evals.add(task)
        task.add_done_callback(self.evals.discard)

    async def evaluate_once(self, tag: str = "eval") -> dict:
        """Every eval environment's fixed examples, k rollouts each (``eval.evaluate``)."""
        from prime_core.orchestrator.eval import evaluate

        config = self.config.eval
        shared = Coalescer(self.pool.sample)

        async def run_one(name, env, task, session):
            return await run_episode(env, task, self.episode(env, task, session, temperature=config.temperature,
                                                             sampler=shared.sample))

        per_env = {env.name or env.id: (env.num_examples, env.rollouts_per_example) for env in config.env}
        return await evaluate(self.eval_envs, run_one, num_examples=config.num_examples if config.num_examples > 0
                              else 32, k=config.rollouts_per_example, seed=config.seed,
                              max_concurrent=config.max_concurrent, tag=tag, per_env=per_env)

    async def _evaluate(self, version: int, metrics_log: MetricsLogger) -> None:
        print(f"evaluating policy v{version} ({len(self.eval_envs)} environment(s))", flush=True)
        results = await self.evaluate_once(tag=f"eval-v{version}")
        metrics_log.log(version, {"eval": results, "weights_version": version},
                        show=tuple(f"eval/{name}/pass@1" for name, _ in self.eval_envs))

    # ------------------------------------------------------------------ the loop

    async def run(self, start: int) -> None:
        config = self.config
        groups_per_step = config.batch_size // config.rollouts_per_example
        max_inflight = groups_per_step * (config.async_level + 1)
        rng = random.Random(config.seed * 1_000_003 + start)
        metrics = MetricsLogger(config, role="orchestrator", output_dir=config.output_dir)
        eval_log = MetricsLogger(config, role="eval", output_dir=config.output_dir) if config.eval else None
        ready: deque[Group] = deque()
        inflight: set[asyncio.Task] = set()
        step, last, waiting = start, time.perf_counter(), None
        self.window = _Window()
        self.pool.start_monitor()
        try:
            if start == 1:
                await self.load_base_weights()
            await self.load_newest_weights(minimum=start - 1)
            if self.probe is None:
                self.probe = await self.probe_logprob()
            self.maybe_evaluate(eval_log)
            while config.max_steps is None or step <= config.max_steps:
                self._submit(inflight, ready, rng, step, start, groups_per_step, max_inflight)
                if len(ready) >= groups_per_step:
                    batch = [ready.popleft() for _ in range(groups_per_step)]
                    fresh = [g for g in batch if (step - 1) - g.version <= config.max_off_policy_steps]
                    if len(fresh) < len(batch):
                        self.window.dropped += len(batch) - len(fresh)
                        ready.extendleft(reversed(fresh))
                        continue
                    await self.pool.refresh_served()
                    now = time.perf_counter()
                    self._write_step(metrics, step, batch, now - last, inflight=len(inflight))
                    step, last = step + 1, now
                    continue
                await self._collect(inflight, ready, timeout=0.2)
                self.pool.raise_if_failed()
                self._load_in_background()
                self.maybe_evaluate(eval_log)
                waiting = self._check_weights_wait(waiting, inflight, max(start - 1, step - 1 - config.async_level))
            await self._final_eval(eval_log)
            await self._take_last_version()
        finally:
            loading = {self._loading} if self._loading is not None else set()
            for task in inflight | self.evals | loading:
                task.cancel()
            await asyncio.gather(*inflight, *self.evals, *loading, return_exceptions=True)  # their routers hear of it
            await self.pool.stop_monitor()
            for client in [*self.clients.values(), *(self.teacher.clients.values() if self.teacher else ())]:
                await client.close()
            metrics.close()
            if eval_log is not None:
                eval_log.close()

    async def _take_last_version(self) -> None:
        """With a transport whose trainer waits for inference to take every version (a
        broadcast), load the last one before exiting: the trainer's last publish waits for it."""
        last = self.config.max_steps
        if not self.loads_every_version or last is None:
            return
        since = None
        while self.version < last:
            await asyncio.sleep(0.2)
            await self.load_newest_weights()
            since = self._check_weights_wait(since, set(), last)

    async def _final_eval(self, eval_log) -> None:
        """Wait for evaluations in flight, and evaluate the last policy when its step is due."""
        config = self.config
        if eval_log is None:
            return
        last = config.max_steps
        if last is not None and last % config.eval.interval == 0:
            deadline = time.monotonic() + config.client.timeout
            while self.version < last and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                await self.load_newest_weights()
            self.maybe_evaluate(eval_log)
        while self.evals:
            await asyncio.gather(*self.evals)

    def _write_step(self, metrics: MetricsLogger, step: int, batch: list[Group], elapsed: float, *,
                    inflight: int) -> None:
        config, window = self.config, self.window
        samples = [s for g in batch for s in g.samples]
        if config.post_batch_filters:
            samples = filters.masked(config.post_batch_filters, samples, len(self.tokenizer), window.filtered)
        outcomes = [o for g in batch for o in g.outcomes]
        lags = [(step - 1) - g.version for g in batch]
        rewards = [r for g in batch for r in g.rewards]
        mean = sum(rewards) / len(rewards)
        info = {"reward": mean, "off_policy_max": max(lags), "versions": sorted({g.version for g in batch})}
        write_batch(config.output_dir, step, pack(samples, config.seq_len),
                    temperature=config.sampling.temperature, info=info, training_mode=config.training_mode,
                    format=config.batch_format)
        self.dropped_total += window.dropped
        sampled = sum(o.episode.trajectory.sampled_tokens for o in outcomes)
        replicas = self.pool.step_metrics()
        cpu = time.process_time()
        metrics.log(step, {
            "reward": mean, "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
            "off_policy_mean": sum(lags) / len(lags), "off_policy_max": info["off_policy_max"],
            "dropped": window.dropped, "dropped_total": self.dropped_total, "inflight": inflight,
            "weights_version": self.version, "probe_logprob": self.probe,
            "samples": len(samples), "step_time": elapsed,
            "sample_tokens_per_s": sampled / elapsed if elapsed > 0 else 0.0,
            "turns": sum(o.episode.turns for o in outcomes) / len(outcomes),
            "trajectory_splits": sum(o.episode.trajectory.splits for o in outcomes),
            "tool_calls": sum(o.episode.tool_calls for o in outcomes),
            "tool_errors": sum(o.episode.tool_errors for o in outcomes),
            "truncated": sum(o.episode.stop_reason == "max_tokens" for o in outcomes) / len(outcomes),
            "env_errors": window.env_errors, "failed_groups": window.failed_groups,
            **({"time/teacher_logprobs": window.teacher_s} if config.scores_with_teacher() else {}),
            **({"filtered": dict(window.filtered), "groups_filtered": window.groups_filtered}
               if config.pre_batch_filters or config.post_batch_filters or self.pre_filters else {}),
            # CPU seconds of this process (its event loop, tokenizing, scoring threads) since the
            # last step: the orchestrator's own cost, time spent waiting on inference excluded.
            "orchestrator_cpu_s": cpu - window.cpu,
            "env_rewards": {name: _mean([r for g in batch if g.env == name for r in g.rewards])
                            for name in {g.env for g in batch}},
            **replicas,
            **self.fit,
        }, show=SHOW + tuple(f"replica_requests/{label}" for label in replicas["replica_requests"]))
        self.window = _Window(cpu=cpu)

    def _submit(self, inflight: set, ready: deque, rng: random.Random, step: int, start: int,
                groups_per_step: int, max_inflight: int) -> None:
        """Start new groups while the policy is fresh enough for the batch they will land in
        (groups are used first in, first out) and at most ``async_level + 1`` batches ahead."""
        config = self.config
        while True:
            pending = len(inflight) + len(ready)
            target = step + pending // groups_per_step
            if pending >= max_inflight or (config.max_steps is not None and target > config.max_steps):
                return
            limit = config.inflight_limit()  # rollouts in flight (whole groups, at least one)
            if limit is not None and inflight and (len(inflight) + 1) * config.rollouts_per_example > limit:
                return
            if self.version < max(start - 1, target - 1 - config.async_level):
                return  # wait for the trainer: the async bound
            inflight.add(asyncio.create_task(self.sample_group(rng)))

    def _check_weights_wait(self, since: float | None, inflight: set, needed: int) -> float | None:
        """When the orchestrator can do nothing until policy ``needed`` is published, since when
        it has waited; past ``weights_timeout`` the run stops naming what it waited for."""
        if inflight or self.version >= needed:
            return None
        now = time.monotonic()
        since = since if since is not None else now
        timeout = self.config.weights_timeout
        if timeout is not None and now - since > timeout:
            raise PrimeError(f"waited {timeout:g} s for policy v{needed}: the trainer has not published "
                             f"{self.config.output_dir / 'weights' / f'step_{needed}'} (with its STABLE marker)",
                             hint="see the trainer's log (output_dir/logs/trainer.log); raise "
                                  "orchestrator.weights_timeout if its steps take that long")
        return since

    async def _collect(self, inflight: set, ready: deque, timeout: float) -> None:
        # a load that completes wakes the loop too: the new version may let it submit
        loading = {self._loading} if self._loading is not None and not self._loading.done() else set()
        if not inflight and not loading:
            await asyncio.sleep(timeout)  # nothing to wait on but the trainer's next weights
            return
        done, _ = await asyncio.wait(inflight | loading, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        done -= loading
        inflight.difference_update(done)
        errors = [task.exception() for task in done if not task.cancelled() and task.exception()]
        if errors:  # a failed request (not an environment's error) stops the orchestrator with its message
            for task in inflight:
                task.cancel()
            raise errors[0]
        for group in (task.result() for task in done):
            if not group.failed:
                self.failed_in_a_row = 0
                if self.pre_filters:
                    group.samples = filters.apply(self.pre_filters, group.samples, len(self.tokenizer),
                                                  self.window.filtered)
                    if not group.samples:  # nothing left to learn from: it does not count toward a batch
                        self.window.groups_filtered += 1
                        continue
                ready.append(group)
                continue
            self.window.failed_groups += 1
            self.window.env_errors += len(group.failed)
            self.failed_in_a_row += 1
            print(f"environment '{group.env}': {len(group.failed)} of {len(group.outcomes)} rollouts failed, group "
                  f"dropped: {group.failed[0].error}", flush=True)
            if self.failed_in_a_row >= self.config.rollout.max_failed_groups:
                raise PrimeError(f"environment '{group.env}' failed {self.failed_in_a_row} groups in a row; the last "
                                 f"error: {group.failed[0].error}",
                                 hint="fix the environment, or raise orchestrator.rollout.max_failed_groups")


@dataclass
class _Window:
    """What happened since the last step was written."""

    cpu: float = field(default_factory=time.process_time)
    dropped: int = 0
    env_errors: int = 0
    failed_groups: int = 0
    groups_filtered: int = 0
    filtered: dict[str, int] = field(default_factory=dict)
    """Samples each filter detected (``pre_batch_filters``, ``post_batch_filters``), by type."""
    teacher_s: float = 0.0
    """Seconds spent waiting for the teacher's log-probabilities (summed over groups)."""


def teacher_pool(config, manager) -> ReplicaPool | None:
    """The teacher's servers (``orchestrator.teacher``), through its backend's client; ``None``
    without a teacher. A teacher that scores tokens needs a backend that can
    (``prompt_logprobs``)."""
    from prime_core.inference.backend import select_backend
    from prime_core.inference.client import can_score

    teacher = config.teacher
    if teacher is None:
        return None
    backend = select_backend(teacher.client.backend, key="orchestrator.teacher.client.backend", manager=manager)
    key = teacher.client.api_key()
    pool = ReplicaPool(teacher.client, lambda url: backend.client(url, api_key=key, timeout=teacher.client.timeout),
                       manager.select("routers", teacher.client.router, key="orchestrator.teacher.client.router"),
                       router_key="orchestrator.teacher.client.router")
    if config.scores_with_teacher() and not all(can_score(c) for c in pool.clients.values()):
        raise ConfigError([f"orchestrator.teacher.client.backend: the '{backend.name}' backend's client cannot score "
                           "given tokens (prompt_logprobs), which the teacher of on-policy distillation does; serve "
                           "the teacher with a backend whose client has prompt_logprobs (`prime plugins list` shows "
                           "the installed backends)"])
    print(f"teacher: {teacher.model.name} at {', '.join(teacher.client.base_url)} ({backend.name}; "
          f"{'samples the rollouts' if config.training_mode == 'sft' else 'scores the sampled tokens'})", flush=True)
    return pool


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run(config) -> int:
    start = 1
    if config.resume:
        start = ckpt.latest_step(config.output_dir, step=config.ckpt.resume_step) + 1
        remove_after(config.output_dir, start - 1)
        remove_batches_from(config.output_dir, start)
        drop_steps_from(config.output_dir / METRICS_FILE, "orchestrator", start)
        drop_steps_from(config.output_dir / METRICS_FILE, "eval", start)
        print(f"resuming at step {start}", flush=True)
    orchestrator = Orchestrator(config)
    orchestrator.wait_healthy()
    pool = orchestrator.pool
    through = "" if pool.own_counts else f" behind {', '.join(r.url for r in pool.sampling)}"
    print(f"orchestrator: {len(pool.engines)} inference replica(s) healthy{through}; steps {start}..{config.max_steps}",
          flush=True)
    asyncio.run(orchestrator.run(start))
    return 0
