"""``prime_core.orchestrator.coalesce``: a group's identical first requests go as one request
with ``n`` = their count, each rollout getting its own sample; anything else goes as it is.
The orchestrator's groups against real vLLM are in ``test_rl_e2e.py`` and
``test_agentic_e2e.py``; its request counts in ``test_orchestrator_client.py``."""

from __future__ import annotations

import asyncio
import itertools

from prime_core.inference.client import Sample, SampleRequest
from prime_core.orchestrator.coalesce import Coalescer
from prime_core.orchestrator.env import Task
from prime_core.orchestrator.episode import Episode, Limits, run_episode
from prime_core.orchestrator.hermes import parse
from prime_core.testing.chat import chat_tokenizer


class Server:
    """Numbered samples, one request at a time recorded."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.requests: list[SampleRequest] = []
        self.fail = fail
        self.counter = itertools.count()

    async def __call__(self, request: SampleRequest) -> list[Sample]:
        self.requests.append(request)
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise self.fail
        return [Sample(token_ids=[next(self.counter)], logprobs=[-1.0], finish_reason="length", text="x")
                for _ in range(request.n)]


def request(prompt=(1, 2, 3), **changes) -> SampleRequest:
    return SampleRequest(prompt_ids=list(prompt), max_tokens=4, session_id="group-1", **changes)


def test_identical_requests_made_together_go_as_one_with_n_and_each_gets_its_own_sample():
    server = Server()
    shared = Coalescer(server)

    async def main():
        return await asyncio.gather(*(shared.sample(request()) for _ in range(8)))

    answers = asyncio.run(main())
    assert [r.n for r in server.requests] == [8]
    assert sorted(a[0].token_ids[0] for a in answers) == list(range(8)), "every rollout its own sample"
    assert all(len(a) == 1 for a in answers)


def test_requests_that_differ_or_come_later_go_as_they_are():
    server = Server()
    shared = Coalescer(server)

    async def main():
        await asyncio.gather(shared.sample(request()), shared.sample(request(prompt=(1, 2))),
                             shared.sample(request(seed=3)), shared.sample(request(temperature=0.5)),
                             shared.sample(request(n=2)))
        await shared.sample(request())  # after the others: alone
        await asyncio.gather(shared.sample(request()), shared.sample(request()))

    asyncio.run(main())
    assert sorted(r.n for r in server.requests) == [1, 1, 1, 1, 1, 2, 2]


def test_a_failed_request_fails_every_rollout_that_rode_on_it():
    server = Server(fail=RuntimeError("server down"))
    shared = Coalescer(server)

    async def main():
        return await asyncio.gather(*(shared.sample(request()) for _ in range(3)), return_exceptions=True)

    answers = asyncio.run(main())
    assert len(server.requests) == 1
    assert all(isinstance(a, RuntimeError) and str(a) == "server down" for a in answers), answers


def test_a_group_of_episodes_makes_one_first_request_and_later_turns_of_their_own():
    """Rollouts of a two-turn environment: the first turn shared, the second (after each
    rollout's own answer) one request each; every trajectory trains on exactly its samples."""
    tokenizer = chat_tokenizer()
    counter = itertools.count()
    requests, delivered = [], []

    async def server(request):
        requests.append(request)
        out = []
        for _ in range(request.n):
            ids = [*tokenizer.encode(f"answer {next(counter)}", add_special_tokens=False), tokenizer.eos_token_id]
            out.append(Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                              text=tokenizer.decode(ids, skip_special_tokens=True)))
        delivered.extend(out)
        return out

    shared = Coalescer(server)
    task = Task(prompt=[{"role": "user", "content": "hi"}], answer="")

    class TwoTurns:
        def respond(self, task, messages, state):
            return {"role": "user", "content": "again"}

        def score(self, task, completion):
            return 0.0

    async def main():
        episodes = [Episode(task=task, sampler=shared.sample, tokenizer=tokenizer, parse=parse,
                            limits=Limits(max_turns=2, max_tokens=256), session_id="group-1") for _ in range(4)]
        return await asyncio.gather(*(run_episode(TwoTurns(), task, e) for e in episodes))

    outcomes = asyncio.run(main())
    assert [r.n for r in requests] == [4, 1, 1, 1, 1]
    trained = []
    for outcome in outcomes:
        [sample] = outcome.episode.trajectory.samples(advantage=0.0, reward=0.0, version=0, env="e")
        mine = [t for t, m in zip(sample.completion_ids, sample.mask, strict=True) if m]
        texts = [m["content"] for m in outcome.episode.messages if m["role"] == "assistant"]
        got = [s for s in delivered if s.text in texts]
        assert len(got) == 2 and mine == got[0].token_ids + got[1].token_ids, (texts, mine)
        trained += texts
    assert sorted(trained) == sorted(s.text for s in delivered), "every sample went to one rollout"


def test_a_cancelled_leader_cancels_its_riders():
    async def slow(request):
        await asyncio.sleep(10)

    shared = Coalescer(slow)

    async def main():
        tasks = [asyncio.ensure_future(shared.sample(request())) for _ in range(3)]
        await asyncio.sleep(0.05)
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(main())
    assert all(isinstance(a, asyncio.CancelledError) for a in answers), answers
