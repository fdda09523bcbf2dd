"""Contract suite for model implementations (``prime_core.specs.ModelImpl``).

The trainer (every rank, main thread) calls ``spec.build(model_config, device=...)`` with the
validated ``trainer.model`` section: rank 0 with ``device="cpu"`` (weights read from
``model_config.name``, a Hugging Face folder), the other ranks with ``device="meta"`` (the
structure only; the core fills it from rank 0 with ``to_empty``, ``load_state_dict`` and the
buffers). Training calls the model through ``prime_core.trainer.model.predicted_logprobs``
on packed rows (``input_ids``/``position_ids`` ``[1, L]``, positions restarting at 0 for each
sample), and the filesystem transport publishes ``model.save_pretrained(path,
state_dict=...)`` for vLLM to load. This suite does the same, against transformers::

    from prime_core.testing.contracts.model_impl import ModelImplContract

    class TestCustomMoE(ModelImplContract):
        name = "custom"

        @pytest.fixture(scope="class")
        @classmethod
        def model_dir(cls, tmp_path_factory):        # default: a tiny random Qwen3
            return save_tiny(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM")

It checks that ``supports`` accepts the checkpoint; that the meta build has the CPU build's
parameters and buffers (names, shapes, dtypes) and, filled the way the core fills it, computes
the same; that log-probabilities and entropies of random tokens, one sample or a packed row,
match transformers' (each sample run on its own) and so do the gradients of every parameter;
that ``save_pretrained`` of the state dict writes the checkpoint's tensors under their Hugging
Face names, and ``state_dict_adapter`` (when there is one) maps to those names and back; and
that the folder ``save_pretrained`` writes loads in transformers as the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from prime_core.testing.contracts import Contract, expect

LENGTHS = {"one sample": [19], "packed row": [7, 5, 9]}


def tiny_checkpoint(folder: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """A random tiny Qwen3 (tied embeddings, grouped-query attention) written by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight random, so that each one changes the output
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.2
            param.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return Path(folder)


def model_config(folder: Path, impl: str, dtype: str = "float32", tokens=()):
    """``trainer.model`` as the trainer gets it, loaded through the config system."""
    from prime_core.cli.common import load_config

    return load_config("trainer", ["--model.name", str(folder), "--model.impl", impl, "--model.dtype", dtype,
                                   *tokens]).model


