"""prime-plugin-ac: full and selective checkpointing, the MLP in token chunks and activation
offloading change memory, not numbers: 2 gloo processes with FSDP match a single eager process
over several steps (the parallel-strategy contract suite)."""

import pytest

import prime_plugin_ac.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

HF = {"impl": "hf"}


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


class TestCheckpointing(ParallelStrategyContract):
    name = "ac"
    resume = False  # wrappers change no parameter: the fsdp suite checks resuming
    cases = [
        {"name": "ac_full", "model": {**HF, "ac": {"freq": 1}}},
        {"name": "ac_every_other", "model": {**HF, "ac": {"freq": 2}}},
        {"name": "ac_selective",
         "model": {**HF, "ac": {"mode": "selective", "targets": ["norm", "attn_proj", "mlp_proj"]}}},
        {"name": "ac_offloading", "model": {**HF, "ac": {"freq": 1}, "ac_offloading": {"max_inflight_activations": 1}}},
        {"name": "ac_mlp_chunks", "model": {"impl": "custom", "ac": {"freq": 1, "mlp_token_chunk_size": 5}}},
    ]


class TestActivationOffloading(ParallelStrategyContract):
    name = "ac_offloading"
    resume = False
    cases = [{"name": "offloading_alone", "model": {**HF, "ac_offloading": {"max_inflight_activations": 5}}}]


def _model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return Qwen3ForCausalLM(config)


def test_wrappers_sit_where_the_config_says():
    from prime_core.config.checks import section_model
    from prime_plugin_ac import checkpointing, offloading

    model = checkpointing.apply(_model(), config=section_model("trainer", "model")(ac={"freq": 2}))
    kinds = [type(b).__name__ for b in model.model.layers]
    assert kinds == ["CheckpointWrapper", "Qwen3DecoderLayer", "CheckpointWrapper"]

    config = section_model("trainer", "model")(ac={"mode": "selective", "targets": ["norm"]})
    model = checkpointing.apply(_model(), config=config)
    layer = model.model.layers[0]
    assert type(layer.input_layernorm).__name__ == "CheckpointWrapper"
    assert type(layer.self_attn.q_norm).__name__ == "CheckpointWrapper"
    assert type(layer.self_attn.q_proj).__name__ == "Linear"

    model = offloading.apply(_model(), config=section_model("trainer", "model")(ac_offloading={}))
    assert {type(b).__name__ for b in model.model.layers} == {"OffloadedBlock"}


def test_offloading_moves_saved_tensors_out_and_back():
    """The saved activations go through the offloader and gradients are unchanged."""
    import torch

    from prime_core.config.checks import section_model
    from prime_plugin_ac import offloading

    ids = torch.tensor([[1, 5, 7, 9, 3, 2]])
    plain = _model()
    plain(ids, labels=ids).loss.backward()
    config = section_model("trainer", "model")(ac_offloading={"max_inflight_activations": 1})
    model = offloading.apply(_model(), config=config)
    offloader = model.model.layers[0]._offloader
    packed = []
    pack = offloader.pack
    offloader.pack = lambda t: packed.append(pack(t)) or packed[-1]
    model(ids, labels=ids).loss.backward()
    assert sum(isinstance(p, offloading._Offloaded) for p in packed) > 10
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_offloading_only_the_first_blocks():
    """``blocks = 2``: the first two blocks offload (the wrapper, and what the plan puts in host
    memory), the third keeps its saved tensors on the GPU; the gradients are unchanged."""
    import torch

    from prime_core.config.checks import section_model
    from prime_core.memory import BlockMemory, decoder_block_profile
    from prime_plugin_ac import memory as ac_memory
    from prime_plugin_ac import offloading

    ids = torch.tensor([[1, 5, 7, 9, 3, 2]])
    plain = _model()
    plain(ids, labels=ids).loss.backward()
    config = section_model("trainer", "model")(ac={"freq": 1}, ac_offloading={"blocks": 2})
    model = offloading.apply(_model(), config=config)
    assert [type(b).__name__ for b in model.model.layers] == ["OffloadedBlock", "OffloadedBlock", "Qwen3DecoderLayer"]
    model(ids, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name

    profile = decoder_block_profile(_model().config, 2, o_proj_copy=False)
    buffers = {}
    est = type("Est", (), {"rules": [], "tokens": 100, "blocks": [profile] * 3,
                           "add_buffer": lambda self, name, size, phases: buffers.update({name: size})})()
    ac_memory.offloading(est, config)
    blocks = [BlockMemory(i, profile, {}, gpu=profile.input, transient=0.0) for i in range(3)]
    for block in blocks:
        est.rules[0](block)
    assert [b.gpu for b in blocks] == [0.0, 0.0, profile.input]
    assert [b.cpu for b in blocks] == [profile.input, profile.input, 0.0]
    assert buffers == {"ac_offloading: copies in flight": 2 * profile.input * 100}


def test_selective_targets_that_match_nothing_are_an_error():
    import torch

    from prime_plugin_ac.checkpointing import wrap_selected

    with pytest.raises(ValueError, match="nothing in Sequential matches"):
        wrap_selected(torch.nn.Sequential(torch.nn.ReLU()), ["attn_proj"])


def _same_gradients(plain, model, tolerance: float = 1e-6) -> None:
    import torch

    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=tolerance, rtol=max(tolerance, 1e-5)), name


