"""Client-side routers: which inference replica each of the orchestrator's requests goes to
(``orchestrator.client.router``; the contract is ``prime_core.specs.Router``).

They live in the core, registered by its built-in plugin like any router plugin, because the
orchestrator's handling of a dying replica (``prime_core.orchestrator.pool``) needs one that
works with no plugin installed, and they are small and depend on nothing. A router that runs
as its own process in front of the replicas (``vllm-router``) is a plugin that starts that
process; the orchestrator then sends every request to its one URL.

- ``round_robin``: each request to the next replica in turn.
- ``least_outstanding``: each request to the replica with the fewest requests in flight.
- ``consistent_hash``: every request of one session (``SampleRequest.session_id``: the turns
  of one rollout) to the same replica, chosen on a hash ring, so that each turn finds its
  prefix in that replica's cache; when that replica is down, the next one on the ring takes
  the session (the sessions of the other replicas stay where they are). Requests without a
  session go to the least loaded replica.

Every router skips the replicas in ``exclude``: those the orchestrator found down, and those a
request already failed on (it is retried on another replica).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Collection


class RoundRobin:
    """Sends each request to the next replica in turn (outcomes do not change the order)."""

    def __init__(self, urls) -> None:
        self.urls = list(urls)
        self._next = 0

    def pick(self, request=None, exclude: Collection[str] = ()) -> str:
        for _ in range(len(self.urls)):
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            if url not in exclude:
                return url
        return self.urls[0]  # every replica excluded: the orchestrator never asks that

    def done(self, url: str, *, ok: bool = True, latency: float = 0.0) -> None:
        pass


class LeastOutstanding:
    """Sends each request to the replica with the fewest requests in flight (between ``pick``
    and ``done``); ties go to the replicas in turn, so that idle replicas share the work."""

    def __init__(self, urls) -> None:
        self.urls = list(urls)
        self.outstanding = dict.fromkeys(self.urls, 0)
        self._turn = 0

    def pick(self, request=None, exclude: Collection[str] = ()) -> str:
        candidates = [url for url in self.urls if url not in exclude] or self.urls
        start = self._turn % len(candidates)
        self._turn += 1
        url = min(candidates[start:] + candidates[:start], key=self.outstanding.__getitem__)
        self.outstanding[url] += 1
        return url

    def done(self, url: str, *, ok: bool = True, latency: float = 0.0) -> None:
        if self.outstanding.get(url, 0) > 0:
            self.outstanding[url] -= 1


def _hash(text: str) -> int:
    # Stable across processes and runs (Python's hash() of a str is salted per process).
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """Keeps every request of one session on one replica (a hash ring of ``POINTS`` points per
    replica); requests without a session go to the least loaded replica."""

    POINTS = 64

    def __init__(self, urls) -> None:
        self.urls = list(urls)
        self.load = LeastOutstanding(self.urls)  # counts every request in flight, sessions or not
        ring = sorted((_hash(f"{url}#{i}"), url) for url in dict.fromkeys(self.urls) for i in range(self.POINTS))
        self._points = [point for point, _ in ring]
        self._owners = [url for _, url in ring]

    def home(self, session: str, exclude: Collection[str] = ()) -> str:
        """The replica of ``session``: the first one on the ring at or after its hash that is
        not excluded."""
        start = bisect.bisect_left(self._points, _hash(session))
        for i in range(len(self._owners)):
            url = self._owners[(start + i) % len(self._owners)]
            if url not in exclude:
                return url
        return self._owners[start % len(self._owners)]

    def pick(self, request=None, exclude: Collection[str] = ()) -> str:
        session = getattr(request, "session_id", None)
        if not session:
            return self.load.pick(request, exclude)
        url = self.home(session, exclude)
        self.load.outstanding[url] += 1
        return url

    def done(self, url: str, *, ok: bool = True, latency: float = 0.0) -> None:
        self.load.done(url, ok=ok, latency=latency)