def reference_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def packed_row(lengths: list[int], vocab: int, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions, torch.roll(ids[0], -1)


def reference_logprobs(reference, ids, lengths, targets):
    """transformers on each sample alone: log p(target) and entropy at every position."""
    import torch

    logits, start = [], 0
    for n in lengths:
        logits.append(reference(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None]).logits[0])
        start += n
    logsm = torch.log_softmax(torch.cat(logits).double(), dim=-1)
    return logsm.gather(1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


def _error(got, want) -> float:
    """Largest difference relative to the largest magnitude compared."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0))


def check_meta_build(spec, config) -> None:
    """The meta build is the CPU build's structure, and filled as the core fills a meta rank
    (``to_empty``, the rank-0 state dict, then the buffers) it computes the same."""
    import torch

    from prime_core.trainer.model import predicted_logprobs

    cpu = spec.build(config, device="cpu")
    meta = spec.build(config, device="meta")
    for what, items in (("parameter", lambda m: m.named_parameters()), ("buffer", lambda m: m.named_buffers())):
        want = {n: (tuple(t.shape), t.dtype) for n, t in items(cpu)}
        got = {n: (tuple(t.shape), t.dtype) for n, t in items(meta)}
        expect(got == want, f"model impl '{spec.name}': the meta build's {what}s differ from the CPU build's: "
                            f"{sorted(set(got.items()) ^ set(want.items()))[:4]}")
    expect(all(p.device.type == "meta" for p in meta.parameters()),
           f"model impl '{spec.name}': build(device='meta') holds parameters off the meta device")
    expect(all(p.device.type == "cpu" for p in cpu.parameters()),
           f"model impl '{spec.name}': build(device='cpu') holds parameters off the CPU")
    dtype = getattr(torch, config.dtype)
    expect(all(p.dtype == dtype for p in cpu.parameters() if p.is_floating_point()),
           f"model impl '{spec.name}': parameters are not in trainer.model.dtype ({config.dtype})")
    meta.to_empty(device="cpu")
    meta.load_state_dict(cpu.state_dict())
    buffers = dict(cpu.named_buffers())
    with torch.no_grad():
        for name, buffer in meta.named_buffers():
            buffer.copy_(buffers[name])
    vocab = cpu.get_input_embeddings().weight.shape[0]
    ids, positions, targets = packed_row(LENGTHS["packed row"], vocab)
    with torch.no_grad():
        want, _ = predicted_logprobs(cpu, ids, positions, targets)
        got, _ = predicted_logprobs(meta, ids, positions, targets)
    expect(torch.equal(got, want), f"model impl '{spec.name}': the meta build, filled from the CPU build, computes "
                                   f"other log-probabilities (max error {_error(got, want):.3g})")


def hub_gradients(model, folder: Path) -> dict:
    """Every gradient under its Hugging Face name, written by the model's own
    ``save_pretrained`` (as if the gradients were the weights), so that implementations whose
    parameters are named or stacked differently compare tensor by tensor."""
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for name, value in model.state_dict().items():
        param = params.get(name)
        # Tied weights keep one gradient object under both names, as they share one tensor.
        state[name] = value if param is None else (param.grad if param.grad is not None else torch.zeros_like(value))
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    return checkpoint_tensors(folder)


def check_parity(spec, config, folder: Path, scratch: Path, tolerance: float = 1e-4) -> dict[str, float]:
    """Log-probabilities, entropies and every parameter's gradient against transformers, for
    one sample and a packed row (``scratch``: a folder for the gradients). Returns the
    largest relative errors."""
    import torch

    from prime_core.trainer.model import predicted_logprobs

    errors = {}
    for layout, lengths in LENGTHS.items():
        model, reference = spec.build(config, device="cpu"), reference_model(folder)
        ids, positions, targets = packed_row(lengths, reference.config.vocab_size, seed=len(lengths))
        logp, entropy = predicted_logprobs(model, ids, positions, targets)
        want_logp, want_entropy = reference_logprobs(reference, ids, lengths, targets)
        expect(tuple(logp.shape) == (sum(lengths),) and logp.dtype == torch.float32,
               f"model impl '{spec.name}': log-probabilities of shape {tuple(logp.shape)}, {logp.dtype}")
        upstream = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1))
        (logp * upstream).sum().backward()
        (want_logp.float() * upstream).sum().backward()
        errors[f"{layout}: logp"] = _error(logp, want_logp)
        errors[f"{layout}: entropy"] = _error(entropy, want_entropy)
        got = hub_gradients(model, scratch / f"{layout}-model")
        want = hub_gradients(reference, scratch / f"{layout}-reference")
        expect(set(got) == set(want), f"model impl '{spec.name}': save_pretrained writes other tensor names than "
                                      f"transformers: {sorted(set(got) ^ set(want))[:5]}")
        errors.update({f"{layout}: grad {name}": _error(got[name], want[name]) for name in want})
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    expect(not bad, f"model impl '{spec.name}' differs from transformers (relative errors above {tolerance:g}): "
                    + ", ".join(f"{k} = {v:.3g}" for k, v in list(bad.items())[:6]))
    return errors


def checkpoint_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def check_state_dict_names(spec, config, folder: Path, scratch: Path) -> None:
    """``save_pretrained`` of the model's own state dict writes the checkpoint's tensors under
    their Hugging Face names; a ``state_dict_adapter`` maps the state dict to those names
    (``to_hf``) and back (``from_hf``)."""
    import torch

    model = spec.build(config, device="cpu")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    saved = checkpoint_tensors(folder)
    model.save_pretrained(scratch, state_dict=state, safe_serialization=True)
    written = checkpoint_tensors(scratch)
    expect(set(written) == set(saved), f"model impl '{spec.name}': save_pretrained(state_dict=model.state_dict()) "
                                       "writes other names than the checkpoint: "
                                       f"{sorted(set(written) ^ set(saved))[:5]}")
    different = [n for n in saved if not torch.equal(written[n], saved[n])]
    expect(not different, f"model impl '{spec.name}': tensors that differ from the checkpoint: {different[:5]}")
    adapter = spec.state_dict_adapter
    if adapter is None:
        return
    hf = adapter.to_hf(state)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names = set(hf) - ({"lm_head.weight"} if tied else set())
    expect(names == set(saved), f"model impl '{spec.name}': state_dict_adapter.to_hf gives other names than the "
                                f"checkpoint's: {sorted(names ^ set(saved))[:5]}")
    different = [n for n in saved if not torch.equal(hf[n].to(saved[n].dtype), saved[n])]
    expect(not different,
           f"model impl '{spec.name}': state_dict_adapter.to_hf puts other tensors under {different[:5]}")
    back = adapter.from_hf(hf)
    expect(set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state),
           f"model impl '{spec.name}': state_dict_adapter.from_hf(to_hf(state)) is not the state dict")


def check_publishes(spec, config, folder: Path, out: Path, tolerance: float = 1e-5) -> None:
    """``save_pretrained(path, state_dict=...)`` (what the filesystem transport publishes and
    vLLM loads) writes a folder transformers loads to the same model."""
    import torch

    model = spec.build(config, device="cpu")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    model.save_pretrained(out, state_dict=state, safe_serialization=True)
    published, reference = reference_model(out), reference_model(folder)
    ids, _, _ = packed_row(LENGTHS["one sample"], reference.config.vocab_size)
    with torch.no_grad():
        got, want = published(input_ids=ids).logits, reference(input_ids=ids).logits
    expect(_error(got, want) <= tolerance, f"model impl '{spec.name}': the folder save_pretrained wrote loads into a "
                                           f"different model (max relative error {_error(got, want):.3g})")


class ModelImplContract(Contract):
    """Subclass with ``name`` set; override the ``model_dir`` fixture for other checkpoints."""

    registry = "model_impls"
    config_args: ClassVar[tuple[str, ...]] = ()
    """Extra ``--model.<key> value`` tokens for ``trainer.model``."""
    tolerance: ClassVar[float] = 1e-4
    """Largest error relative to the largest magnitude, float32 on CPU."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))

    @pytest.fixture
    def config(self, model_dir, manager):
        return model_config(model_dir, self.name, "float32", self.config_args)

    def test_supports_its_checkpoint(self, spec, model_dir):
        from transformers import AutoConfig

        if spec.supports is None:
            pytest.skip("no supports(): impl = 'auto' never picks it")
        answer = spec.supports(AutoConfig.from_pretrained(model_dir))
        expect(answer is True, f"model impl '{spec.name}': supports() returned {answer!r} for the test checkpoint")

    def test_meta_build_is_the_cpu_build(self, spec, config):
        check_meta_build(spec, config)

    def test_matches_transformers(self, spec, config, model_dir, tmp_path):
        check_parity(spec, config, model_dir, tmp_path, self.tolerance)

    def test_state_dict_has_hugging_face_names(self, spec, config, model_dir, tmp_path):
        check_state_dict_names(spec, config, model_dir, tmp_path / "saved")

    def test_save_pretrained_publishes_a_loadable_folder(self, spec, config, model_dir, tmp_path):
        check_publishes(spec, config, model_dir, tmp_path / "published")