def _chunked(ac: dict):
    from prime_core.config.checks import section_model
    from prime_plugin_ac import checkpointing

    return checkpointing.apply(_model(), config=section_model("trainer", "model")(ac=ac))


@pytest.mark.parametrize("ac", [{"freq": 1, "mlp_token_chunk_size": 4},
                                {"mode": "selective", "targets": ["norm", "mlp"], "mlp_token_chunk_size": 3},
                                {"mode": "selective", "targets": ["mlp_proj"], "mlp_token_chunk_size": 100}],
                         ids=["full", "selective", "one-chunk"])
def test_mlp_chunks_give_the_gradients_of_the_whole_mlp(ac):
    import torch

    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    plain = _model()
    plain(ids, labels=ids).loss.backward()
    model = _chunked(ac)
    layer = model.model.layers[0]
    mlp = (layer._checkpoint_wrapped_module if ac.get("mode", "full") == "full" else layer).mlp
    assert type(mlp).__name__ == "TokenChunkedMLP"
    assert type(mlp._checkpoint_wrapped_module).__name__ == "Qwen3MLP"  # its projections not wrapped again
    model(ids, labels=ids).loss.backward()
    _same_gradients(plain, model)


def test_compiled_blocks_run_the_chunks_outside_their_graphs():
    """The chunk loop stays out of graphs: a checkpointed block with chunks is compiled inside
    its checkpoint, so all of it but the chunks is still compiled."""
    import torch

    ids = torch.randint(0, 50, (1, 13), generator=torch.Generator().manual_seed(2))
    plain = _model()
    plain(ids, labels=ids).loss.backward()
    model = _chunked({"freq": 1, "mlp_token_chunk_size": 4})
    graphs = []

    def backend(graph, inputs):
        graphs.append(sum(node.op == "call_function" for node in graph.graph.nodes))
        return torch._dynamo.backends.debugging.aot_eager(graph, inputs)

    torch._dynamo.reset()
    for block in model.model.layers:
        block.compile(backend=backend)
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert graphs and max(graphs) > 20  # the attention half of the block, traced
    _same_gradients(plain, model)


