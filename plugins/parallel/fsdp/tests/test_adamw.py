"""The fused update over the master weights (``prime_plugin_fsdp.adamw``) against
``torch.optim.AdamW`` after the trainer's clipping, on fresh random inputs: compiled on a GPU,
through Triton's interpreter elsewhere (``prime_core.testing.triton``). And the trainer with it
against FSDP's mixed precision in one process (the reference, unfused)."""

import shutil

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from prime_core.testing.triton import device, interpreter_rerun, kernel_test  # noqa: E402

DEVICE = device()
test_in_the_triton_interpreter = interpreter_rerun(__file__)
SHAPES = [(3,), (5000,), (64, 130), (4096, 3)]


class Weights:
    """What ``adamw.step`` reads of ``one_process.MasterWeights`` (``copies``: with compute
    copies; without, of ``one_process.PlainWeights``)."""

    def __init__(self, masters, copies: bool = True) -> None:
        from prime_plugin_fsdp.adamw import StepCounts, grid
        from prime_plugin_fsdp.norms import GradientNorms

        self.masters = masters
        self.norms = GradientNorms(masters)
        self.copies = [m.detach().to(torch.bfloat16) for m in masters] if copies else []
        self.index_of = {id(m): i for i, m in enumerate(masters)}
        self.step_counts = StepCounts()
        self.grid = lambda block: grid([m.numel() for m in masters], block, masters[0].device)

    def step_grid(self, block):
        return self.grid(block)


@pytest.fixture(params=["a launch a gradient", "grouped launches"])
def launches(request, monkeypatch):
    """``norms.GROUPED`` off and on; on, three gradients a launch, so that ``SHAPES``' four take
    a full group in the backward pass and a partial one at the update."""
    from prime_plugin_fsdp import norms

    monkeypatch.setattr(norms, "GROUPED", request.param == "grouped launches")
    monkeypatch.setattr(norms, "GROUP", 3)
    return request.param


def _masters(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(DEVICE)) for s in SHAPES]


def _grads(seed, dtype, scale):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(DEVICE) for s in SHAPES]


