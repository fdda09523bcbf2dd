"""The ``ep`` strategy under the parallel-strategy contract: EP = 2 on 4 gloo processes (two EP
groups, with FSDP) trains the tiny Qwen3-MoE like one eager process, holds each expert
parameter sharded over both the EP group and ``dp_mod_ep`` (a quarter of the experts and of
their optimizer state per rank), publishes whole experts, and its checkpoint resumes in one
process."""

from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract


class TestExpertParallel(ParallelStrategyContract):
    name = "ep"
    experts = 4
    processes = 4
    cases = [{"name": "ep2_dp2", "model": {"impl": "custom", "ep": 2}}]

    def test_published_experts_are_whole(self, runs):
        import torch

        out, cases = runs
        got = torch.load(out / f"{cases[0]['name']}.pt", weights_only=False)
        assert got["state"]["model.layers.0.mlp.experts.down_proj"].shape[0] == self.experts

    def test_experts_are_sharded_over_dp_mod_ep(self, runs):
        import math

        import torch

        out, cases = runs
        layout = torch.load(out / f"{cases[0]['name']}.pt", weights_only=False)["layout"]
        for name in ("gate_up_proj", "down_proj"):
            held = layout[f"model.layers.0.mlp.experts.{name}"]
            assert held["mesh"] == ["dp_mod_ep", "ep"], held
            assert math.prod(held["local_shape"]) * self.processes == math.prod(held["shape"]), held
            assert held["optim_local"] == 2 * math.prod(held["local_shape"]), held  # AdamW's two moments
