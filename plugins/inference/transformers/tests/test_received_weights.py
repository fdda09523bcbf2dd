"""The transformers engine receiving the ``nccl`` weight transport (gloo on this CPU machine,
the same code as NCCL on GPUs): trainer rank 0 in a thread of this process broadcasts two
versions of fresh random weights and a serving engine loads exactly each one, joining the group
once; a version announced by a trainer that never sends fails with a message naming it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("prime_plugin_vllm", reason="the nccl transport is prime-plugin-vllm's")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2, dtype="float32")


def engine_for(model: Path, out: Path):
    from prime_core.cli.common import load_config
    from prime_plugin_transformers.engine import Engine

    config = load_config("inference", ["--model.name", str(model), "--backend", "transformers", "--output-dir",
                                       str(out), "--model.dtype", "float32"])
    engine = Engine(config)
    engine.load()
    return engine


def broadcast_publisher(out: Path, timeout: float = 60.0):
    from prime_plugin_vllm.broadcast import BroadcastPublisher

    config = SimpleNamespace(weight_broadcast=SimpleNamespace(
        host="127.0.0.1", port=0, timeout=timeout, inference_world_size=1, bucket_mb=0.05))
    return BroadcastPublisher(config, output_dir=out)


def test_an_engine_loads_exactly_each_broadcast_version_while_serving(folder, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    publisher, engine = broadcast_publisher(tmp_path), engine_for(folder, tmp_path / "server")
    try:
        prompt = {"prompt_ids": list(range(5, 20)), "n": 1, "max_tokens": 6, "temperature": 0.0}
        before = engine.sample(prompt)[0]["logprobs"]
        for step in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            sending = threading.Thread(target=publisher.publish, args=(trainer, step, None))
            sending.start()
            announced = tmp_path / "weights" / f"step_{step}"
            while not (announced / "STABLE").exists():
                time.sleep(0.01)
            reply = engine.load_weights(str(announced), step)
            sending.join(60)
            assert not sending.is_alive()
            assert reply["step"] == step and reply["how"].startswith("received over gloo")
            served = engine.model.state_dict()
            assert all(torch.equal(served[k], v) for k, v in trainer.state_dict().items()), f"step {step} differs"
        assert engine._receiving.receiver.rank == 1  # joined once, for both versions
        assert engine.sample(prompt)[0]["logprobs"] != pytest.approx(before, abs=1e-6)
    finally:
        engine.stop()


def test_a_trainer_that_never_sends_fails_the_load_naming_it(folder, tmp_path):
    import json

    from prime_core.ports import free_ports
    from prime_plugin_vllm.broadcast import DESCRIPTOR

    engine = engine_for(folder, tmp_path / "server")
    announced = tmp_path / "weights" / "step_1"
    announced.mkdir(parents=True)
    (announced / DESCRIPTOR).write_text(json.dumps({
        "host": "127.0.0.1", "port": free_ports(1), "group": "gone", "world_size": 2, "backend": "gloo",
        "timeout": 5, "step": 1}))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        with pytest.raises(RuntimeError, match="cannot reach the trainer's weight broadcast"):
            engine.load_weights(str(announced), 1)
        assert all((engine.model.state_dict()[k] == v).all() for k, v in before.items())  # nothing changed
    finally:
        engine.stop()
