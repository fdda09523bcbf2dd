"""The custom implementation against transformers, in float32 on CPU: logits and the gradient
of every parameter, for a single sample and for a packed row of samples of uneven lengths;
checkpoints both ways; the meta-device path."""

import pytest
import torch

from prime_core.trainer.config import TrainerModelConfig
from prime_plugin_custom.build import build
from prime_plugin_custom.tiny import DEFAULTS, save_tiny

ARCHITECTURES = list(DEFAULTS)
# float32 on CPU: the two implementations differ by summation order only.
ATOL, RTOL = 1e-5, 1e-4
LENGTHS = {"single": [29], "packed": [11, 5, 13]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: save_tiny(root / arch, arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def custom(folder, **kwargs):
    return build(TrainerModelConfig(name=str(folder), dtype="float32", impl="custom", **kwargs))


def row(lengths, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    ids[0, 2] = 3  # the Qwen3 checkpoint's pad token: its embedding row gets no gradient in either
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def hf_logits(model, ids, lengths):
    """Each sample on its own, as transformers runs it unpacked."""
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None]).logits)
        start += n
    return torch.cat(out, dim=1)


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", list(LENGTHS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_and_gradients_match_transformers(checkpoints, arch, layout):
    lengths = LENGTHS[layout]
    reference, model = load_hf(checkpoints[arch]), custom(checkpoints[arch])
    ids, positions = row(lengths, reference.config.vocab_size)
    weights = torch.randn(1, ids.shape[1], reference.config.vocab_size, generator=torch.Generator().manual_seed(1))

    expected = hf_logits(reference, ids, lengths)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False).logits
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    (expected * weights).sum().backward()
    (logits * weights).sum().backward()

    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys(), "parameter names (in memory) are transformers'"
    # Gradients reach O(100) here (a sum over L x V logits): the tolerance is relative to each
    # parameter's largest gradient entry.
    worst = max((max_diff(ours[n].grad, theirs[n].grad) / max(1.0, theirs[n].grad.abs().max().item()), n)
                for n in ours)
    assert worst[0] <= ATOL, f"{worst[1]}: gradient differs by {worst[0]:.2e} of its scale"
    print(f"{arch} {layout}: logits max |diff| {max_diff(logits, expected):.2e}, "
          f"grads max |diff| / scale {worst[0]:.2e} ({worst[1]})")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_pretrained_round_trips_through_transformers(checkpoints, arch, tmp_path):
    from safetensors import safe_open

    model = custom(checkpoints[arch])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)  # differ from the source, so the saved weights are really ours
    # What the core hands over: the model's own names, possibly with wrapper parts in them.
    state = {k.replace("self_attn.", "self_attn._checkpoint_wrapped_module."): v for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "out", state_dict=state, safe_serialization=True)

    def keys(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return set(f.keys())

    assert keys(tmp_path / "out") == keys(checkpoints[arch]), "the hub layout transformers writes"
    reloaded = load_hf(tmp_path / "out")
    ids, positions = row([17], reloaded.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, position_ids=positions).logits,
                                   model(input_ids=ids, position_ids=positions).logits, atol=ATOL, rtol=RTOL)


