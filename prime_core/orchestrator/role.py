"""The orchestrator loop (``prime orchestrator CONFIG``).

It keeps groups of ``rollouts_per_example`` completions in flight on the inference servers
(OpenAI completions API, token ids in and out, with per-token log-probabilities), scores
each group with its environment's rubric, turns rewards into advantages with the selected
estimator, and every ``batch_size`` samples packs a step batch for the trainer.

Asynchrony: every group remembers the policy version it was sampled with. The batch of step
N is handed over only once policy ``N-1-async_level`` is loaded for inference, and groups
whose lag ``(N-1) - version`` exceeds ``max_off_policy_steps`` are dropped and counted. New
weights published by the trainer are loaded into every server as soon as they appear.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import deque
from dataclasses import dataclass

from prime_core.errors import ConfigError, PrimeError
from prime_core.metrics import METRICS_FILE, MetricsLogger, drop_steps_from
from prime_core.orchestrator.batch import TrainingSample, pack, remove_batches_from, write_batch
from prime_core.plugins import get_plugin_manager
from prime_core.trainer import ckpt
from prime_core.weights import is_adapter, remove_after

SHOW = ("reward", "off_policy_max", "dropped", "weights_version", "sample_tokens_per_s")


@dataclass
class Group:
    env: str
    version: int
    samples: list[TrainingSample]
    rewards: list[float]


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
                               "[[orchestrator.env]] id = \"reverse_text\" (see `prime plugins list`)"])
        self.envs = []
        for i, env in enumerate(config.env):
            spec = manager.select("environments", env.id, key=f"orchestrator.env[{i}].id")
            try:
                self.envs.append((env.name or env.id, spec.load(**env.args)))
            except (TypeError, ValueError) as exc:
                raise ConfigError([f"orchestrator.env[{i}].args: {exc}"]) from None
        from prime_core.hub import loading

        name = config.model.tokenizer or config.model.name
        with loading(name, "model.tokenizer" if config.model.tokenizer else "model.name"):
            self.tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=config.model.trust_remote_code)
        backend = manager.select("inference_backends", config.client.backend, key="orchestrator.client.backend")
        self.admins = [backend.admin(url) for url in config.client.base_url]
        self.router = manager.select("routers", config.client.router, key="orchestrator.client.router").make(
            config.client.base_url)
        transport = manager.select("weight_transports", config.weight_broadcast.type, key="weight_broadcast.type")
        self.weights = transport.loader(config, output_dir=config.output_dir)
        self.advantages = manager.select("algorithms", f"advantage:{config.advantage.type}",
                                         key="orchestrator.advantage.type", shown=config.advantage.type).fn
        self.version = 0
        self.served_model = config.model.name  # the base model, or the newest LoRA adapter
        self.adapters: list[str] = []
        self.probe: float | None = None
        self.dropped_total = 0
        self._next_env = 0

    # ------------------------------------------------------------------ inference

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.client.health_timeout
        for admin, url in zip(self.admins, self.config.client.base_url, strict=True):
            while not admin.health():
                if time.monotonic() > deadline:
                    raise PrimeError(
                        f"inference server at {url} did not become healthy within "
                        f"{self.config.client.health_timeout:.0f} s (orchestrator.client.health_timeout)",
                        hint="check the inference log under output_dir/logs/",
                    )
                time.sleep(1.0)

    async def load_newest_weights(self, minimum: int = 0) -> None:
        latest = self.weights.latest()
        if latest is None or latest[0] <= self.version or latest[0] < minimum:
            return
        step, path = latest
        if is_adapter(path):
            # LoRA: each version is a new adapter name; requests switch to it, and the adapter
            # before the previous one is unloaded (the previous may still finish requests).
            name = f"{self.config.model.name}-lora-step-{step}"
            for admin in self.admins:
                await asyncio.to_thread(admin.load_adapter, name, path)
            self.adapters.append(name)
            self.served_model = name
            while len(self.adapters) > 2:
                old = self.adapters.pop(0)
                for admin in self.admins:
                    await asyncio.to_thread(admin.unload_adapter, old)
        else:
            for admin in self.admins:
                await asyncio.to_thread(admin.update_weights, path)
        self.version = step
        self.probe = await self.probe_logprob()
        served = f" as LoRA adapter {self.served_model}" if self.adapters else ""
        print(f"loaded policy v{step} into inference{served} (probe logprob {self.probe:.4f})", flush=True)

    async def probe_logprob(self) -> float:
        """Sum of log-probabilities of a fixed greedy completion: changes when weights do."""
        task = self.envs[0][1].tasks(random.Random(0), 1)[0]
        body = self._request(prompt_token_ids(self.tokenizer, task.prompt), n=1, temperature=0.0, max_tokens=8)
        choice = (await self._post(self.config.client.base_url[0], body))["choices"][0]
        return float(sum(lp for lp in choice["logprobs"]["token_logprobs"] if lp is not None))

    # ------------------------------------------------------------------ sampling

    def _request(self, prompt_ids: list[int], *, n: int, temperature: float, max_tokens: int) -> dict:
        sampling = self.config.sampling
        body = {"model": self.served_model, "prompt": prompt_ids, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": sampling.top_p, "logprobs": 0, "return_token_ids": True}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    async def _post(self, url: str, body: dict, attempts: int = 3) -> dict:
        import httpx

        for attempt in range(attempts):
            try:
                response = await self.http.post(f"{url}/completions", json=body, timeout=self.config.client.timeout)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
                # A pooled connection the server just closed; sampling again is harmless.
                if attempt == attempts - 1:
                    raise PrimeError(f"inference request to {url} failed {attempts} times: "
                                     f"{type(exc).__name__}: {exc}") from None
                await asyncio.sleep(0.5 * (attempt + 1))
        if response.status_code != 200:
            raise PrimeError(f"inference request to {url} failed ({response.status_code}): {response.text[:500]}")
        return response.json()

    async def sample_group(self, rng: random.Random) -> Group:
        name, env = self.envs[self._next_env % len(self.envs)]
        self._next_env += 1
        task = env.tasks(rng, 1)[0]
        version = self.version
        prompt_ids = prompt_token_ids(self.tokenizer, task.prompt)
        max_tokens = self.config.sampling.max_tokens or max(1, self.config.seq_len - len(prompt_ids))
        body = self._request(prompt_ids, n=self.config.rollouts_per_example,
                             temperature=self.config.sampling.temperature, max_tokens=max_tokens)
        url = self.router.pick(body)
        try:
            result = await self._post(url, body)
        finally:
            self.router.done(url)
        rewards, completions = [], []
        for choice in result["choices"]:
            rewards.append(float(await asyncio.to_thread(env.score, task, choice["text"])))
            logprobs = [lp if lp is not None else 0.0 for lp in choice["logprobs"]["token_logprobs"]]
            completions.append((list(choice["token_ids"]), logprobs))
        advantages = self.advantages(rewards)
        samples = [TrainingSample(prompt_ids, ids, lps, float(adv), reward, version, name)
                   for (ids, lps), adv, reward in zip(completions, advantages, rewards, strict=True)]
        return Group(name, version, samples, rewards)

    # ------------------------------------------------------------------ the loop

    async def run(self, start: int) -> None:
        import httpx

        config = self.config
        groups_per_step = config.batch_size // config.rollouts_per_example
        max_inflight = groups_per_step * (config.async_level + 1)
        rng = random.Random(config.seed * 1_000_003 + start)
        metrics = MetricsLogger(config, role="orchestrator", output_dir=config.output_dir)
        ready: deque[Group] = deque()
        inflight: set[asyncio.Task] = set()
        step, dropped, last = start, 0, time.perf_counter()
        sampled_tokens = 0
        # Expire idle connections before the server does (uvicorn: 5 s), so none is reused
        # at the moment the server closes it.
        limits = httpx.Limits(keepalive_expiry=2.0)
        key = os.environ.get(config.client.api_key_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(limits=limits, headers=headers) as self.http:
            await self.load_newest_weights(minimum=start - 1)
            if self.probe is None:
                self.probe = await self.probe_logprob()
            while config.max_steps is None or step <= config.max_steps:
                self._submit(inflight, ready, rng, step, start, groups_per_step, max_inflight)
                if len(ready) >= groups_per_step:
                    batch = [ready.popleft() for _ in range(groups_per_step)]
                    fresh = [g for g in batch if (step - 1) - g.version <= config.max_off_policy_steps]
                    if len(fresh) < len(batch):
                        dropped += len(batch) - len(fresh)
                        ready.extendleft(reversed(fresh))
                        continue
                    samples = [s for g in batch for s in g.samples]
                    sampled_tokens += sum(len(s.completion_ids) for s in samples)
                    lags = [(step - 1) - g.version for g in batch]
                    rewards = [r for g in batch for r in g.rewards]
                    info = {"reward": sum(rewards) / len(rewards), "off_policy_max": max(lags),
                            "versions": sorted({g.version for g in batch})}
                    write_batch(config.output_dir, step, pack(samples, config.seq_len),
                                temperature=config.sampling.temperature, info=info)
                    now = time.perf_counter()
                    self.dropped_total += dropped
                    metrics.log(step, {
                        "reward": info["reward"],
                        "reward_std": (sum((r - info["reward"]) ** 2 for r in rewards) / len(rewards)) ** 0.5,
                        "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
                        "off_policy_mean": sum(lags) / len(lags), "off_policy_max": info["off_policy_max"],
                        "dropped": dropped, "dropped_total": self.dropped_total, "inflight": len(inflight),
                        "weights_version": self.version, "probe_logprob": self.probe,
                        "samples": len(samples), "step_time": now - last,
                        "sample_tokens_per_s": sampled_tokens / (now - last) if now > last else 0.0,
                        "env_rewards": {name: _mean([r for g in batch if g.env == name for r in g.rewards])
                                        for name in {g.env for g in batch}},
                    }, show=SHOW)
                    step, dropped, last, sampled_tokens = step + 1, 0, now, 0
                    continue
                await self._collect(inflight, ready, timeout=0.2)
                await self.load_newest_weights()
            for task in inflight:
                task.cancel()
        metrics.close()

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
            if self.version < max(start - 1, target - 1 - config.async_level):
                return  # wait for the trainer: the async bound
            inflight.add(asyncio.create_task(self.sample_group(rng)))

    @staticmethod
    async def _collect(inflight: set, ready: deque, timeout: float) -> None:
        if not inflight:
            await asyncio.sleep(timeout)  # nothing to wait on but the trainer's next weights
            return
        done, _ = await asyncio.wait(inflight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        inflight.difference_update(done)
        errors = [task.exception() for task in done if not task.cancelled() and task.exception()]
        if errors:  # a failed request stops the orchestrator with its message
            for task in inflight:
                task.cancel()
            raise errors[0]
        ready.extend(task.result() for task in done)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run(config) -> int:
    start = 1
    if config.resume:
        start = ckpt.latest_step(config.output_dir) + 1
        remove_after(config.output_dir, start - 1)
        remove_batches_from(config.output_dir, start)
        drop_steps_from(config.output_dir / METRICS_FILE, "orchestrator", start)
        print(f"resuming at step {start}", flush=True)
    orchestrator = Orchestrator(config)
    orchestrator.wait_healthy()
    print(f"orchestrator: {len(config.client.base_url)} server(s) healthy; steps {start}..{config.max_steps}",
          flush=True)
    asyncio.run(orchestrator.run(start))
    return 0