@kernel_test
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e3], ids=["no_clip", "clipped", "under_the_bound"])
def test_the_fused_step_is_adamw_after_clipping(grad_dtype, max_norm):
    from prime_core.trainer.optim import clip_factor, clip_grad_norm
    from prime_plugin_fsdp import adamw

    ours, theirs = _masters(1), _masters(1)
    hyper = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    mine = torch.optim.AdamW(ours, **hyper)
    reference = torch.optim.AdamW(theirs, **hyper, foreach=False)
    weights = Weights(ours)
    assert adamw.why_not(weights, mine) is None
    for step in range(4):
        grads = _grads(10 + step, grad_dtype, scale=0.3 * (step + 1))
        for param, grad in zip(theirs, grads, strict=True):
            param.grad = grad.float().clone()
        # The trainer's clipping, by the norm in float64: the fused norm is within 1e-6 of it,
        # _foreach_norm's 2.5e-6 on CPU, enough to move the moments past float32 rounding.
        torch.testing.assert_close(clip_grad_norm(theirs, None), _norm(grads).float(), rtol=1e-5, atol=0)
        if max_norm is not None:
            torch._foreach_mul_([p.grad for p in theirs], clip_factor(_norm(grads).float(), max_norm))
        reference.step()
        got = adamw.step(weights, mine, max_norm, list(grads))
        torch.testing.assert_close(got.double(), _norm(grads), rtol=1e-6, atol=0)
        for a, b in zip(ours, theirs, strict=True):
            _close(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                _close(mine.state[a][key], reference.state[b][key])
            assert float(mine.state[a]["step"]) == float(reference.state[b]["step"]) == step + 1
        # Each compute copy is its new master rounded to bfloat16, as the unfused refresh casts it.
        for master, copy in zip(ours, weights.copies, strict=True):
            assert torch.equal(copy, master.detach().to(torch.bfloat16))


@kernel_test
@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["no_clip", "clipped"])
def test_bf16_weights_step_in_place_as_adamw_in_float32_rounded(max_norm):
    """No master: bfloat16 weights and moments stepped in place, against ``torch.optim.AdamW`` in
    float32 over the same values with the gradients clipped in float32, each result rounded to
    bfloat16 after the step; without clipping also against ``torch.optim.AdamW``'s fused step on
    the bfloat16 tensors, which computes so. (The trainer's own clipping of bfloat16 gradients
    rounds them to bfloat16 once more, the fused update does not.) Both round float32 results of
    the same formula, in another order: a result on the edge of two bfloat16 values may round
    either way, one unit in the last place apart, and a moment that cancels to about zero is zero
    in one and 1e-9 in the other."""
    from prime_core.trainer.optim import clip_factor
    from prime_plugin_fsdp import adamw

    ours = [torch.nn.Parameter(m.detach().to(torch.bfloat16)) for m in _masters(1)]
    wide = [torch.nn.Parameter(m.detach().float()) for m in ours]
    fused = [torch.nn.Parameter(m.detach().clone()) for m in ours]
    hyper = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    mine = torch.optim.AdamW(ours, **hyper)
    reference = torch.optim.AdamW(wide, **hyper, foreach=False)
    torch_fused = torch.optim.AdamW(fused, **hyper, fused=True)
    weights = Weights(ours, copies=False)
    assert adamw.why_not(weights, mine) is None
    for step in range(4):
        grads = _grads(10 + step, torch.bfloat16, scale=0.3 * (step + 1))
        clip = clip_factor(_norm(grads).float(), max_norm) if max_norm else 1.0
        for param, other, grad in zip(wide, fused, grads, strict=True):
            param.grad, other.grad = grad.float() * clip, grad.clone()
        reference.step()
        with torch.no_grad():
            for param in wide:
                state = reference.state[param]
                for tensor in (param, state["exp_avg"], state["exp_avg_sq"]):
                    tensor.copy_(tensor.to(torch.bfloat16))
        got = adamw.step(weights, mine, max_norm, list(grads))
        torch.testing.assert_close(got.double(), _norm(grads), rtol=1e-6, atol=0)
        references = [("float32, rounded", reference, wide, False)]
        if max_norm is None:
            torch_fused.step()
            references.append(("torch's fused", torch_fused, fused, True))
        for what, optimizer, params, other_order in references:
            for a, b in zip(ours, params, strict=True):
                _bf16_close(a, b, f"{what}: weight, step {step + 1}", hyper["lr"], other_order)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert mine.state[a][key].dtype == torch.bfloat16
                    _bf16_close(mine.state[a][key], optimizer.state[b][key], f"{what}: {key}, step {step + 1}",
                                0.0, other_order)
                assert float(mine.state[a]["step"]) == float(optimizer.state[b]["step"]) == step + 1


@kernel_test
def test_plain_weights_step_the_model_in_place_or_leave_the_step_to_the_trainer():
    """``one_process.PlainWeights`` (bf16 weights, no master): its update hook runs the fused
    step over the model's own parameters (tied ones once) and takes their gradients; a weight
    of another dtype leaves the clipping and the step to the trainer (``None``)."""
    from prime_plugin_fsdp.one_process import PlainWeights

    params = [torch.nn.Parameter(m.detach().to(torch.bfloat16)) for m in _masters(1)]
    model = torch.nn.ParameterList(params + [params[0]])  # the first one tied
    weights = PlainWeights(model)
    assert [id(p) for p in weights.masters] == [id(p) for p in params] and not weights.copies
    before = [p.detach().clone() for p in params]
    grads = _grads(2, torch.bfloat16, 1.0)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    norm = weights.update(model, optimizer, 1.0)
    torch.testing.assert_close(norm.double(), _norm(grads), rtol=1e-6, atol=0)
    assert all(p.grad is None for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.bfloat16

    mixed = [torch.nn.Parameter(torch.zeros(4, device=DEVICE)), torch.nn.Parameter(params[1].detach().clone())]
    other = PlainWeights(torch.nn.ParameterList(mixed))
    assert other.update(None, torch.optim.AdamW(mixed, lr=1e-2), 1.0) is None
    assert "one dtype" in other.fused[next(iter(other.fused))]


def _bf16_close(got, want, what: str, step_size: float, other_order: bool) -> None:
    """bfloat16 tensors equal but for roundings the other way. The same formula (``other_order``
    false): at most one unit in the last place apart (a millionth of the largest value, near
    zero), in at most 5% of the elements (a flip carries over into the next steps: 1.4% after
    four steps on an H200, where the compiled kernel contracts multiplies and adds; a wrong
    formula is off everywhere). Another order of the operations (torch's CUDA kernel): a moment
    that cancels to near zero keeps the unit of what cancelled (0.00313 against 0.00357, after
    terms of 0.1), so the unit of the tensor's largest value, and flips compound over the steps
    (a third of the elements of a small tensor after four). A weight may also be off by a
    bfloat16 unit of the step (``step_size``, the learning rate): what a moment rounded the
    other way in an earlier step changes of it."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    largest = float(want.abs().max())
    bound = (largest * 2.0 ** -7 if other_order else want.abs() * 2.0 ** -7 + 1e-6 * largest) + step_size * 2.0 ** -7
    worst = int(((got - want).abs() / bound).argmax())
    assert bool(((got - want).abs() <= bound).all()), (what, float(got.flatten()[worst]), float(want.flatten()[worst]))
    assert other_order or float((got != want).float().mean()) <= 0.05, (what, float((got != want).float().mean()))


def _norm(grads) -> torch.Tensor:
    """The gradients' norm in float64. The fused update sums each block's squares in float32,
    torch's ``_foreach_norm`` (the trainer's clipping) each tensor's norm: on CPU the sum is
    closer (6e-9 from float64 here, against 2.5e-6)."""
    return sum((g.double() ** 2).sum() for g in grads if g is not None).sqrt()


def _close(got, want) -> None:
    """Equal up to float32 rounding: within a few units in the last place of the largest value
    (a moment near zero after ``m + (1 - beta1) * (g - m)`` loses its relative precision)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert float((got - want).abs().max()) <= 4e-7 * float(want.abs().max()), float((got - want).abs().max())