@pytest.mark.parametrize("offloaded", [False, True], ids=["checkpointed", "checkpointed-and-offloaded"])
def test_a_graph_break_in_a_checkpointed_block_leaves_the_rest_compiled(offloaded):
    """A packed row's varlen attention stays out of graphs (``torch.compiler.disable``). Traced
    as one checkpoint, such a block would run eagerly, forward and recomputation; compiled
    inside its checkpoint (and inside the offloading hooks), only the attention kernel does: no
    norm of a block runs its Python. The native model reads its blocks' parts through both wrappers."""
    import torch

    from prime_core.config.checks import section_model
    from prime_core.testing.compiled import python_calls
    from prime_plugin_ac import checkpointing, offloading
    from prime_plugin_custom.layers import RMSNorm, sdpa_attention
    from prime_plugin_custom.model import CausalLM
    from prime_plugin_custom.tiny import tiny_config

    def build():
        torch.manual_seed(0)
        return CausalLM(tiny_config("Qwen3ForCausalLM"))

    plain, model = build(), build()
    outside = torch.compiler.disable(sdpa_attention)
    for module in model.modules():
        if type(module).__name__ == "Attention":
            module.attention_fn = outside
    config = section_model("trainer", "model")(ac={"freq": 1}, ac_offloading={"max_inflight_activations": 1})
    checkpointing.apply(model, config=config)
    if offloaded:
        offloading.apply(model, config=config)
        assert type(model.model.layers[0]).__name__ == "OffloadedBlock"
    torch._dynamo.reset()
    for block in model.model.layers:
        block.compile(backend="aot_eager")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(15), torch.arange(9)])[None]  # two samples
    model(ids, positions).logits.sum().backward()  # compiles
    model.zero_grad()
    norms = python_calls(RMSNorm.forward, lambda: model(ids, positions).logits.sum().backward())
    assert len(norms) == 1, norms  # the final norm, outside the blocks
    plain(ids, positions).logits.sum().backward()
    _same_gradients(plain, model, tolerance=1e-4)


def test_each_chunk_is_recomputed_and_differentiated_before_the_next():
    """What bounds the memory: in the backward pass a chunk's MLP is recomputed, then its
    gradients taken, before any other chunk is recomputed."""
    import torch

    model = _chunked({"mode": "selective", "targets": ["norm"], "mlp_token_chunk_size": 4})
    events = []
    mlp = model.model.layers[1].mlp._checkpoint_wrapped_module
    # (a pre-hook: a recomputation stops once it has what the backward needs, before the forward's end)
    mlp.register_forward_pre_hook(lambda module, args: events.append(("forward", args[0].shape[0])))
    mlp.register_full_backward_hook(lambda module, grad_in, grad_out: events.append(("backward", grad_out[0].shape[0])))
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(3))
    events.clear()
    model(ids, labels=ids).loss.backward()
    assert events[:3] == [("forward", 4), ("forward", 4), ("forward", 2)]
    assert events[3:] == [("forward", 2), ("backward", 2), ("forward", 4), ("backward", 4),
                          ("forward", 4), ("backward", 4)]


def test_mlp_chunks_without_a_dense_mlp_are_refused():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from prime_core.config.checks import section_model
    from prime_core.errors import ConfigError
    from prime_plugin_ac import checkpointing

    config = Qwen3MoeConfig(vocab_size=50, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                            num_experts_per_tok=2)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    with pytest.raises(ConfigError, match="mlp_token_chunk_size = 8: no checkpointed block"):
        checkpointing.apply(model, config=section_model("trainer", "model")(ac={"mlp_token_chunk_size": 8}))


def test_the_plan_counts_one_chunk_of_the_mlp():
    """``prime plan``: with the MLP in chunks a block's backward holds one chunk of the MLP's
    intermediates; what the blocks keep between forward and backward is unchanged."""
    from prime_core.config.checks import section_model
    from prime_core.memory import decoder_block_profile
    from prime_plugin_ac import memory as ac_memory

    def block(ac: dict, tokens: int):
        from prime_core.memory import BlockMemory

        profile = decoder_block_profile(_model().config, 2, o_proj_copy=False)
        est = type("Est", (), {"rules": [], "tokens": tokens})()
        ac_memory.checkpointing(est, section_model("trainer", "model")(ac=ac))
        memory = BlockMemory(0, profile, dict(profile.compiled), gpu=sum(profile.compiled.values()),
                             transient=profile.backward)
        est.rules[0](memory)
        return memory

    whole, chunked = block({}, 1 << 20), block({"mlp_token_chunk_size": 1 << 16}, 1 << 20)
    assert chunked.gpu == whole.gpu
    inter = 3 * 2 * 64  # gate, up and product of the tiny model's 64-wide MLP, bf16
    assert chunked.transient == pytest.approx(whole.transient - 2 * inter + 2 * inter / 16 + 2 * 32)
    assert block({"mlp_token_chunk_size": 1 << 20}, 1 << 20).transient == pytest.approx(whole.transient + 2 * 32)
    selective = block({"mode": "selective", "targets": ["norm"], "mlp_token_chunk_size": 1 << 16}, 1 << 20)
    assert "mlp (chunk inputs)" in selective.parts and "mlp" not in selective.parts
