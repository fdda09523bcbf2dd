"""The router contract suite: the built-in round_robin passes it; routers that leave the
replicas, block, or send everything to one replica fail it."""

import time

import pytest

from prime_core.specs import Router
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts.router import RouterContract, check_picks, check_spreads_load


class TestRoundRobin(RouterContract):
    name = "round_robin"
    plugin = "prime_core.builtin"


class _Broken:
    def __init__(self, urls, mode):
        self.urls, self.mode = urls, mode

    def pick(self, request):
        if self.mode == "slow":
            time.sleep(0.1)
        return "http://elsewhere/v1" if self.mode == "elsewhere" else self.urls[0]

    def done(self, url, *, ok, latency):
        pass


@pytest.mark.parametrize("mode, check, message", [
    ("elsewhere", check_picks, "not one of"),
    ("slow", check_picks, "must not block"),
    ("first", check_spreads_load, "reached only"),
])
def test_broken_routers_fail_the_suite(mode, check, message):
    spec = Router(name="broken", make=lambda urls: _Broken(urls, mode))
    urls = ["http://a/v1", "http://b/v1"]
    with pytest.raises(ContractError, match=message):
        check(spec, urls) if check is check_picks else check(spec)