@kernel_test
def test_the_norm_sums_every_gradient_whatever_its_dtype(launches):
    """A second micro-batch leaves float32 gradients beside one micro-batch's bfloat16 ones; a
    parameter may have none. Blocks whole and cut short (``SHAPES`` has sizes across ``NORM_BLOCK``)."""
    from prime_core.trainer.optim import squared_norm as reference
    from prime_plugin_fsdp import adamw

    assert max(torch.Size(s).numel() for s in SHAPES) > adamw.NORM_BLOCK
    grads = _grads(7, torch.bfloat16, 1.0)
    grads[0], grads[3], grads[1] = grads[0].float(), grads[3].float(), None
    got = adamw.squared_norm(Weights(_masters(6)), grads)
    torch.testing.assert_close(got.double(), _norm(grads) ** 2, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, reference([g for g in grads if g is not None]), rtol=1e-5, atol=0)


@kernel_test
def test_squares_taken_in_the_last_backward_pass_give_the_same_norm(launches):
    """``norms.GradientNorms``: what the last backward pass took (``take``) and what the update
    sums are the same partial sums, so the norm is the same bit for bit. A gradient that changed
    after it was taken (accumulated into, replaced) is summed again, one dropped reads 0, and a
    pass that is not the last takes nothing."""
    from prime_plugin_fsdp.norms import GradientNorms

    masters = _masters(6)
    grads = _grads(8, torch.bfloat16, 1.0)
    grads[2] = grads[2].float()
    want = GradientNorms(masters).squared(list(grads))
    torch.testing.assert_close(want.double(), _norm(grads) ** 2, rtol=1e-6, atol=0)

    norms = GradientNorms(masters)
    norms.arm(True)
    for index, grad in enumerate(grads):
        norms.take(index, grad)
    assert torch.equal(norms.squared(list(grads)), want)

    changed = [g.clone() for g in grads]
    norms.arm(False)
    for index, grad in enumerate(changed):  # an earlier micro-batch's: not final, not taken
        norms.take(index, grad)
    norms.arm(True)
    for index, grad in enumerate(changed):
        norms.take(index, grad)
    changed[0].mul_(3)  # accumulated into after it was taken
    changed[1] = changed[1] * 2  # replaced
    dropped = [*changed[:3], None]
    got = norms.squared(dropped)
    torch.testing.assert_close(got.double(), _norm(dropped) ** 2, rtol=1e-6, atol=0)
    assert torch.equal(got, GradientNorms(masters).squared(list(dropped)))