def test_save_pretrained_shards_and_loads_back(checkpoints, tmp_path):
    from prime_plugin_custom.checkpoint import save_hf

    arch = "Qwen3MoeForCausalLM"
    model = custom(checkpoints[arch])
    save_hf(model, tmp_path / "out", shard_bytes=64 * 1024)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    again = custom(tmp_path / "out")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_state_dict_adapter_round_trip(checkpoints):
    from prime_plugin_custom.adapter import ADAPTER

    model = custom(checkpoints["Qwen2MoeForCausalLM"])
    state = model.state_dict()
    hub = ADAPTER.to_hf(state, tied=True)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in hub and "lm_head.weight" not in hub
    back = ADAPTER.from_hf(hub)
    assert back.keys() == state.keys() - {"lm_head.weight"}
    assert all(torch.equal(back[k], state[k]) for k in back)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_meta_build_then_to_empty_and_load(checkpoints, arch):
    from prime_plugin_custom.checkpoint import load_hf_weights

    reference = custom(checkpoints[arch])
    model = build(TrainerModelConfig(name=str(checkpoints[arch]), dtype="float32", impl="custom"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    model.to_empty(device="cpu")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.tied
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    load_hf_weights(model, checkpoints[arch])
    ids, positions = row([9, 12], model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, position_ids=positions).logits,
                           reference(input_ids=ids, position_ids=positions).logits)


def test_bfloat16_build_keeps_rotary_in_float32(checkpoints):
    model = build(TrainerModelConfig(name=str(checkpoints["LlamaForCausalLM"]), dtype="bfloat16", impl="custom"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = custom(checkpoints["LlamaForCausalLM"])
    ids, positions = row([20], model.config.vocab_size)
    with torch.no_grad():
        low = model(input_ids=ids, position_ids=positions).logits.float()
        high = reference(input_ids=ids, position_ids=positions).logits
    assert max_diff(low, high) < 0.1 * high.abs().max().item()


def test_core_token_logprobs_match_transformers(checkpoints):
    """Through the core's forward (which passes attention_mask / use_cache for transformers)."""
    from prime_core.trainer.model import token_logprobs

    folder = checkpoints["Qwen3MoeForCausalLM"]
    reference, model = load_hf(folder), custom(folder)
    ids, positions = row([7, 15, 6], model.config.vocab_size)
    with torch.no_grad():
        ours, our_entropy = token_logprobs(model, ids, positions)
        theirs, their_entropy = token_logprobs(reference, ids, positions)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(our_entropy, their_entropy, atol=ATOL, rtol=RTOL)


def test_blocks_and_activation_checkpointing_targets(checkpoints):
    from prime_core.trainer.model import transformer_blocks

    checkpointing = pytest.importorskip("prime_plugin_ac.checkpointing")
    model = custom(checkpoints["Qwen2MoeForCausalLM"])
    ids, positions = row([10, 10], model.config.vocab_size)
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=positions).logits
    blocks = transformer_blocks(model)
    assert blocks is model.model.layers
    for block in blocks:
        # norm: 2 (4 with q/k norms); attn_proj: 4; mlp_proj: 3 per dense MLP or shared expert.
        assert checkpointing.wrap_selected(block, ["norm", "attn_proj", "mlp_proj"]) >= 9
    blocks[0] = checkpointing.wrap(blocks[0])
    assert transformer_blocks(model) is blocks
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions).logits, before)


def test_attention_fn_is_called_through_the_attribute(checkpoints):
    from prime_plugin_custom.layers import sdpa_attention

    model = custom(checkpoints["Qwen3ForCausalLM"])
    seen = []

    def spy(q, k, v, packing, scale):
        seen.append((q.shape, k.shape, packing.length))
        return sdpa_attention(q, k, v, packing, scale)

    for layer in model.model.layers:
        layer.self_attn.attention_fn = spy
    ids, positions = row([4, 6], model.config.vocab_size)
    model(input_ids=ids, position_ids=positions)
    assert seen == [(torch.Size([10, 4, 16]), torch.Size([10, 2, 16]), 10)] * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_compiled_blocks_are_not_recompiled_for_each_packing(checkpoints, arch):
    """An RL step brings rows of new lengths packing new numbers of samples. A compiled block
    gets a graph per kind of row (one sample or packed; first static, then with the token count
    symbolic), not one per packing: a graph holding the sample boundaries was recompiled for each,
    and past dynamo's recompile limit (8) the blocks ran eagerly (an H200's 1.7B step at a third
    of its speed, stop 71). Dynamo's guards are the compiler's own, so its eager backend counts
    the graphs that Inductor would compile."""
    from torch._dynamo.testing import CompileCounter

    from prime_core.trainer.model import transformer_blocks

    model = custom(checkpoints[arch])
    vocab = model.config.vocab_size
    counter = CompileCounter()
    torch._dynamo.reset()
    for block in transformer_blocks(model):
        block.compile(backend=counter)

    def step(lengths, seed):
        ids, positions = row(lengths, vocab, seed)
        model(input_ids=ids, position_ids=positions).logits.float().square().mean().backward()

    try:
        # each kind of row twice after the other kind: every variant of every graph
        for seed, lengths in enumerate(([29], [17], [11, 5, 13], [6, 20], [33], [21], [8, 8, 8, 9])):
            step(lengths, seed)
        warm = counter.frame_count
        assert warm > 0
        for seed, lengths in enumerate(([40], [3, 4, 5, 6, 7, 8], [31, 2], [12], [1, 30, 9], [25, 25]), 10):
            step(lengths, seed)
        assert counter.frame_count == warm, f"{counter.frame_count - warm} graphs more for new packings"
    finally:
        torch._dynamo.reset()


def test_with_fullgraph_a_packed_row_is_refused_with_the_key_to_change(checkpoints):
    from prime_core.trainer.model import transformer_blocks

    model = custom(checkpoints["Qwen3ForCausalLM"])
    torch._dynamo.reset()
    for block in transformer_blocks(model):
        block.compile(fullgraph=True, backend="eager")
    try:
        ids, positions = row([29], model.config.vocab_size)
        model(input_ids=ids, position_ids=positions).logits.sum().backward()  # one sample: one graph
        ids, positions = row([11, 5, 13], model.config.vocab_size)
        with pytest.raises(Exception, match="trainer.model.compile.fullgraph = true only rows of one sample"):
            model(input_ids=ids, position_ids=positions)
    finally:
        torch._dynamo.reset()
