"""Contract suite for routers (``prime_core.specs.Router``).

The orchestrator calls ``spec.make(urls)`` once with every replica's URL, then, on its one
event loop, ``pick(request: SampleRequest, exclude) -> url`` before every request (never a URL
in ``exclude``: replicas found down, or already failed for this request) and ``done(url, *,
ok: bool, latency: float)`` exactly once after it, successful or not (``ok=False`` on an
error or a cancelled request). Neither may block. This suite does the same::

    from prime_core.testing.contracts.router import RouterContract

    class TestMine(RouterContract):
        name = "mine"

It checks that ``pick`` answers one of the URLs for every kind of request (with and without a
session, any ``n``), with one replica and with several; that requests keep flowing when
replicas fail (``done(..., ok=False)``) and when many are in flight at once; that picks are
quick (no I/O on the event loop); that excluded replicas are never picked, sessions or not
(the orchestrator's failover); and that over many requests without sessions every replica
gets some (a router that always picks one replica routes nothing).
"""

from __future__ import annotations

import time

from prime_core.testing.contracts import Contract, expect

URLS = [f"http://127.0.0.1:{8000 + i}/v1" for i in range(3)]


def requests(count: int, sessions: bool = False):
    from prime_core.inference.client import SampleRequest

    return [SampleRequest(prompt_ids=[1, 2, 3 + i % 5], max_tokens=4, n=1 + i % 3,
                          session_id=f"session-{i % 4}" if sessions else None) for i in range(count)]


def check_picks(spec, urls: list[str], *, ok: bool = True) -> dict[str, int]:
    """Picks for sequential requests (sessions and not) are known URLs; returns the counts."""
    router = spec.make(list(urls))
    counts = {url: 0 for url in urls}
    for request in requests(60) + requests(60, sessions=True):
        started = time.perf_counter()
        url = router.pick(request)
        expect(time.perf_counter() - started < 0.05, f"router '{spec.name}': pick() took over 50 ms (it runs on "
                                                     "the orchestrator's event loop and must not block)")
        expect(url in urls, f"router '{spec.name}': pick() returned {url!r}, not one of {urls}")
        counts[url] += 1
        router.done(url, ok=ok, latency=0.01)
    return counts


def check_spreads_load(spec) -> None:
    router = spec.make(list(URLS))
    seen = set()
    for request in requests(60):
        url = router.pick(request)
        seen.add(url)
        router.done(url, ok=True, latency=0.01)
    expect(seen == set(URLS), f"router '{spec.name}': 60 requests without a session reached only {sorted(seen)}")


def check_in_flight(spec) -> None:
    """Many picks before any done (the orchestrator keeps many requests in flight)."""
    router = spec.make(list(URLS))
    picked = [router.pick(request) for request in requests(30)]
    expect(all(url in URLS for url in picked), f"router '{spec.name}': an in-flight pick left the replicas")
    for index, url in enumerate(picked):
        router.done(url, ok=index % 5 != 0, latency=0.02 * index)
    expect(router.pick(requests(1)[0]) in URLS, f"router '{spec.name}': no pick after many done()")


def check_exclude(spec) -> None:
    """Replicas in ``exclude`` are never picked; with one replica left, it gets everything."""
    router = spec.make(list(URLS))
    for exclude in ({URLS[1]}, {URLS[0], URLS[2]}):
        for request in requests(30) + requests(30, sessions=True):
            url = router.pick(request, exclude=frozenset(exclude))
            expect(url in URLS and url not in exclude, f"router '{spec.name}': pick(exclude={sorted(exclude)}) "
                                                        f"returned {url!r}, a replica the orchestrator found down")
            router.done(url, ok=True, latency=0.01)


class RouterContract(Contract):
    """Subclass with ``name`` set."""

    registry = "routers"

    def test_one_replica(self, spec):
        check_picks(spec, URLS[:1])

    def test_several_replicas(self, spec):
        check_picks(spec, URLS)

    def test_failures_do_not_stop_the_routing(self, spec):
        check_picks(spec, URLS, ok=False)

    def test_many_in_flight(self, spec):
        check_in_flight(spec)

    def test_requests_without_sessions_reach_every_replica(self, spec):
        check_spreads_load(spec)

    def test_excluded_replicas_are_never_picked(self, spec):
        check_exclude(spec)