@kernel_test
def test_grouped_launches_give_each_block_the_same_partial_sum(monkeypatch):
    """``norms.GROUPED``: one launch over a table of gradients writes every slot the launch a
    gradient writes, bit for bit (of either dtype, blocks whole and cut short), in the backward
    pass's groups and at the update."""
    from prime_plugin_fsdp import norms

    masters = _masters(9)
    grads = _grads(10, torch.bfloat16, 1.0)
    grads[1] = grads[1].float()
    slots = {}
    for grouped in (False, True):
        monkeypatch.setattr(norms, "GROUPED", grouped)
        monkeypatch.setattr(norms, "GROUP", 2)
        taken = norms.GradientNorms(masters)
        taken.arm(True)
        for index in (3, 0, 2):  # the order a backward pass finishes them in; 1 left to the update
            taken.take(index, grads[index])
        total = taken.squared(list(grads))
        slots[grouped] = (total, taken._sums.clone())
    assert torch.equal(slots[True][1], slots[False][1])
    assert torch.equal(slots[True][0], slots[False][0])


@kernel_test
@pytest.mark.parametrize("kind", ["plain", "master"])
def test_the_last_backward_pass_takes_each_final_gradient(kind, launches):
    """Through the trainer's hooks: once the update is fused, the step's last backward pass
    (``before_backward(model, last=True)``) has taken every gradient's squares when it returns,
    earlier passes none; the update's norm is the summed gradients' (two micro-batches)."""
    from prime_plugin_fsdp.one_process import MasterWeights, PlainWeights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.Linear(130, 3)).to(DEVICE)
    if kind == "plain":
        weights = PlainWeights(model.to(torch.bfloat16))
    else:
        weights = MasterWeights(model, torch.bfloat16)
        model.register_forward_pre_hook(weights.compute)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    for step in range(2):
        grads = []
        for last in (False, True):
            weights.before_backward(model, last)
            model(torch.randn(16, 64, device=DEVICE, dtype=torch.bfloat16)).float().square().sum().backward()
            assert len(weights.norms._taken) == (4 if last and step else 0)
        if kind == "plain":
            grads = [p.grad.clone() for p in weights.masters]
        else:
            weights.before_step()
            grads = [g.clone() for g in weights.grads]
        norm = weights.update(model, optimizer, 1.0)
        torch.testing.assert_close(norm.double(), _norm(grads), rtol=1e-6, atol=0)


@kernel_test
def test_parameters_without_a_gradient_are_left_alone():
    from prime_plugin_fsdp import adamw

    masters = _masters(2)
    before = [m.detach().clone() for m in masters]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    weights = Weights(masters)
    copies = [c.clone() for c in weights.copies]
    grads = _grads(3, torch.bfloat16, 1.0)
    grads[1] = None
    adamw.step(weights, optimizer, 1.0, grads)
    assert torch.equal(masters[1], before[1]) and torch.equal(weights.copies[1], copies[1])
    assert masters[1] not in optimizer.state
    assert not torch.equal(masters[0], before[0])


@kernel_test
def test_gradients_at_unaligned_addresses_are_read_as_well():
    from prime_plugin_fsdp import adamw

    results = []
    for offset in (0, 1):
        masters = _masters(4)
        optimizer = torch.optim.AdamW(masters, lr=1e-2)
        grads = []
        for grad in _grads(5, torch.bfloat16, 1.0):
            held = torch.empty(grad.numel() + offset, dtype=grad.dtype, device=grad.device)[offset:]
            grads.append(held.copy_(grad.flatten()).view(grad.shape))
        assert offset == 0 or grads[1].data_ptr() % 16
        adamw.step(Weights(masters), optimizer, 1.0, grads)
        results.append(masters)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_what_is_not_fused_is_named():
    from prime_plugin_fsdp import adamw

    masters = [torch.nn.Parameter(torch.zeros(4))]
    weights = Weights(masters)
    assert "SGD" in adamw.why_not(weights, torch.optim.SGD(masters, lr=1))
    assert "amsgrad" in adamw.why_not(weights, torch.optim.AdamW(masters, amsgrad=True))
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert "not master weights" in adamw.why_not(weights, other)
    hooked = torch.optim.AdamW(masters)
    hooked.register_step_pre_hook(lambda *_: None)
    assert "hooks" in adamw.why_not(weights, hooked)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from prime_core.testing.contracts.parallel_strategy import tiny_model

    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@kernel_test
