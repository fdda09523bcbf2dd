"""The ``cp`` strategy under the parallel-strategy contract: CP = 2 (ring and ulysses, and ring
with the chunked LM head) on 2 gloo processes with FSDP trains packed rows like one eager
process."""

from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

CUSTOM = {"impl": "custom"}


class TestContextParallel(ParallelStrategyContract):
    name = "cp"
    resume = False  # it changes no parameter: the fsdp suite checks resuming
    cases = [{"name": "cp2_ring", "model": {**CUSTOM, "cp": 2, "cp_style": "ring"}},
             {"name": "cp2_ulysses", "model": {**CUSTOM, "cp": 2, "cp_style": "ulysses"}},
             {"name": "cp2_ring_fused_head", "model": {**CUSTOM, "cp": 2, "cp_style": "ring",
                                                       "fused_lm_head_token_chunk_size": "auto"}}]
