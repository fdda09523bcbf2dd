"""The ``ipc`` weight transport on this CPU machine (the slots are mapped files) and, marked
``gpu``, through CUDA IPC (``test_gpu.py`` runs ``prime run`` with it on one GPU): another process copies in exactly
the tensors published, a reused slot gives its newer version and says so, the trainer waits
for a server still copying, and wrong setups are refused with the way out."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_core.errors import PrimeError


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2, dtype="float32")


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32")


def versions(model, steps, publisher) -> dict[int, dict]:
    """Publish ``steps``, each a fresh random change of the weights; each one's tensors."""
    import torch

    out = {}
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        publisher.publish(model, step, None)
        out[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def same(model, tensors: dict) -> bool:
    import torch

    return all(torch.equal(v, tensors[k]) for k, v in model.state_dict().items())


READER = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from prime_plugin_transformers.shared_weights import Mapped, staged
from prime_plugin_transformers.weights import apply

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="float32").to(sys.argv[3])
mapped, out = Mapped(), {}
for step in sys.argv[4:]:
    with staged(model, Path(sys.argv[2]) / f"step_{step}", mapped) as s:
        apply(model, s)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(sys.argv[2]) / f"read_{step}.pt")
    out[step] = [s.step, s.how]
print(json.dumps(out))
"""


def check_another_process_reads(folder: Path, out: Path, device: str) -> str:
    """Publish two versions from a model on ``device``; a server process on ``device`` copies in
    exactly each one. Returns how it read them."""
    import torch

    from prime_plugin_transformers.shared_weights import SharedPublisher

    publisher = SharedPublisher(output_dir=out)
    published = versions(load(folder).to(device), (1, 2), publisher)
    weights = out / "weights"
    run = subprocess.run([sys.executable, "-c", READER, str(folder), str(weights), device, "1", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout.splitlines()[-1])
    assert {k: v[0] for k, v in answer.items()} == {"1": 1, "2": 2}
    for step in (1, 2):
        read = torch.load(weights / f"read_{step}.pt")
        assert read.keys() == published[step].keys()
        assert all(torch.equal(read[k], published[step][k].cpu()) for k in read), f"step {step} differs"
    assert not any(weights.glob("step_*/*.safetensors"))  # nothing was written as files
    return answer["1"][1]


def test_another_process_copies_in_exactly_the_tensors_published(folder, tmp_path):
    assert "a shared file" in check_another_process_reads(folder, tmp_path, "cpu")


@pytest.mark.gpu
def test_on_a_gpu_another_process_copies_them_in_through_cuda_ipc(folder, tmp_path):
    assert "CUDA IPC" in check_another_process_reads(folder, tmp_path, "cuda")


def test_a_reused_slot_gives_its_newer_version_and_says_which(folder, tmp_path):
    from prime_plugin_transformers.shared_weights import Mapped, SharedPublisher, staged
    from prime_plugin_transformers.weights import apply

    published = versions(load(folder), (1, 2, 3), SharedPublisher(output_dir=tmp_path))
    server = load(folder)
    with staged(server, tmp_path / "weights" / "step_1", Mapped()) as s:  # slot 1 now holds step 3
        apply(server, s)
    assert s.step == 3 and same(server, published[3])


def test_the_trainer_waits_for_a_server_still_copying_its_slot(folder, tmp_path):
    from prime_plugin_transformers.shared_weights import Mapped, SharedPublisher, staged

    model, publisher = load(folder), SharedPublisher(output_dir=tmp_path)
    versions(model, (1, 2), publisher)
    done = threading.Event()
    with staged(load(folder), tmp_path / "weights" / "step_1", Mapped()):
        writer = threading.Thread(target=lambda: (publisher.publish(model, 3, None), done.set()))
        writer.start()  # step 3 goes to slot 1, which this server holds
        time.sleep(0.5)
        assert not done.is_set()
    writer.join(30)
    assert done.is_set() and (tmp_path / "weights" / "step_3" / "STABLE").exists()


def test_a_server_on_another_machine_is_refused_with_the_way_out(folder, tmp_path):
    from prime_plugin_transformers.shared_weights import Mapped, SharedPublisher, staged
    from prime_plugin_transformers.weights import WeightsError

    versions(load(folder), (1,), SharedPublisher(output_dir=tmp_path))
    header = tmp_path / "weights" / "shared" / "slot_1.json"
    data = json.loads(header.read_text())
    data["opens"]["host"] = "elsewhere"
    header.write_text(json.dumps(data))
    with pytest.raises(WeightsError, match="runs on elsewhere.*one machine.*'filesystem'"):
        with staged(load(folder), tmp_path / "weights" / "step_1", Mapped()):
            pass


def test_another_model_and_lora_adapters_are_refused(folder, tmp_path):
    import torch

    from prime_core.weights import Adapter
    from prime_plugin_transformers.shared_weights import SharedPublisher
    from prime_plugin_transformers.weights import WeightsError

    model, publisher = load(folder), SharedPublisher(output_dir=tmp_path)
    with pytest.raises(PrimeError, match="LoRA"):
        publisher.publish(model, 1, Adapter({"a": torch.zeros(2)}, {}))
    publisher.publish(model, 1, None)
    with pytest.raises(PrimeError, match="laid out unlike"):
        publisher.publish(model, 2, {"other.weight": torch.zeros(3)})

    from prime_plugin_hf.tiny import build_tiny
    from prime_plugin_transformers.shared_weights import Mapped, staged

    other = load(build_tiny(tmp_path / "other", hidden_size=32, num_layers=1, dtype="float32"))
    with pytest.raises(WeightsError, match="does not match the served model|other shapes"):
        with staged(other, tmp_path / "weights" / "step_1", Mapped()):
            pass


@pytest.mark.parametrize(("tokens", "problem"), [
    (["--inference.backend", "vllm"], "is read by the 'transformers' inference backend(s) only, and inference."
                                      "backend is 'vllm'"),
    (["--inference.backend", "transformers", "--deployment.trainer-gpu-ids", "[1]",
      "--deployment.inference-gpu-ids", "[0]"], "share none: name one GPU for both"),
])
def test_configs_it_cannot_serve_are_refused_when_loaded(tokens, problem):
    from prime_core.cli.common import load_config
    from prime_core.config.checks import check

    config = load_config("rl", ["--model.name", "x", "--weight-broadcast.type", "ipc", *tokens])
    assert any(problem in p for p in check(config, "rl")), check(config, "rl")
    config = load_config("rl", ["--model.name", "x", "--weight-broadcast.type", "ipc", "--inference.backend",
                                "transformers"])
    assert not [p for p in check(config, "rl") if "ipc" in p]