def test_the_trainer_with_the_fused_update_trains_as_fsdp(model_dir, tmp_path, monkeypatch):
    """Several steps of several micro-batches (the gradients summed in float32; the kernel tests
    above step bf16 gradients too), also with LoRA; a checkpoint of the fused run resumes to
    the uninterrupted run's weights, and resumes unfused too (the state is AdamW's own). bf16
    weights without a master (``plain``: no FSDP, stepped in place) resume unfused the same way."""
    from safetensors.torch import load_file

    from prime_core.parity import distance, run

    if DEVICE == "cuda":
        pytest.skip("tests/test_one_process.py's GPU test covers the compiled trainer")
    bf16 = {"dtype": "bfloat16"}
    fsdp_keys = {**bf16, "reshard_after_forward": True}
    lora = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    # Three steps, a checkpoint after the first: the resumed runs below take two steps from it (the
    # first with the checkpoint's weights, the next after a step with its AdamW state). A fused
    # step is about 2 s in the interpreter (two launches over every weight), most of this test.
    fused_case = {"name": "fused", "model": bf16, "steps": 3, "ckpt_step": 1}
    plain_case = {"name": "plain", "model": {**bf16, "optimization_dtype": "bfloat16"}, "steps": 3, "ckpt_step": 1}
    run(model_dir, tmp_path, [fused_case,
                              {"name": "fsdp", "model": fsdp_keys, "steps": 3},
                              {"name": "fused_lora", "model": {**bf16, **lora}, "steps": 3},
                              {"name": "fsdp_lora", "model": {**fsdp_keys, **lora}, "steps": 3},
                              plain_case],
        save_ckpt=True)
    fused, fsdp, fused_lora, fsdp_lora = (torch.load(tmp_path / f"{name}.pt", weights_only=False)
                                          for name in ("fused", "fsdp", "fused_lora", "fsdp_lora"))
    assert fused["layout"] == {} and fsdp["layout"]
    for ours, theirs in ((fused, fsdp), (fused_lora, fsdp_lora)):
        for a, b in zip(ours["losses"], theirs["losses"], strict=True):
            assert abs(a - b) <= 1e-4 * abs(b), (ours["losses"], theirs["losses"])
        for a, b in zip(ours["grad_norms"], theirs["grad_norms"], strict=True):
            assert abs(a - b) <= 2e-3 * abs(b), (ours["grad_norms"], theirs["grad_norms"])
    assert any(not torch.equal(v, fsdp_lora["state"][k]) for k, v in fused_lora["state"].items())
    # Not bit for bit: float32 rounding differences flip bf16 roundings of the compute copies,
    # and Adam turns a small change of a gradient near zero into one of up to the learning rate.
    # So the runs' distance is measured against how far training moved the weights (0.6% of it
    # after 3 steps); an update computing something else is tens of percent away.
    initial = load_file(model_dir / "model.safetensors")
    moved = distance(fsdp["state"], {k: initial.get(k, initial["model.embed_tokens.weight"]) for k in fsdp["state"]})
    assert distance(fused["state"], fsdp["state"]) <= 0.03 * moved
    # The unfused casts match FSDP bit for bit (test_one_process.py): a difference shows the fused update ran.
    assert any(not torch.equal(value, fsdp["state"][key]) for key, value in fused["state"].items())
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "fused", resumed / "fused")
    run(model_dir, resumed, [fused_case], load_ckpt=True)
    again = torch.load(resumed / "fused.pt", weights_only=False)
    assert again["losses"] == fused["losses"][1:]
    for key, value in fused["state"].items():
        assert torch.equal(value, again["state"][key]), key
    # The same checkpoint, resumed without the fused update (no kernels in that process): the
    # first step computes with the same weights, the next after an unfused AdamW step.
    unfused = tmp_path / "unfused"
    unfused.mkdir()
    shutil.copytree(tmp_path / "fused", unfused / "fused")
    shutil.copytree(tmp_path / "plain", unfused / "plain")
    monkeypatch.delenv("TRITON_INTERPRET")
    run(model_dir, unfused, [fused_case, plain_case], load_ckpt=True, fresh=True)  # triton without its interpreter
    for name, bound in (("fused", 1e-4), ("plain", 1e-3)):  # torch's AdamW rounds each bf16 operation
        before = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        after = torch.load(unfused / f"{name}.pt", weights_only=False)
        assert after["losses"][0] == before["losses"][1], name
        assert abs(after["losses"][1] - before["losses"][2]) <= bound * abs(before["losses"][2]), name
        assert after["layout"] == {} and before["applied"] == ["fsdp"], name  # one_process, not FSDP
