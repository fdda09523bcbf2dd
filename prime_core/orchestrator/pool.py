"""The inference replicas as the orchestrator sees them.

Two planes, as in prime-rl: requests go to ``orchestrator.client.base_url`` (the replicas
themselves, spread by the client-side router, or one router process in front of them), admin
calls (weight updates, health checks) to ``admin_base_url`` (every engine; by default the same
URLs), never through a router. There is one backend client per distinct URL.

- Sampling: the router picks among the replicas that are up; a request that fails is retried
  (``max_retries``) on another replica, and the replica it failed on is health-checked at
  once. Behind a single URL the retry goes to that URL again after a pause, while the router
  in front notices the dead engine.
- Health: every engine is checked every ``health_interval`` seconds (a router in front is
  not: its process is the launcher's to watch). An engine that fails its check twice in a row
  (a second later) is down:
  ``on_replica_failure = "stop"`` stops the run naming it; ``"continue"`` goes on with the
  others (said in the log, counted in the metrics) until none is left. An engine that answers
  again gets the current weights before it serves again.
- Per step: requests finished per replica (the orchestrator's own count; behind a router,
  each engine's own count where its client reports one: ``requests_served``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prime_core.errors import PrimeError

RETRY_PAUSE_CAP = 8.0
"""Longest pause (s) before retrying a request on the one URL there is."""
RECHECK_PAUSE = 1.0
"""Seconds before an engine that failed its health check is checked again, and found down if
it fails again."""
HEALTH_POLL = 0.2
"""Seconds between health checks while waiting for the replicas to come up: a refused
connection answers at once, and each second of a longer pause was, on average, half a second
of every run's start spent after the server was ready."""


@dataclass(eq=False)
class Replica:
    url: str
    client: Any
    sampling: bool
    """Requests go to it (``base_url``)."""
    engine: bool
    """It is an inference engine (``admin_base_url``, or ``base_url`` without one): weights go to it."""
    up: bool = True
    requests: int = 0
    """Requests it finished since the last step was recorded."""
    served: float | None = None
    """The engine's own count of requests served, when the last step was recorded."""
    served_now: float | None = None

    @property
    def label(self) -> str:
        return urlsplit(self.url).netloc or self.url


