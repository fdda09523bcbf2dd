"""GPU paths that CPU tests cannot reach: pinned optimizer-state offload, activation offload
on a side stream, the chunked log-probabilities on bf16 logits, and FSDP with NCCL against a
single eager process, expert and context parallelism with NCCL. Marked ``gpu``: skipped (with
the reason) where there is no CUDA device."""

import pytest

pytestmark = pytest.mark.gpu


def _model(device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return Qwen3ForCausalLM(config).to(device)


def test_optimizer_state_offload_matches_and_lives_in_pinned_memory():
    import torch

    from prime_core.trainer.config import OptimConfig
    from prime_core.trainer.optim import build_optimizer

    plain, offloaded = _model("cuda"), _model("cuda")
    opts = [build_optimizer(plain, OptimConfig(lr=1e-3)),
            build_optimizer(offloaded, OptimConfig(lr=1e-3), cpu_offload=True)]
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    for _ in range(3):
        for model, opt in zip((plain, offloaded), opts, strict=True):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    state = next(iter(opts[1].state.values()))
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()


def test_sharded_optimizer_state_stays_off_the_gpu_between_steps(tmp_path):
    """With FSDP (DTensor state) the offloaded state frees its GPU memory, and a checkpoint
    taken while it is offloaded restores the same training."""
    import torch

    from prime_core import distributed
    from prime_core.config.checks import section_model
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer import ckpt
    from prime_core.trainer.build import build_policy
    from prime_core.trainer.config import OptimConfig
    from prime_core.trainer.optim import build_optimizer

    _model("cpu").save_pretrained(tmp_path / "m")
    world = distributed.World(device=torch.device("cuda", torch.cuda.current_device()))
    try:
        config = section_model("trainer", "model")(name=str(tmp_path / "m"), impl="hf", dtype="float32")
        policy = build_policy(config, get_plugin_manager(), world)
        optimizer = build_optimizer(policy.model, OptimConfig(lr=1e-3), cpu_offload=True)
        ids = torch.randint(0, 1000, (1, 64), device="cuda")
        policy.model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        state = next(iter(optimizer.state.values()))
        assert state["exp_avg"].device.type == "cpu" and not hasattr(state["exp_avg"], "to_local")
        allocated = torch.cuda.memory_allocated()
        ckpt.save(tmp_path, 1, policy.model, optimizer, {}, world=world)
        assert torch.cuda.memory_allocated() <= allocated + 1024
        assert next(iter(optimizer.state.values()))["exp_avg"].device.type == "cpu"
        ckpt.load(tmp_path / "checkpoints" / "step_1", policy.model, optimizer)
        assert next(iter(optimizer.state.values()))["exp_avg"].device.type == "cpu"
        policy.model(ids, labels=ids).loss.backward()
        optimizer.step()  # the state comes back as sharded tensors for the update
    finally:
        distributed.shutdown()


def test_activation_offloading_copies_to_pinned_memory_and_keeps_gradients():
    import torch

    from prime_core.config.checks import section_model
    from prime_plugin_ac import offloading

    ids = torch.randint(0, 1000, (1, 2048), device="cuda")
    plain = _model("cuda")
    plain(ids, labels=ids).loss.backward()
    config = section_model("trainer", "model")(ac_offloading={"max_inflight_activations": 2})
    model = offloading.apply(_model("cuda"), config=config)
    offloader = model.model.layers[0]._offloader
    packed = []
    pack = offloader.pack
    offloader.pack = lambda t: packed.append(pack(t)) or packed[-1]
    model(ids, labels=ids).loss.backward()
    moved = [p for p in packed if isinstance(p, offloading._Offloaded)]
    assert moved and all(p.host.is_pinned() and p.event is not None for p in moved)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), name


