"""Contract suite for parallel strategies (``prime_core.specs.ParallelStrategy``).

The trainer builds its policy in every rank (``prime_core.trainer.build.build_policy``): it
asks each strategy ``enabled(config, world)`` with the validated ``trainer.model`` section,
collects the ``degrees`` of the enabled ones into ``ParallelDims`` (every degree must divide
the processes; each mesh is built once), and calls ``apply(model, mesh=..., config=...,
world=...)`` in the order of the slots, passing the mesh named by ``mesh_dims``. A strategy
must leave the training numerically what one eager process computes (up to float32
rounding), publish Hugging Face names, and checkpoint so that another world size resumes it.
This suite checks all of it on a tiny random model, with real processes (torchrun, gloo)::

    from prime_core.testing.contracts.parallel_strategy import ParallelStrategyContract

    class TestMine(ParallelStrategyContract):
        name = "mine"
        cases = [{"name": "mine", "model": {"mine_degree": 2}}]   # trainer.model keys turning it on
        processes = 2

It checks that the spec declares a known slot, a mesh the core can build and degrees for
those dimensions; that ``enabled`` answers a bool and is off with its keys at their defaults
on one process (unless ``on_by_default``) and on for every case; and, for each case, that
training ``steps`` optimizer steps in ``processes`` processes matches one eager process
(losses, and the final weights under their published names; the bound is derived from the
eager float32 run's own error against a float64 run, ``prime_core.parity``) with the
strategy in the applied list, and that a checkpoint written there resumes in one process
(its degrees set to 1) to the same result; and that its ``memory`` hook, when it has one, runs in
``prime plan``'s estimate of every case.

The cases run in subprocesses (``python -m prime_core.parity`` under torchrun); what runs in
one process (the references, the resume) runs in the test's own. Both load the *installed*
plugins: install the plugin under test (``pip install -e .``) before running it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

from prime_core.testing.contracts import Contract, ContractError, expect


def tiny_model(folder: Path, *, experts: int = 0) -> Path:
    """A tiny random Qwen3 (or Qwen3-MoE with ``experts``) shaped like ``prime_core.parity.TINY``,
    with tied embeddings, as the first-party parity tests use."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from prime_core.parity import TINY

    hidden = TINY["hidden_size"]
    # The byte-level tiny models of the first-party tests: 260 tokens (the last two end of turn
    # and padding, whose embedding row stays zero) rounded up to 320.
    shape = dict(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=TINY["num_layers"],
                 num_attention_heads=TINY["num_heads"], num_key_value_heads=TINY["num_kv_heads"],
                 head_dim=TINY["head_dim"], max_position_embeddings=4096, tie_word_embeddings=True,
                 eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    if experts:
        config = Qwen3MoeConfig(**shape, moe_intermediate_size=hidden // 2, num_experts=experts,
                                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"]))
    model.save_pretrained(folder)
    return Path(folder)


def model_config(manager, **keys: Any):
    """``trainer.model`` with every installed plugin's keys, validated as a role loads it."""
    from prime_core.config.checks import section_model

    return section_model("trainer", "model", manager)(**keys)


def check_declaration(spec, configs: list) -> None:
    """A known slot, a mesh the core can build, degrees for those dimensions."""
    from prime_core.distributed import ParallelDims
    from prime_core.specs import SLOTS

    expect(spec.slot in SLOTS, f"strategy '{spec.name}': slot {spec.slot!r} is not one of {', '.join(SLOTS)}")
    if spec.mesh_dims:
        try:
            ParallelDims._base(tuple(spec.mesh_dims))
        except ValueError as exc:
            raise ContractError(f"strategy '{spec.name}': mesh_dims {spec.mesh_dims}: {exc}") from None
    expect(not spec.splits_rows or spec.mesh_dims,
           f"strategy '{spec.name}': splits_rows needs the mesh dimension whose ranks split the rows (mesh_dims)")
    for config in configs:
        if spec.degrees is None:
            continue
        degrees = spec.degrees(config)
        expect(isinstance(degrees, dict) and all(isinstance(k, str) and isinstance(v, int) and v >= 1
                                                 for k, v in degrees.items()),
               f"strategy '{spec.name}': degrees() returned {degrees!r}; it must map mesh dimensions to sizes >= 1")
        expect(set(degrees) <= set(spec.mesh_dims),
               f"strategy '{spec.name}': degrees {sorted(degrees)} are not among its mesh_dims {spec.mesh_dims}")


def check_enabled(spec, config, world, want: bool, what: str) -> None:
    answer = spec.enabled(config, world)
    expect(isinstance(answer, bool), f"strategy '{spec.name}': enabled() returned {answer!r}, not a bool")
    expect(answer is want, f"strategy '{spec.name}': enabled() is {answer} {what}")


def check_parity(spec, results: Path, case: dict, processes: int, tolerance: dict) -> None:
    """The case trained in ``processes`` processes matches one eager process, with the strategy applied."""
    import torch

    from prime_core.parity import compare

    name = case["name"]
    got = torch.load(results / f"{name}.pt", weights_only=False)
    expect(spec.name in got["applied"], f"strategy '{spec.name}' was not applied in case {name!r} "
                                        f"(applied: {got['applied']})")
    expect(got["world_size"] == processes, f"case {name!r} ran on {got['world_size']} processes, not {processes}")
    try:
        compare(results / f"{name}.reference.pt", results / f"{name}.pt", **tolerance)
    except AssertionError as exc:
        raise ContractError(f"strategy '{spec.name}', case {name!r}: {processes} processes do not match one eager "
                            f"process: {exc}") from None


def check_resume(spec, manager, model_dir: Path, results: Path, case: dict, out: Path, tolerance: dict,
                 cpu: bool = False) -> None:
    """The checkpoint written at ``ckpt_step`` in the case's processes, loaded by one process
    (the strategy's parallel degrees set to 1), continues to the reference's losses and weights."""
    import torch

    from prime_core.parity import compare, exact_path, run

    keys = dict(case.get("model", {}))
    if spec.degrees is not None:
        keys.update({dim: 1 for dim in spec.degrees(model_config(manager, **keys))})
    one = {**case, "model": keys}
    shutil.copytree(results / case["name"], out / case["name"])
    run(model_dir, out, [one], processes=1, load_ckpt=True, cpu=cpu)
    reference = torch.load(results / f"{case['name']}.reference.pt", weights_only=False)
    resumed = torch.load(out / f"{case['name']}.pt", weights_only=False)
    expect(len(resumed["losses"]) == len(reference["losses"]) - case["ckpt_step"],
           f"case {case['name']!r}: resuming ran {len(resumed['losses'])} steps")
    trimmed = out / "reference-after-ckpt.pt"
    torch.save({**reference, "losses": reference["losses"][case["ckpt_step"]:]}, trimmed)
    exact = exact_path(results / f"{case['name']}.reference.pt")
    if exact.is_file():  # the float64 run the bound is derived from, trimmed alike
        exact_run = torch.load(exact, weights_only=False)
        torch.save({**exact_run, "losses": exact_run["losses"][case["ckpt_step"]:]}, exact_path(trimmed))
    try:
        compare(trimmed, out / f"{case['name']}.pt", **tolerance)
    except AssertionError as exc:
        raise ContractError(f"strategy '{spec.name}', case {case['name']!r}: the checkpoint written by several "
                            f"processes did not resume in one: {exc}") from None


def check_memory(spec, manager, model_dir: Path, case: dict, processes: int) -> None:
    """The ``memory`` hook runs in ``prime plan``'s estimate of the case (the tiny model on the
    meta device, ``processes`` trainer processes) and leaves a finite, positive peak."""
    import math

    from prime_core.config.checks import schema_for
    from prime_core.plan import predict

    config = schema_for("trainer", manager)(model={"name": str(model_dir), **case.get("model", {})},
                                             data={"fake": {"batch_size": processes}})
    try:
        prediction = predict(config, "trainer", manager, processes=processes)
    except Exception as exc:
        raise ContractError(f"strategy '{spec.name}', case {case['name']!r}: its memory hook failed in `prime plan`: "
                            f"{type(exc).__name__}: {exc}") from None
    expect(math.isfinite(prediction.peak) and prediction.peak > 0,
           f"strategy '{spec.name}', case {case['name']!r}: `prime plan` predicts a peak of {prediction.peak!r} bytes")
    expect(not any(f"'{spec.name}' has no memory model" in note for note in prediction.notes),
           f"strategy '{spec.name}' has a memory hook but the plan did not call it for case {case['name']!r}")


class ParallelStrategyContract(Contract):
    """Subclass with ``name`` and ``cases`` set (parity cases: ``{"name", "model": {keys}}``)."""

    registry = "parallel_strategies"
    cases: ClassVar[list[dict]] = []
    """Parity cases that turn the strategy on: ``{"name": ..., "model": {trainer.model keys},
    "optim": {...}, "steps": N}`` (``prime_core.parity``)."""
    processes: ClassVar[int] = 2
    """Trainer processes the cases run in."""
    experts: ClassVar[int] = 0
    """Experts per layer of the tiny model (0: dense)."""
    on_by_default: ClassVar[bool] = False
    """Whether the strategy is on with its keys at their defaults on one process."""
    resume: ClassVar[bool] = True
    """Check that a checkpoint written in ``processes`` processes resumes in one."""
    tolerance: ClassVar[dict] = {}
    """For ``prime_core.parity.compare``: ``factor`` (times the eager reference's own error), or
    ``rtol`` / ``atol`` where a case has no float64 run (a non-float32 model)."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory) -> Path:
        return tiny_model(tmp_path_factory.mktemp("model") / "tiny", experts=cls.experts)

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, model_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
        """Every case as the reference and in ``processes`` processes (the resumable one saved
        at step 2 of 4); the output folder and the cases as run."""
        from prime_core.parity import run, too_few_gpus

        if not cls.cases:
            pytest.fail(f"{cls.__name__} must set `cases`: parity cases that turn '{cls.name}' on")
        cases = [dict(case) for case in cls.cases]
        if cls.resume:
            cases[0] = {**cases[0], "steps": max(4, cases[0].get("steps", 4)), "ckpt_step": 2}
        out = tmp_path_factory.mktemp("parity")
        cpu = too_few_gpus(cls.processes)
        run(model_dir, out, cases, reference=True, cpu=cpu)
        run(model_dir, out, cases, processes=cls.processes, save_ckpt=cls.resume, cpu=cpu)
        return out, cases

    def test_declares_a_slot_a_mesh_and_degrees(self, spec, manager):
        check_declaration(spec, [model_config(manager, **case.get("model", {})) for case in self.cases])

    def test_off_with_its_keys_at_their_defaults(self, spec, manager):
        from prime_core.distributed import World

        check_enabled(spec, model_config(manager), World(), self.on_by_default,
                      "with its keys at their defaults on one process")

    def test_on_for_every_case(self, spec, manager):
        from prime_core.distributed import World

        for case in self.cases:
            check_enabled(spec, model_config(manager, **case.get("model", {})), World(size=self.processes), True,
                          f"for case {case['name']!r}")

    def test_matches_one_eager_process(self, spec, runs):
        out, cases = runs
        for case in cases:
            check_parity(spec, out, case, self.processes, self.tolerance)

    def test_checkpoint_resumes_in_one_process(self, spec, manager, runs, model_dir, tmp_path):
        if not self.resume:
            pytest.skip("resume = False: the strategy changes no parameter or checkpoint layout")
        out, cases = runs
        from prime_core.parity import too_few_gpus

        check_resume(spec, manager, model_dir, out, cases[0], tmp_path, self.tolerance,
                     cpu=too_few_gpus(self.processes))

    def test_memory_model_runs(self, spec, manager, model_dir):
        if spec.memory is None:
            pytest.skip(f"strategy '{self.name}' has no memory hook: `prime plan` says it is not counted")
        for case in self.cases:
            check_memory(spec, manager, model_dir, case, self.processes)
