"""The orchestrator's view of the inference replicas (``prime_core.orchestrator.pool``): a
failed request is retried on another replica, a replica that fails its health check is left
out (``on_replica_failure = "continue"``) or stops the run (``"stop"``), one that answers
again takes the current weights first, and behind a router admin calls go to each engine.

The clients here are scripted (a replica is told to be down); the real client against real
vLLM servers is in ``tests/test_rl_e2e.py`` and the vllm-router plugin's tests.
"""

from __future__ import annotations

import asyncio

import pytest

from prime_core.errors import PrimeError
from prime_core.inference.client import Sample, SampleRequest
from prime_core.orchestrator.config import ClientConfig
from prime_core.orchestrator.pool import ReplicaPool
from prime_core.routers import ConsistentHash, RoundRobin
from prime_core.specs import Router

A, B = "http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"


class Scripted:
    """A replica that answers until it is told it is down."""

    def __init__(self, url: str, log: list) -> None:
        self.url, self.log, self.down, self.served = url, log, False, 0

    slow = 0
    """Health checks still to fail although the replica is up (a busy machine)."""

    def health(self) -> bool:
        self.log.append(("health", self.url))
        if self.slow:
            self.slow -= 1
            return False
        return not self.down

    async def sample(self, request: SampleRequest) -> list[Sample]:
        await asyncio.sleep(0.001)
        if self.down:
            raise PrimeError(f"sampling at {self.url}: the inference server is not answering")
        self.served += 1
        self.log.append(("sample", self.url, request.session_id))
        return [Sample(token_ids=[1], logprobs=[-0.5], finish_reason="stop", text="a") for _ in range(request.n)]

    async def load_weights(self, step: int, path: str) -> str | None:
        if self.down:
            raise PrimeError(f"update_weights at {self.url} failed: no answer")
        self.log.append(("load", self.url, step))
        return None

    async def requests_served(self) -> float:
        return float(self.served)


def pool(log, router=RoundRobin, **client) -> ReplicaPool:
    config = ClientConfig(**{"base_url": [A, B], "health_interval": 0.02, **client})
    clients = {}

    def make(url):
        clients[url] = Scripted(url, log)
        return clients[url]

    made = ReplicaPool(config, make, Router(name="test", make=router))
    made.scripted = clients
    return made


def request(session: str | None = None) -> SampleRequest:
    return SampleRequest(prompt_ids=[1, 2], max_tokens=1, session_id=session)


async def sample_all(replicas: ReplicaPool, count: int, sessions: bool = False):
    return await asyncio.gather(*(replicas.sample(request(f"s{i}" if sessions else None)) for i in range(count)))


def test_a_dead_replica_is_left_out_and_its_requests_are_retried_on_the_other(capsys):
    log: list = []
    replicas = pool(log, router=ConsistentHash)
    replicas.scripted[B].down = True
    results = asyncio.run(sample_all(replicas, 20, sessions=True))
    assert len(results) == 20 and all(len(r) == 1 for r in results), "every request was answered"
    assert {e[1] for e in log if e[0] == "sample"} == {A}
    assert not replicas.replicas[B].up
    out = capsys.readouterr().out
    assert out.count(f"warning: inference replica {B} stopped answering its health check: going on with 1 of 2 "
                     "replica(s) (orchestrator.client.on_replica_failure = 'continue')") == 1
    metrics = replicas.step_metrics()
    assert metrics["replicas_up"] == 1 and metrics["replicas"] == 2
    assert metrics["replica_requests"] == {"127.0.0.1:8000": 20, "127.0.0.1:8001": 0}
    assert metrics["request_retries"] >= 1, "the sessions that lived on B were retried on A"
    assert replicas.step_metrics()["replica_requests"] == {"127.0.0.1:8000": 0, "127.0.0.1:8001": 0}, "per step"

    loaded = asyncio.run(replicas.fan_out(lambda client: client.load_weights(3, "w")))
    assert loaded == [None] and [e for e in log if e[0] == "load"] == [("load", A, 3)], "weights skip B"


def test_one_slow_health_check_is_not_a_dead_replica():
    replicas = pool([], on_replica_failure="stop")
    replicas.scripted[B].slow = 1
    asyncio.run(replicas.check(replicas.replicas[B]))
    assert replicas.replicas[B].up, "checked again a second later, and it answered"


def test_with_stop_a_dead_replica_stops_the_run_naming_it():
    replicas = pool([], on_replica_failure="stop")
    replicas.scripted[B].down = True
    with pytest.raises(PrimeError, match=f"inference replica {B} stopped answering its health check "
                                         r"\(orchestrator.client.on_replica_failure = 'stop'\)"):
        asyncio.run(sample_all(replicas, 4))