def test_chunked_logprobs_on_bf16_logits():
    import torch

    from prime_core.trainer.model import token_logprob_fn

    torch.manual_seed(0)
    logits = (3 * torch.randn(5000, 32000, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, 32000, (5000,), device="cuda")
    logp, entropy = token_logprob_fn()(logits, targets, 1.0, True)
    logp.sum().backward()
    x = logits.detach().double().requires_grad_()
    reference = x.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    reference.sum().backward()
    assert torch.allclose(logp.double(), reference, atol=1e-3)
    relative = (logits.grad.double() - x.grad).norm() / x.grad.norm()
    assert relative < 1e-2  # bf16 gradients


def test_fsdp_with_nccl_matches_one_eager_process(tmp_path):
    import torch

    from prime_core.parity import TINY, check
    from prime_plugin_hf.tiny import build_tiny

    cases = [{"name": "fsdp", "model": {"impl": "hf"}},
             {"name": "ac_offload", "model": {"impl": "hf", "ac": {}, "ac_offloading": {}}},
             {"name": "optim_offload", "model": {"impl": "hf", "optim_cpu_offload": True}}]
    processes = min(2, torch.cuda.device_count())
    results = check(build_tiny(tmp_path / "tiny", **TINY), tmp_path / "out", cases, processes=processes,
                    rtol=1e-3, atol=1e-4)
    # One float32 process runs without FSDP (nothing for it to do there); two always use it.
    assert all(("fsdp" in r["applied"]) == (processes > 1) for r in results.values())


def _devices(n: int) -> int:
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs ({torch.cuda.device_count()} visible)")
    return n


@pytest.mark.parametrize("processes", [2, 4])
def test_expert_and_context_parallel_with_nccl_match_one_eager_process(tmp_path, processes):
    """EP, ring and ulysses CP (and EP × CP on 4 GPUs), each with FSDP, on NCCL."""
    from prime_core.parity import TINY, check
    from prime_plugin_hf.tiny import build_tiny

    _devices(processes)
    custom = {"impl": "custom"}
    if processes == 2:
        cases = [{"name": "ep2", "model": {**custom, "ep": 2}},
                 {"name": "cp2_ring", "model": {**custom, "cp": 2, "cp_style": "ring"}},
                 {"name": "cp2_ulysses", "model": {**custom, "cp": 2, "cp_style": "ulysses"}}]
    else:
        cases = [{"name": "ep4", "model": {**custom, "ep": 4}},
                 {"name": "ep2_dp2", "model": {**custom, "ep": 2}},  # experts sharded over dp_mod_ep too
                 {"name": "ep2_cp2_ring", "model": {**custom, "ep": 2, "cp": 2, "cp_style": "ring"}},
                 {"name": "ep2_cp2_ulysses", "model": {**custom, "ep": 2, "cp": 2, "cp_style": "ulysses"}}]
    model = build_tiny(tmp_path / "moe", **TINY, num_experts=4, experts_per_token=2)
    results = check(model, tmp_path / "out", cases, processes=processes, rtol=1e-3, atol=1e-4)
    for case in cases:
        assert "fsdp" in results[case["name"]]["applied"]
        if case["model"].get("ep", 1) > 1:  # each rank holds 1/processes of every expert parameter
            held = results[case["name"]]["layout"]["model.layers.0.mlp.experts.down_proj"]
            assert held["mesh"] == ["dp_mod_ep", "ep"] and held["local_shape"][0] * processes == held["shape"][0], held


def test_fast_defaults_on_a_gpu(tmp_path, capsys):
    """With no performance key set, a bf16 run of the native model on a GPU gets the fastest
    attention kernel installed, the chunked LM head and compiled blocks, says so first, and computes what the
    reference paths compute (bf16 rounding apart)."""
    import torch

    from prime_core import distributed
    from prime_core.config.checks import section_model
    from prime_core.parity import TINY
    from prime_core.plugins import get_plugin_manager
    from prime_core.trainer.build import build_policy
    from prime_core.trainer.model import predicted_logprobs
    from prime_plugin_hf.tiny import build_tiny

    folder = build_tiny(tmp_path / "tiny", **TINY)
    world = distributed.World(device=torch.device("cuda", torch.cuda.current_device()))
    pinned = {"attn": "sdpa", "compile": False, "fused_lm_head_token_chunk_size": "disabled"}
    ids = torch.randint(0, 250, (1, 96), device="cuda")
    positions = torch.cat([torch.arange(60), torch.arange(36)])[None].cuda()  # a packed row
    results = {}
    try:
        for name, keys in (("fast", {}), ("reference", pinned)):
            config = section_model("trainer", "model")(name=str(folder), dtype="bfloat16",
                                                       optimization_dtype="bfloat16", **keys)
            policy = build_policy(config, get_plugin_manager(), world)
            results[name] = (policy, predicted_logprobs(policy.model, ids, positions, torch.roll(ids[0], -1))[0])
    finally:
        distributed.shutdown()
    fast, reference = results["fast"], results["reference"]
    assert {"fused_lm_head", "compile"} <= set(fast[0].applied) and not {"fused_lm_head", "compile"} & set(
        reference[0].applied)
    from prime_plugin_flash_attn.plugin import FA4_HEAD_DIMS, flash_attention_4_unavailable

    fa4 = flash_attention_4_unavailable() is None and TINY.get("head_dim") in FA4_HEAD_DIMS
    picked = "flash_attention_4" if fa4 else "torch_fused"  # where flash-attn-4 is installed, it leads
    assert fast[0].model.model.layers[0].self_attn.attention_fn.__name__ == picked
    assert f"attn = '{picked}'" in capsys.readouterr().out.splitlines()[0]
    assert torch.allclose(fast[1].float(), reference[1].float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("packed", [False, True], ids=["one-sample", "packed"])
def test_checkpointed_blocks_stay_compiled_on_a_gpu(tmp_path, packed):
    """With AC on every block and the fast defaults (compiled blocks, torch_fused attention: cuDNN
    for a row of one sample, flash varlen outside graphs for a packed row), no norm of a block
    runs its Python at run time, forward or recomputation: only the final norm does."""
    import torch

    from prime_core import distributed
    from prime_core.config.checks import section_model
    from prime_core.parity import TINY
    from prime_core.plugins import get_plugin_manager
    from prime_core.testing.compiled import python_calls
    from prime_core.trainer.build import build_policy
    from prime_core.trainer.model import predicted_logprobs
    from prime_plugin_custom.layers import RMSNorm
    from prime_plugin_hf.tiny import build_tiny

    folder = build_tiny(tmp_path / "tiny", **TINY)
    world = distributed.World(device=torch.device("cuda", torch.cuda.current_device()))
    ids = torch.randint(0, 250, (1, 96), device="cuda")
    positions = (torch.cat([torch.arange(60), torch.arange(36)]) if packed else torch.arange(96))[None].cuda()
    try:
        config = section_model("trainer", "model")(name=str(folder), dtype="bfloat16", ac={"freq": 1})
        policy = build_policy(config, get_plugin_manager(), world)
        assert {"ac", "compile"} <= set(policy.applied)

        def step():
            logprobs, entropy = predicted_logprobs(policy.model, ids, positions, torch.roll(ids[0], -1))
            (logprobs.sum() + entropy.sum()).backward()

        step()  # compiles
        norms = python_calls(RMSNorm.forward, step)
    finally:
        distributed.shutdown()
    assert len(norms) == 1, norms
