"""The ``ep`` strategy under the parallel-strategy contract: EP = 2 on 2 gloo processes (with
FSDP) trains the tiny Qwen3-MoE like one eager process, publishes whole experts, and its
checkpoint resumes in one process."""

from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract


class TestExpertParallel(ParallelStrategyContract):
    name = "ep"
    experts = 4
    cases = [{"name": "ep2", "model": {"impl": "custom", "ep": 2}}]

    def test_published_experts_are_whole(self, runs):
        import torch

        out, cases = runs
        got = torch.load(out / f"{cases[0]['name']}.pt", weights_only=False)
        assert got["state"]["model.layers.0.mlp.experts.down_proj"].shape[0] == self.experts