def test_with_every_replica_down_the_run_stops():
    replicas = pool([])
    replicas.scripted[A].down = replicas.scripted[B].down = True
    with pytest.raises(PrimeError, match="every inference replica is down"):
        asyncio.run(sample_all(replicas, 2))


def test_a_weight_update_that_fails_on_a_live_replica_is_an_error():
    replicas = pool([])

    async def broken(client):
        raise PrimeError(f"update_weights at {client.url} failed: HTTP 500")

    with pytest.raises(PrimeError, match="HTTP 500"):
        asyncio.run(replicas.fan_out(broken))
    assert all(r.up for r in replicas.replicas.values()), "it answers its health check: not left out"


def test_the_monitor_leaves_out_a_dead_replica_and_takes_it_back_with_the_current_weights(capsys):
    log: list = []
    replicas = pool(log)

    async def scenario():
        replicas.on_back = lambda client: client.load_weights(7, "weights/step_7")
        replicas.start_monitor()
        replicas.scripted[B].down = True
        while replicas.replicas[B].up:
            await asyncio.sleep(0.01)
        assert [e[1] for e in log if e[0] == "load"] == []
        await sample_all(replicas, 6)
        replicas.scripted[B].down = False
        while not replicas.replicas[B].up:
            await asyncio.sleep(0.01)
        replicas.raise_if_failed()
        await sample_all(replicas, 6)
        await replicas.stop_monitor()

    asyncio.run(scenario())
    assert ("load", B, 7) in log, "the replica took the current weights before it came back"
    back = log.index(("load", B, 7))
    assert all(e[1] == A for e in log[:back] if e[0] == "sample"), "no request reached it while it was down"
    assert any(e[1] == B for e in log[back:] if e[0] == "sample"), "then it served again"
    assert f"inference replica {B} answers again: back in (2 of 2 replica(s) up)" in capsys.readouterr().out


def test_the_monitor_stops_the_run_with_stop():
    replicas = pool([], on_replica_failure="stop")

    async def scenario():
        replicas.start_monitor()
        replicas.scripted[A].down = True
        for _ in range(200):
            await asyncio.sleep(0.01)
            replicas.raise_if_failed()

    with pytest.raises(PrimeError, match=f"inference replica {A} stopped answering"):
        asyncio.run(scenario())


def test_behind_a_router_requests_go_to_it_and_admin_calls_to_each_engine():
    log: list = []
    router, e1, e2 = "http://127.0.0.1:9000/v1", A, B
    replicas = pool(log, base_url=[router], admin_base_url=[e1, e2])
    assert not replicas.own_counts and [r.url for r in replicas.engines] == [e1, e2]

    async def scenario():
        await sample_all(replicas, 5)
        replicas.scripted[e1].served, replicas.scripted[e2].served = 3, 2  # what the engines report
        await replicas.refresh_served()
        first = replicas.step_metrics()
        replicas.scripted[e1].served = 10
        await replicas.refresh_served()
        return first, replicas.step_metrics()

    first, second = asyncio.run(scenario())
    assert {e[1] for e in log if e[0] == "sample"} == {router}
    assert first["replica_requests"] == {"127.0.0.1:8000": 3, "127.0.0.1:8001": 2}
    assert second["replica_requests"] == {"127.0.0.1:8000": 7, "127.0.0.1:8001": 0}
    asyncio.run(replicas.fan_out(lambda client: client.load_weights(1, "w")))
    assert sorted(e[1] for e in log if e[0] == "load") == [e1, e2], "weights bypass the router"


def test_behind_a_router_a_failed_request_is_retried_on_it_after_a_pause():
    replicas = pool([], base_url=["http://127.0.0.1:9000/v1"], admin_base_url=[A, B])
    front = replicas.scripted["http://127.0.0.1:9000/v1"]
    front.down = True

    async def recovers():
        await asyncio.sleep(0.5)
        front.down = False

    async def scenario():
        return await asyncio.gather(replicas.sample(request()), recovers())

    (samples, _) = asyncio.run(scenario())
    assert len(samples) == 1 and replicas.replicas[front.url].up, "a router is not left out for its failures"
    assert replicas.step_metrics()["request_retries"] == 1


def test_a_router_picking_a_replica_that_is_down_is_named():
    class Stubborn:
        def __init__(self, urls):
            self.urls = urls

        def pick(self, request, exclude=()):
            return self.urls[1]

        def done(self, url, *, ok, latency):
            pass

    replicas = pool([], router=Stubborn)
    replicas.scripted[B].down = True
    replicas.replicas[B].up = False
    with pytest.raises(PrimeError, match="router = 'test' picked 'http://127.0.0.1:8001/v1', which is down"):
        asyncio.run(replicas.sample(request()))
