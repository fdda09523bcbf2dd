"""The router contract suite: the built-in routers pass it; routers that leave the replicas,
block, send everything to one replica or pick a replica that is down fail it. Then what each
built-in router promises beyond the contract."""

import collections
import time

import pytest

from prime_core.inference.client import SampleRequest
from prime_core.routers import ConsistentHash, LeastOutstanding
from prime_core.specs import Router
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts.router import RouterContract, check_exclude, check_picks, check_spreads_load


class TestRoundRobin(RouterContract):
    name = "round_robin"
    plugin = "prime_core.builtin"


class TestLeastOutstanding(RouterContract):
    name = "least_outstanding"
    plugin = "prime_core.builtin"


class TestConsistentHash(RouterContract):
    name = "consistent_hash"
    plugin = "prime_core.builtin"


class _Broken:
    def __init__(self, urls, mode):
        self.urls, self.mode = urls, mode

    def pick(self, request, exclude=()):
        if self.mode == "slow":
            time.sleep(0.1)
        return "http://elsewhere/v1" if self.mode == "elsewhere" else self.urls[0]

    def done(self, url, *, ok, latency):
        pass


@pytest.mark.parametrize("mode, check, message", [
    ("elsewhere", check_picks, "not one of"),
    ("slow", check_picks, "must not block"),
    ("first", check_spreads_load, "reached only"),
    ("first", check_exclude, "found down"),
])
def test_broken_routers_fail_the_suite(mode, check, message):
    spec = Router(name="broken", make=lambda urls: _Broken(urls, mode))
    urls = ["http://a/v1", "http://b/v1"]
    with pytest.raises(ContractError, match=message):
        check(spec, urls) if check is check_picks else check(spec)


URLS = [f"http://127.0.0.1:{8000 + i}/v1" for i in range(3)]


def request(session=None):
    return SampleRequest(prompt_ids=[1, 2], max_tokens=2, session_id=session)


def test_consistent_hash_keeps_sessions_and_moves_only_those_of_a_replica_that_is_down():
    router = ConsistentHash(URLS)
    sessions = [f"group-{g}-{i}" for g in range(100) for i in range(4)]
    home = {s: router.pick(request(s)) for s in sessions}
    for s in sessions:
        router.done(home[s], ok=True, latency=0.1)
    assert all(router.pick(request(s)) == home[s] for s in sessions[:50]), "a session stays on its replica"
    spread = collections.Counter(home.values())
    assert set(spread) == set(URLS) and min(spread.values()) > len(sessions) / 6, f"sessions spread: {spread}"
    assert ConsistentHash(list(reversed(URLS))).home(sessions[0]) == home[sessions[0]], "same ring in every process"

    down = frozenset({URLS[1]})
    moved = {s: router.pick(request(s), exclude=down) for s in sessions}
    assert URLS[1] not in moved.values()
    assert all(moved[s] == home[s] for s in sessions if home[s] != URLS[1]), "the others' sessions stay"
    assert len({moved[s] for s in sessions if home[s] == URLS[1]}) == 2, "the orphans spread over the rest"


def test_least_outstanding_fills_the_idle_replica_first():
    a, b = URLS[:2]
    router = LeastOutstanding([a, b])
    assert collections.Counter(router.pick(request()) for _ in range(4)) == {a: 2, b: 2}
    router.done(a, ok=True, latency=0.2)
    router.done(a, ok=False, latency=0.1)
    assert [router.pick(request()) for _ in range(2)] == [a, a], "b still has two in flight"
    for _ in range(5):
        router.done(b, ok=False, latency=0.0)  # more done() than pick(): never below zero
    assert router.outstanding == {a: 2, b: 0}
