"""Contract suite for weight transports (``prime_core.specs.WeightTransport``).

The trainer (rank 0, main thread) calls ``spec.publisher(trainer_config, output_dir=...)``
once, then ``publisher.publish(model, step, state_dict)`` after each optimizer step it
publishes: ``model`` is the trained module (its ``config`` and ``save_pretrained``),
``state_dict`` the full tensors under Hugging Face names (``None``: the model holds them; a
``prime_core.weights.Adapter`` in LoRA runs). A resumed run publishes its last step again.
The orchestrator (another process, its event loop) calls ``spec.loader(orchestrator_config,
output_dir=...)`` once and then polls ``loader.latest()``: ``None`` before the first version,
else ``(step, path)`` of the newest *complete* version, ``path`` a Hugging Face folder (or a
PEFT adapter folder) that inference loads. This suite does the same::

    from prime_core.testing.contracts.weight_transport import WeightTransportContract

    class TestFilesystem(WeightTransportContract):
        name = "filesystem"

It checks that nothing is found before the first publish; that right after ``publish(step)``
returns, ``latest()`` (of this loader, a new one, and one in another process) is that step
with exactly the tensors published; that republishing a step replaces it; that while a slow
``save_pretrained`` writes, a loader polling all the time never sees a half-written version;
and that a LoRA ``Adapter`` is published as an adapter folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_core.testing.contracts import Contract, ContractError, expect, role_config
from prime_core.testing.contracts.model_impl import checkpoint_tensors, tiny_checkpoint


def tiny_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(folder), dtype="float32")


def versions(model, steps, scratch: Path) -> dict[int, tuple[dict, dict]]:
    """Per step: the state dict to publish (the weights, shifted by the step so that versions
    differ) and what a complete Hugging Face folder of it holds (``save_pretrained``'s own)."""
    out = {}
    for step in steps:
        shifted: dict[int, object] = {}  # per storage: tied weights stay one tensor, as the trainer hands them
        state = {k: shifted.setdefault(v.data_ptr(), v.detach() + 1e-3 * step if v.is_floating_point() else v)
                 for k, v in model.state_dict().items()}
        model.save_pretrained(scratch / f"reference_{step}", state_dict=state, safe_serialization=True)
        out[step] = (state, checkpoint_tensors(scratch / f"reference_{step}"))
    return out


def make_pair(spec, output_dir: Path):
    publisher = spec.publisher(role_config("trainer", output_dir), output_dir=output_dir)
    expect(callable(getattr(publisher, "publish", None)),
           f"weight transport '{spec.name}': publisher() returned {type(publisher).__name__} without publish()")
    return publisher, make_loader(spec, output_dir)


def make_loader(spec, output_dir: Path):
    loader = spec.loader(role_config("orchestrator", output_dir), output_dir=output_dir)
    expect(callable(getattr(loader, "latest", None)),
           f"weight transport '{spec.name}': loader() returned {type(loader).__name__} without latest()")
    return loader


def check_found(spec, found, step: int, tensors: dict) -> None:
    """``found`` is ``(step, path)``, ``path`` a complete folder holding ``tensors``."""
    import torch

    expect(isinstance(found, tuple) and len(found) == 2,
           f"weight transport '{spec.name}': latest() returned {found!r}, not (step, path)")
    got_step, path = found
    expect(got_step == step, f"weight transport '{spec.name}': latest() is step {got_step}, expected {step}")
    path = Path(path)
    expect((path / "config.json").is_file(), f"weight transport '{spec.name}': step {step} at {path} has no "
                                             "config.json")
    try:
        got = checkpoint_tensors(path)
    except Exception as exc:
        raise ContractError(f"weight transport '{spec.name}': step {step} at {path} does not load: "
                            f"{type(exc).__name__}: {exc}") from exc
    expect(set(got) == set(tensors), f"weight transport '{spec.name}': step {step} at {path} holds other tensors: "
                                     f"{sorted(set(got) ^ set(tensors))[:5]}")
    different = [n for n in tensors if not torch.equal(got[n], tensors[n])]
    expect(not different, f"weight transport '{spec.name}': step {step} at {path}: other values in {different[:5]}")


def latest_elsewhere(plugin: str | None, name: str, output_dir: Path):
    """``latest()`` of a loader in a new process, as the orchestrator's is."""
    code = ("import json, sys\n"
            "from prime_core.testing.contracts import manager_for, role_config, spec_from\n"
            "from prime_core.plugins import set_plugin_manager\n"
            "plugin, name, out = sys.argv[1] or None, sys.argv[2], sys.argv[3]\n"
            "manager = manager_for(plugin); set_plugin_manager(manager)\n"
            "spec = spec_from(manager, 'weight_transports', name)\n"
            "found = spec.loader(role_config('orchestrator', out), output_dir=out).latest()\n"
            "print(json.dumps(None if found is None else [found[0], str(found[1])]))\n")
    done = subprocess.run([sys.executable, "-c", code, plugin or "", name, str(output_dir)], capture_output=True,
                          text=True, timeout=120, check=False)
    expect(done.returncode == 0, f"a loader in another process failed: {done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return None if found is None else (found[0], Path(found[1]))


def check_versions(spec, model, output_dir: Path, scratch: Path, plugin: str | None = None,
                   other_process: bool = True) -> None:
    """Nothing before the first publish; each published step found right away, complete,
    by this loader, a new one and (``other_process``) one in another process."""
    publisher, loader = make_pair(spec, output_dir)
    expect(loader.latest() is None, f"weight transport '{spec.name}': latest() found {loader.latest()!r} before "
                                    "anything was published")
    published = versions(model, (1, 2, 3), scratch)
    for step, (state, tensors) in published.items():
        publisher.publish(model, step, state)
        check_found(spec, loader.latest(), step, tensors)
        check_found(spec, make_loader(spec, output_dir).latest(), step, tensors)
    state, tensors = published[3]
    publisher.publish(model, 3, state)  # a resumed run publishes its checkpoint's step again
    check_found(spec, loader.latest(), 3, tensors)
    if other_process:
        check_found(spec, latest_elsewhere(plugin, spec.name, output_dir), 3, tensors)


def slow_saves(model, pause: float):
    """``model.save_pretrained`` that writes the config, waits, writes the weights, waits:
    the window in which a careless transport exposes a half-written version."""
    original = model.save_pretrained

    def save_pretrained(path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        time.sleep(pause)
        original(path, *args, **kwargs)
        time.sleep(pause)

    model.save_pretrained = save_pretrained
    return model


def check_never_half_written(spec, model, output_dir: Path, scratch: Path, pause: float = 0.3) -> int:
    """A loader polling while slow publishes run only ever finds complete versions, never an
    older step after a newer one. Returns how many times it looked."""
    published = versions(model, (1, 2), scratch)
    publisher, _ = make_pair(spec, output_dir)
    slow_saves(model, pause)
    loader = make_loader(spec, output_dir)
    done, problems, looks = threading.Event(), [], [0]

    def poll() -> None:
        newest = 0
        while not done.is_set():
            try:
                found = loader.latest()
                looks[0] += 1
                if found is not None:
                    check_found(spec, found, found[0], published[found[0]][1])
                    expect(found[0] >= newest, f"latest() went back from step {newest} to {found[0]}")
                    newest = found[0]
            except (ContractError, KeyError, OSError) as exc:
                problems.append(exc)
                return

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        for step, (state, _) in published.items():
            publisher.publish(model, step, state)
    finally:
        done.set()
        thread.join(30)
    if problems:
        raise ContractError(f"weight transport '{spec.name}': a loader polling during publish saw a half-written "
                            f"version: {problems[0]}") from problems[0]
    return looks[0]


def check_adapter(spec, model, output_dir: Path) -> None:
    """A LoRA ``Adapter`` is published as a PEFT adapter folder holding its tensors."""
    import torch

    from prime_core.weights import Adapter, is_adapter

    generator = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.randn(4, 32, generator=generator),
               f"{prefix}.lora_B.weight": torch.randn(32, 4, generator=generator)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    publisher, loader = make_pair(spec, output_dir)
    publisher.publish(model, 1, Adapter(tensors, config))
    found = loader.latest()
    expect(found is not None and found[0] == 1, f"weight transport '{spec.name}': the adapter of step 1 was not "
                                                f"found ({found!r})")
    path = Path(found[1])
    expect(is_adapter(path), f"weight transport '{spec.name}': {path} is not an adapter folder "
                             f"({Adapter.CONFIG} missing)")
    got = checkpoint_tensors(path)
    expect(set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors),
           f"weight transport '{spec.name}': the published adapter holds other tensors")


class WeightTransportContract(Contract):
    """Subclass with ``name`` set; see the module docstring."""

    registry = "weight_transports"

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, tmp_path_factory):
        return tiny_model(tmp_path_factory.mktemp("tiny"))

    def _plugin_path(self) -> str | None:
        plugin = self.plugin
        return plugin if plugin is None or isinstance(plugin, str) else getattr(plugin, "__name__", None)

    def test_publish_then_latest_is_that_complete_version(self, spec, model, sandbox):
        check_versions(spec, model, sandbox / "run", sandbox / "scratch", self._plugin_path())

    def test_never_a_half_written_version(self, spec, tmp_path_factory, sandbox):
        # Its own model: slow_saves replaces save_pretrained on the instance.
        model = tiny_model(tmp_path_factory.mktemp("slow"))
        check_never_half_written(spec, model, sandbox / "run", sandbox / "scratch")

    def test_lora_adapters_are_published_as_adapter_folders(self, spec, model, sandbox):
        check_adapter(spec, model, sandbox / "run")