class ReplicaPool:
    def __init__(self, config, make_client, router_spec, *, router_key: str = "orchestrator.client.router") -> None:
        self.config = config
        self.key = router_key.rsplit(".", 1)[0]
        """Where ``config`` sits (``orchestrator.client``, ``orchestrator.teacher.client``), for messages."""
        sampling = list(dict.fromkeys(config.base_url))
        engines = list(dict.fromkeys(config.admin_base_url or config.base_url))
        self.replicas = {url: Replica(url, make_client(url), sampling=url in sampling, engine=url in engines)
                         for url in dict.fromkeys(sampling + engines)}
        self.sampling = [self.replicas[url] for url in sampling]
        self.engines = [self.replicas[url] for url in engines]
        self.own_counts = set(sampling) == set(engines)
        """Each request's replica is known here (no router process in between)."""
        self.router_name = router_spec.name
        self.router = router_spec.make(sampling)
        self.on_back = None
        """``async on_back(client)``: what a replica that answers again needs before it serves
        (the orchestrator loads the current weights)."""
        self.retries = 0
        self._checks: dict[str, asyncio.Task] = {}
        self._monitor: asyncio.Task | None = None

    @property
    def clients(self) -> dict[str, Any]:
        return {url: replica.client for url, replica in self.replicas.items()}

    def up(self, replicas) -> list[Replica]:
        return [r for r in replicas if r.up]

    # -- start-up --------------------------------------------------------------------------

    def wait_healthy(self) -> None:
        """Block until every replica answers its health check (``health_timeout``)."""
        timeout = self.config.health_timeout
        deadline = time.monotonic() + timeout
        for url, replica in self.replicas.items():
            while not replica.client.health():
                if time.monotonic() > deadline:
                    raise PrimeError(
                        f"inference server at {url} did not become healthy within {timeout:.0f} s "
                        f"({self.key}.health_timeout)",
                        hint="check the inference log under output_dir/logs/",
                    )
                time.sleep(HEALTH_POLL)

    # -- sampling --------------------------------------------------------------------------

    async def sample(self, request):
        """``request`` on a replica the router picks; retried elsewhere when it fails."""
        url, samples = await self.on_a_replica(request, lambda client: client.sample(request))
        if len(samples) != request.n:
            raise PrimeError(f"inference server at {url} returned {len(samples)} samples for n = {request.n}")
        return samples

    async def prompt_logprobs(self, token_ids: list[int], *, session_id: str | None = None) -> list[float]:
        """Each token's log-probability after the ones before it, from a replica the router picks
        (a teacher scoring the student's tokens); retried elsewhere when it fails."""
        from prime_core.inference.client import SampleRequest

        route = SampleRequest(prompt_ids=list(token_ids), max_tokens=1, session_id=session_id)
        _, logprobs = await self.on_a_replica(route, lambda client: client.prompt_logprobs(list(token_ids)))
        return logprobs

    async def on_a_replica(self, request, call) -> tuple[str, Any]:
        """``(url, await call(client))`` on the replica the router picks for ``request``; a call
        that fails is retried on another replica (``max_retries``)."""
        tried: set[str] = set()
        attempt = rounds = 0
        while True:
            down = {r.url for r in self.sampling if not r.up}
            if len(down) == len(self.sampling):
                raise self._none_left()
            if down | tried >= {r.url for r in self.sampling}:  # every replica up was tried: again, after a pause
                tried.clear()
                rounds += 1
                await asyncio.sleep(min(2.0 ** (rounds - 1), RETRY_PAUSE_CAP))
            exclude = frozenset(down | tried)
            url = self.router.pick(request, exclude=exclude)
            replica = self.replicas.get(url)
            if replica is None or not replica.sampling or url in exclude:
                raise PrimeError(f"{self.key}.router = '{self.router_name}' picked {url!r}, which is "
                                 + (f"not in {self.key}.base_url "
                                    f"({', '.join(r.url for r in self.sampling)})" if replica is None
                                    or not replica.sampling else "down or already failed for this request"))
            start, ok = time.perf_counter(), False
            try:
                answer = await call(replica.client)
                ok = True
            except Exception as exc:  # the replica's failure: retried below, or raised when no try is left
                error = exc
            finally:
                self.router.done(url, ok=ok, latency=time.perf_counter() - start)
            if ok:
                replica.requests += 1
                return url, answer
            if replica.engine:  # a router in front is not judged by its health: it reports its engines'
                await self.check(replica)
            attempt += 1
            if attempt > self.config.max_retries:
                raise error
            self.retries += 1
            tried.add(url)

    # -- health ----------------------------------------------------------------------------

    async def check(self, replica: Replica) -> None:
        """Health-check ``replica`` now (one check at a time per replica) and act on the answer."""
        task = self._checks.get(replica.url)
        if task is None:
            task = self._checks[replica.url] = asyncio.ensure_future(self._check(replica))
            task.add_done_callback(lambda _: self._checks.pop(replica.url, None))
        await asyncio.shield(task)

    async def _check(self, replica: Replica) -> None:
        healthy = await asyncio.to_thread(replica.client.health)
        if not healthy and replica.up:  # twice: one slow answer on a busy machine is not a dead engine
            await asyncio.sleep(RECHECK_PAUSE)
            healthy = await asyncio.to_thread(replica.client.health)
        if not healthy and replica.up:
            self._down(replica)
        elif healthy and not replica.up:
            await self._back(replica)

    def _down(self, replica: Replica) -> None:
        replica.up = False
        if self.config.on_replica_failure == "stop":
            raise PrimeError(f"inference replica {replica.url} stopped answering its health check "
                             f"({self.key}.on_replica_failure = 'stop')",
                             hint="see its log under output_dir/logs/; on_replica_failure = 'continue' goes on "
                                  "with the other replicas")
        if not self.up(self.sampling) or not self.up(self.engines):
            raise self._none_left()
        print(f"warning: inference replica {replica.url} stopped answering its health check: going on with "
              f"{len(self.up(self.engines))} of {len(self.engines)} replica(s) "
              f"({self.key}.on_replica_failure = 'continue')", flush=True)

    async def _back(self, replica: Replica) -> None:
        if self.on_back is not None:
            try:
                await self.on_back(replica.client)
            except PrimeError as exc:
                print(f"warning: inference replica {replica.url} answers again but could not take the current "
                      f"weights; it stays out: {exc}", flush=True)
                return
        replica.up = True
        print(f"inference replica {replica.url} answers again: back in ({len(self.up(self.engines))} of "
              f"{len(self.engines)} replica(s) up)", flush=True)

    def _none_left(self) -> PrimeError:
        return PrimeError(f"every inference replica is down ({', '.join(r.url for r in self.engines)}"
                          + ("" if self.own_counts else f"; requests go through {self.sampling[0].url}") + ")",
                          hint="see the inference logs under output_dir/logs/")

    async def monitor(self) -> None:
        """Check every replica every ``health_interval`` seconds, for as long as the run goes."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            await asyncio.gather(*(self.check(r) for r in self.engines))

    def start_monitor(self) -> None:
        self._monitor = asyncio.ensure_future(self.monitor())

    def raise_if_failed(self) -> None:
        """Raise what stopped the health monitor (a replica down with ``stop``, none left)."""
        if self._monitor is not None and self._monitor.done() and not self._monitor.cancelled():
            self._monitor.result()

    async def stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, *self._checks.values(), return_exceptions=True)

    # -- admin -----------------------------------------------------------------------------

    async def fan_out(self, call) -> list:
        """``await call(client)`` on every engine that is up, at once; an engine that fails and
        then fails its health check is down (see ``_down``), any other failure is raised.
        Returns the results of the engines that succeeded."""
        engines = self.up(self.engines)
        results = await asyncio.gather(*(call(r.client) for r in engines), return_exceptions=True)
        out = []
        for replica, result in zip(engines, results, strict=True):
            if not isinstance(result, BaseException):
                out.append(result)
                continue
            await self.check(replica)
            if replica.up:
                raise result
        return out

    # -- metrics ---------------------------------------------------------------------------

    async def refresh_served(self) -> None:
        """Ask every engine that is up how many requests it served (behind a router only)."""
        if self.own_counts:
            return
        engines = [r for r in self.up(self.engines) if hasattr(r.client, "requests_served")]
        counts = await asyncio.gather(*(r.client.requests_served() for r in engines), return_exceptions=True)
        for replica, count in zip(engines, counts, strict=True):
            replica.served_now = None if isinstance(count, BaseException) else count

    def step_metrics(self) -> dict:
        """Replicas up and requests per replica since the last call."""
        requests = {}
        for replica in self.engines:
            if self.own_counts:
                requests[replica.label] = replica.requests
            elif replica.served_now is not None:
                requests[replica.label] = int(replica.served_now - (replica.served or 0))
                replica.served = replica.served_now
        for replica in self.replicas.values():
            replica.requests = 0
        metrics = {"replicas_up": len(self.up(self.engines)), "replicas": len(self.engines),
                   "replica_requests": requests, "request_retries": self.retries}
        self.retries = 0
        return metrics
