"""Native models under FSDP alone and under expert and context parallelism combined (each
strategy alone runs its plugin's contract suite), match one eager process over several
optimizer steps (gloo; 2 and 4 processes), on packed rows of uneven samples. Tolerances:
losses within 1e-4 relative + 2e-5 absolute, final weights within 2e-5 absolute (float32).

Each case builds the model through the core's build order, trains ``parity.STEPS`` AdamW
steps on the same variable-length packed batches and publishes its full weights (experts
gathered across EP ranks); the reference is the same native model in
one process with no strategies. With EP = 2 on 4 processes the experts are sharded over
``dp_mod_ep`` too (a quarter per rank).
"""

import math

import pytest

from prime_core.parity import TINY, compare, run

CUSTOM = {"impl": "custom"}
DENSE_TWO = [{"name": "custom_fsdp", "model": CUSTOM}]
FOUR = [
    {"name": "ep2_cp2_ring", "model": {**CUSTOM, "ep": 2, "cp": 2, "cp_style": "ring"}},
    {"name": "ep4_ulysses2", "model": {**CUSTOM, "ep": 4, "cp": 2, "cp_style": "ulysses"}},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from prime_plugin_hf.tiny import build_tiny

    root = tmp_path_factory.mktemp("models")
    return {"dense": build_tiny(root / "dense", **TINY),
            "moe": build_tiny(root / "moe", **TINY, num_experts=4, experts_per_token=2)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    dense, moe = tmp_path_factory.mktemp("dense"), tmp_path_factory.mktemp("moe")
    run(models["dense"], dense, DENSE_TWO, reference=True)
    run(models["dense"], dense, DENSE_TWO, processes=2)
    run(models["moe"], moe, FOUR, reference=True)
    run(models["moe"], moe, FOUR, processes=4)
    return {**{c["name"]: dense for c in DENSE_TWO}, **{c["name"]: moe for c in FOUR}}


@pytest.mark.parametrize("case", DENSE_TWO + FOUR, ids=lambda c: c["name"])
def test_matches_a_single_process(results, case):
    import torch

    out = results[case["name"]]
    worst = compare(out / f"{case['name']}.reference.pt", out / f"{case['name']}.pt")
    got = torch.load(out / f"{case['name']}.pt", weights_only=False)
    expected = (["fp8"] if case["model"].get("quantization") else []) + [
        k for k in ("ep", "cp") if case["model"].get(k, 1) > 1] + ["fsdp"]
    assert [name for name in got["applied"] if name in ("fp8", "ep", "cp", "fsdp")] == expected
    assert worst["weight"] < 2e-5
    if "ep" in expected:  # the published experts are whole again, gathered from the EP ranks
        assert got["state"]["model.layers.0.mlp.experts.down_proj"].shape[0] == 4
        # ... and each rank held a quarter: the EP group's share, split over dp_mod_ep too
        held = got["layout"]["model.layers.0.mlp.experts.down_proj"]
        assert held["mesh"] == ["dp_mod_ep", "ep"] and math.prod(held["local_shape"]) * 4 == math.prod(held["shape"])


def test_a_rank_killed_by_a_signal_is_told_from_one_that_exited():
    from prime_core.parity import killed_by_signal

    segfault = ("E1129 02:48:30.059000 19579 .../api.py:1002] failed (exitcode: -11) local_rank: 2 "
                "(pid: 19584) of binary: /check/.venv/bin/python")
    assert killed_by_signal(segfault) == 11
    assert killed_by_signal(segfault.replace("-11", "1")) is None
    assert killed_by_signal("") is None


def test_a_run_in_one_process_leaves_the_caller_as_it_found_it(models, tmp_path):
    """One process trains in the caller's (``parity.run_here``): FSDP's one-process group is torn
    down after it and the caller's random state is what it was."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(123)
    state = torch.get_rng_state()
    run(models["dense"], tmp_path, [{"name": "fsdp_one", "model": {"dtype": "bfloat16", "reshard_after_forward": True},
                                     "steps": 1}])
    assert "fsdp" in torch.load(tmp_path / "fsdp_one.pt", weights_only=False)["applied"]
    assert not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), state)


def test_a_case_may_train_with_sft_s_loss(models, tmp_path):
    """``"loss": "sft"`` (the GPU tests of kernels that serve SFT only, such as liger's LM head):
    the first step's loss is the negative log-likelihood per loss token of the batch under the
    untrained model, computed here sample by sample with transformers; the RL loss is not."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_core.parity import batch_for

    run(models["dense"], tmp_path, [{"name": "sft", "loss": "sft", "steps": 1}, {"name": "rl", "steps": 1}])
    sft, rl = (torch.load(tmp_path / f"{name}.pt", weights_only=False)["losses"][0] for name in ("sft", "rl"))
    model = AutoModelForCausalLM.from_pretrained(models["dense"], torch_dtype=torch.float64)
    total, tokens = 0.0, 0.0
    for row in batch_for(1, model.config.vocab_size)["micro_batches"]:
        ids, mask = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"], dtype=torch.float64)
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            with torch.no_grad():
                logp = model(input_ids=ids[a:b][None]).logits[0].log_softmax(-1)
            nll = -logp[:-1].gather(-1, ids[a + 1:b, None])[:, 0]
            total += float((nll * mask[a + 1:b]).sum())
            tokens += float(mask[a + 1:b].sum())
    assert abs(sft - total / tokens) <= 1e-5 * abs(sft), (sft, total / tokens)
    assert abs(rl - sft) > 0.1 * abs(sft), (rl, sft)
