"""prime-plugin-cp: ring and ulysses attention over 2 and 4 gloo processes match a float64
single-process reference on a packed row of uneven samples (GQA and MQA heads), in outputs and
in q/k/v gradients (the ring also on the flash block kernel's plans, flash's calls emulated;
on GPUs with torch's flash kernel); the block kernel, the merge and the strategy's errors on
their own."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import prime_plugin_cp.plugin as plugin
from prime_core import PLUGIN_API_VERSION
from prime_core.plugins import PluginManager

WORKER = Path(__file__).with_name("cp_worker.py")
TOLERANCE = {"f64": 1e-12, "mqa": 1e-12, "apply": 1e-11, "isolated": 1e-12, "plan": 1e-12, "f32": 1e-5,
             "bf16": 5e-2, "flash": 5e-2}
"""Max absolute error against the float64 reference (inputs ~N(0, 1), head dim 16): float64
runs agree to rounding; float32 inputs accumulate in float32; bfloat16 inputs are themselves
rounded to 8 bits before the kernel sees them."""
CASES = {2: ["ring_f64", "ring_mqa", "ring_apply", "ring_f32", "ring_bf16", "ring_isolated", "ring_plan",
             "ulysses_f64", "ulysses_mqa", "ulysses_apply", "ulysses_f32", "ulysses_bf16"],
         4: ["ring_f64", "ring_mqa", "ring_apply", "ring_isolated", "ring_plan", "ulysses_f64", "ulysses_mqa",
             "ulysses_apply"]}


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    from prime_core.testing.ranks import launch

    cache = {}

    def results(size: int) -> dict:
        if size not in cache:
            out = tmp_path_factory.mktemp(f"cp{size}") / "results.json"
            done = launch(size, str(WORKER), [str(out)], timeout=300)
            if done.returncode:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
                raise AssertionError(f"{size}-process CP run failed ({done.returncode})")
            cache[size] = json.loads(out.read_text())
        return cache[size]

    return results


@pytest.mark.parametrize(("size", "case"), [(s, c) for s, cases in CASES.items() for c in cases],
                         ids=lambda x: str(x))
def test_matches_a_single_process(distributed_runs, size, case):
    errors = distributed_runs(size)[case]
    tolerance = TOLERANCE[case.split("_", 1)[1]]
    assert errors.pop("nonfinite", 0.0) == 0.0
    assert errors.pop("wrong_dtype", 0.0) == 0.0
    if case.endswith("_apply"):
        assert errors.pop("wrapped") == 2  # both attention modules
        assert errors.pop("gathers") == 1  # one packing, two layers: its layout is gathered once
    if case == "ring_isolated":  # no sample crosses a rank: every other rank's block is skipped
        assert (errors.pop("forward_blocks"), errors.pop("backward_blocks")) == (1, 1)
    worst = max(errors.values())
    assert worst <= tolerance, errors


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_the_flash_ring_with_nccl_matches_a_single_process(distributed_runs, size):
    """On GPUs (NCCL) the worker also runs the ring on torch's flash block kernel, and on the
    cuDNN one, in bf16."""
    import torch

    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs ({torch.cuda.device_count()} visible)")
    for kernel in ("flash", "cudnn"):  # cuDNN's attention where a part allows, flash for the rest
        errors = distributed_runs(size)[f"ring_{kernel}"]
        assert errors.pop("nonfinite") == 0.0 and errors.pop("wrong_dtype") == 0.0
        assert max(errors.values()) <= TOLERANCE["flash"], (kernel, errors)


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_head_count_error_names_the_fix(distributed_runs, size):
    message = distributed_runs(size)["head_error"]["message"]
    assert f"trainer.model.cp = {size}" in message and "3 query heads" in message and "cp_style = 'ring'" in message


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registers_the_cp_strategy():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["cp"]
    assert (record.status, record.dist) == ("active", "prime-plugin-cp")
    (spec,) = manager.provided_by(record)["prime_parallel_strategies"]
    assert (spec.name, spec.mesh_dims) == ("cp", ("cp",))
    assert manager.select("parallel_strategies", "cp") is spec


def test_importing_the_plugin_does_not_import_torch():
    code = ("import sys, prime_plugin_cp.plugin, prime_plugin_cp.strategy, prime_plugin_cp.ring, "
            "prime_plugin_cp.ulysses; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _row(lengths):
    import torch

    from prime_core.trainer.packing import Packing

    return Packing.from_position_ids(torch.cat([torch.arange(n) for n in lengths]))


def _qkv(length, hq=4, hkv=2, dim=16, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, h, dim, dtype=torch.float64, generator=generator) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 5000], ids=["one_chunk", "many_chunks"])
def test_block_kernel_matches_dense_attention(chunk_bytes):
    import torch

    from prime_plugin_cp.block import block_backward, block_forward
    from prime_plugin_cp.reference import dense_attention

    row = _row([37, 5, 86])
    q, k, v = (t.requires_grad_() for t in _qkv(row.length))
    dout = torch.randn(row.length, 4, 16, dtype=torch.float64)
    expected = dense_attention(q, k, v, row, 0.25)
    expected.backward(dout)
    args = (row.index, row.segment_ids, row.index, row.segment_ids, 0.25)
    out, lse = block_forward(q.detach(), k.detach(), v.detach(), *args, chunk_bytes=chunk_bytes)
    delta = (dout * out).sum(-1)
    dq, dk, dv = block_backward(dout, q.detach(), k.detach(), v.detach(), lse, delta, *args, chunk_bytes=chunk_bytes)
    for got, want in ((out, expected), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (got - want).abs().max() < 1e-12


def test_block_with_no_allowed_keys_contributes_nothing():
    """Queries earlier than every key, or in other samples: zero output, lse -inf, zero
    gradients, and no NaN anywhere; a partly masked block only masks its dead rows."""
    import torch

    from prime_plugin_cp.block import block_backward, block_forward

    q, k, v = _qkv(8)
    dout = torch.ones_like(q)
    early, late = torch.arange(8), torch.arange(8, 16)
    same, other = torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)
    for q_index, q_seg, k_index, k_seg in ((early, same, late, same), (late, same, early, other)):
        out, lse = block_forward(q, k, v, q_index, q_seg, k_index, k_seg, 0.25)
        assert (out == 0).all() and (lse == -math.inf).all()
        grads = block_backward(dout, q, k, v, lse, torch.zeros_like(lse), q_index, q_seg, k_index, k_seg, 0.25)
        assert all((g == 0).all() for g in grads)

    # Queries 0..7 against keys 4..11 of one sample: rows 0..3 see nothing, rows 4..7 see some.
    out, lse = block_forward(q, k, v, early, same, early + 4, same, 0.25)
    assert torch.isfinite(out).all() and (lse[:4] == -math.inf).all() and torch.isfinite(lse[4:]).all()
    assert (out[:4] == 0).all() and (out[4:] != 0).all()
    grads = block_backward(dout, q, k, v, lse, (dout * out).sum(-1), early, same, early + 4, same, 0.25)
    assert all(torch.isfinite(g).all() for g in grads) and (grads[0][:4] == 0).all()


def test_merging_blocks_in_any_order_equals_one_softmax():
    import torch

    from prime_plugin_cp.block import block_forward
    from prime_plugin_cp.ring import merge

    row = _row([20, 12])
    q, k, v = _qkv(row.length)
    whole, whole_lse = block_forward(q, k, v, row.index, row.segment_ids, row.index, row.segment_ids, 0.25)
    parts = [torch.arange(0, 10), torch.arange(10, 24), torch.arange(24, 32)]
    for order in ([0, 1, 2], [2, 0, 1]):
        out = torch.zeros_like(whole)
        lse = torch.full_like(whole_lse, -math.inf)
        for part in (parts[i] for i in order):
            merge(out, lse, *block_forward(q, k[part], v[part], row.index, row.segment_ids, row.index[part],
                                           row.segment_ids[part], 0.25))
        assert (out - whole).abs().max() < 1e-12 and (lse - whole_lse).abs().max() < 1e-12


def test_kv_heads_are_repeated_only_when_they_cannot_be_split():
    from prime_plugin_cp.ulysses import kv_repeat

    assert [kv_repeat(8, 8, 4), kv_repeat(8, 2, 4), kv_repeat(8, 1, 4), kv_repeat(12, 4, 4)] == [1, 2, 4, 1]
    assert kv_repeat(12, 6, 4) == 2  # 12 heads: each rank gets 3 query heads and 3 (repeated) KV heads
    with pytest.raises(ValueError, match=r"trainer.model.cp = 4 .* 6 query heads \(2 key/value heads\)"):
        kv_repeat(6, 2, 4)


class _NoAttention:
    def named_modules(self):
        return [("", self)]


def test_apply_refuses_a_model_without_attention_fn():
    from prime_plugin_cp.strategy import apply

    config = SimpleNamespace(cp=2, cp_style="ring")
    with pytest.raises(ValueError, match="needs a model implementation whose attention modules expose "
                                         "attention_fn.*use impl = 'custom'"):
        apply(_NoAttention(), mesh=None, config=config, world=SimpleNamespace(meshes={}))


def test_apply_without_a_cp_mesh_says_so():
    from prime_plugin_cp.strategy import apply

    model = _NoAttention()
    model.attention_fn = lambda *args: None
    with pytest.raises(RuntimeError, match="no 'cp' device mesh"):
        apply(model, mesh=None, config=SimpleNamespace(cp=2, cp_style="ring", cp_ring_kernel="auto"),
              world=SimpleNamespace(meshes={}))


def test_a_flash_ring_is_refused_where_it_cannot_run():
    from prime_plugin_cp.strategy import apply

    model = _NoAttention()
    model.attention_fn = lambda *args: None
    config = SimpleNamespace(cp=2, cp_style="ring", cp_ring_kernel="flash", dtype="bfloat16")
    with pytest.raises(ValueError, match="cp_ring_kernel = 'flash' needs a GPU computing in bfloat16 or float16 "
                                         r"\(this run: cpu, bfloat16\); set it to 'auto' or 'eager'"):
        apply(model, mesh=None, config=config, world=SimpleNamespace(device="cpu"))


def test_ring_refuses_mismatched_heads_before_communicating():
    import torch

    from prime_plugin_cp.ring import ring_attention

    q, kv = torch.zeros(4, 3, 8), torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv; got q \(4, 3, 8\)"):
        ring_attention(q, kv, kv, _row([4]), 1.0, group=None)
