"""The ``nccl`` weight transport's group protocol without vLLM: trainer rank 0 (this process)
and receivers (other processes, gloo on CPU) as the vLLM worker extension uses them. Versions
arrive exactly, in buckets, tied tensors once; a side that dies or never comes stops the other
within ``weight_broadcast.timeout`` with a message naming it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from prime_core.errors import PrimeError

pytest_plugins = ["prime_core.testing"]

RECEIVER = r"""
import sys, time, torch
from pathlib import Path
from prime_plugin_vllm.broadcast import Receiver, read_descriptor
root, out, die_after = Path(sys.argv[1]), Path(sys.argv[3]), int(sys.argv[4])
device, hold = sys.argv[5], sys.argv[6] == "hold"
if device.startswith("cuda"):
    torch.cuda.set_device(device)
steps = [int(s) for s in sys.argv[2].split(",")]
receiver = None
for step in steps:
    folder = root / "weights" / f"step_{step}"
    waited = time.monotonic()
    while not (folder / "STABLE").exists():
        if time.monotonic() - waited > 120:  # the test's trainer side failed: do not outlive it
            sys.exit(4)
        time.sleep(0.02)
    info = read_descriptor(folder)
    if receiver is None:
        receiver = Receiver(info, device=device, label=f"test receiver {out.name}")
    got = {}
    try:
        for i, (name, tensor) in enumerate(receiver.receive(step)):
            if die_after >= 0 and i >= die_after:
                import os; os._exit(3)
            # hold: keep the received views to the end, as a consumer that collects a version first
            got[name] = tensor if hold else tensor.cpu().clone()
    except RuntimeError as exc:
        print("ERROR:", exc, flush=True)
        sys.exit(2)
    torch.save({name: tensor.cpu().clone() for name, tensor in got.items()}, out.with_suffix(f".{step}.pt"))
print("rank", receiver.rank, flush=True)

"""


def state(step: int):
    import torch

    generator = torch.Generator().manual_seed(step)
    embed = torch.randn(64, 16, generator=generator)
    return {"model.embed_tokens.weight": embed,
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=generator).to(torch.bfloat16),
            "model.norm.weight": torch.ones(16) * step,
            "lm_head.weight": embed}  # tied: one storage, sent once


def publisher(out: Path, receivers: int, timeout: float = 20.0, bucket_mb: float = 0.004):
    from prime_plugin_vllm.broadcast import BroadcastPublisher

    config = SimpleNamespace(weight_broadcast=SimpleNamespace(
        host="127.0.0.1", port=0, timeout=timeout, inference_world_size=receivers, bucket_mb=bucket_mb))
    return BroadcastPublisher(config, output_dir=out)


def start_receiver(out: Path, steps, name: str, die_after: int = -1, device: str = "cpu",
                   hold: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RECEIVER, str(out), ",".join(map(str, steps)), str(out / name),
                             str(die_after), device, "hold" if hold else "copy"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_every_version_reaches_every_receiver_exactly(tmp_path):
    import torch

    from prime_plugin_vllm.broadcast import BroadcastLoader, is_broadcast

    # r1 holds every tensor of a version until its end: the buffers its buckets came in are not
    # reused under it (r0 copies each tensor as it comes, and its buffers are reused).
    receivers = [start_receiver(tmp_path, (1, 2), f"r{i}", hold=i == 1) for i in range(2)]
    sender = publisher(tmp_path, 2)
    for step in (1, 2):
        folder = sender.publish(None, step, state(step))
        assert is_broadcast(folder) and not list(folder.glob("*.safetensors"))
        assert BroadcastLoader(output_dir=tmp_path).latest() == (step, folder)
    outputs = [r.communicate(timeout=60)[0] for r in receivers]
    assert all(r.returncode == 0 for r in receivers), outputs
    assert sorted(o.split()[-1] for o in outputs) == ["1", "2"]  # one rank each
    for i in range(2):
        for step in (1, 2):
            got = torch.load(tmp_path / f"r{i}.{step}.pt")
            sent = state(step)
            assert list(got) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                 "model.norm.weight"]
            assert all(torch.equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype for k in got)


@pytest.mark.gpu
def test_the_same_protocol_runs_over_nccl_between_two_gpus(tmp_path):
    """Trainer rank 0 on cuda:0, one receiver on each other GPU: NCCL, the same code."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    count = torch.cuda.device_count() - 1
    receivers = [start_receiver(tmp_path, (1, 2), f"r{i}", device=f"cuda:{i + 1}") for i in range(count)]
    sender = publisher(tmp_path, count)
    for step in (1, 2):
        moved = {}  # tied tensors stay one storage on the GPU, sent once
        sender.publish(None, step, {k: moved.setdefault(id(v), v.to("cuda:0")) for k, v in state(step).items()})
    outputs = [r.communicate(timeout=120)[0] for r in receivers]
    assert all(r.returncode == 0 for r in receivers), outputs
    assert read_descriptor_backend(tmp_path) == "nccl"
    for i in range(count):
        got, sent = torch.load(tmp_path / f"r{i}.2.pt"), state(2)
        assert all(torch.equal(got[k], sent[k]) for k in got) and len(got) == 3


def read_descriptor_backend(out: Path) -> str:
    from prime_plugin_vllm.broadcast import read_descriptor

    return read_descriptor(out / "weights" / "step_2")["backend"]


def test_a_receiver_that_dies_mid_broadcast_stops_the_trainer_naming_the_receivers(tmp_path):
    receivers = [start_receiver(tmp_path, (1,), "alive"), start_receiver(tmp_path, (1,), "dies", die_after=1)]
    sender = publisher(tmp_path, 2, timeout=10.0)
    big = {f"w{i}": __import__("torch").randn(256, 256) for i in range(8)}  # many buckets: the death is mid-way
    start = time.monotonic()
    with pytest.raises(PrimeError) as info:
        sender.publish(None, 1, big)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "weight broadcast of policy v1 failed" in message and "an inference worker stopped receiving" in message
    assert "test receiver" in message  # who the receivers are
    for r in receivers:
        r.kill()
        r.wait()


def test_a_trainer_that_dies_mid_broadcast_stops_the_receiver_naming_the_trainer(tmp_path):
    code = (
        "import sys, os, torch\n"
        "from types import SimpleNamespace\n"
        "from prime_plugin_vllm import broadcast\n"
        "real = broadcast.Sender._send\n"
        "count = [0]\n"
        "def send(self, t):\n"
        "    count[0] += 1\n"
        "    if count[0] > 3: os._exit(5)\n"  # header size, header, one bucket: then dies
        "    return real(self, t)\n"
        "broadcast.Sender._send = send\n"
        "config = SimpleNamespace(weight_broadcast=SimpleNamespace(host='127.0.0.1', port=0, timeout=8.0, "
        "inference_world_size=1, bucket_mb=0.001))\n"
        "p = broadcast.BroadcastPublisher(config, output_dir=sys.argv[1])\n"
        "p.publish(None, 1, {f'w{i}': torch.randn(64, 64) for i in range(6)})\n")
    trainer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    receiver = start_receiver(tmp_path, (1,), "r")
    start = time.monotonic()
    output = receiver.communicate(timeout=60)[0]
    trainer.wait(timeout=30)
    assert trainer.returncode == 5
    assert receiver.returncode == 2, output
    assert time.monotonic() - start < 40
    assert "receiving policy v1 from the trainer" in output and "rank 0) failed" in output
    assert "the trainer stopped sending" in output


def test_receivers_that_never_come_stop_the_trainer_naming_the_inference_side(tmp_path):
    sender = publisher(tmp_path, 2, timeout=1.5)
    start = time.monotonic()
    with pytest.raises(PrimeError) as info:
        sender.publish(None, 1, state(1))
    assert time.monotonic() - start < 10
    assert "0 of 2 inference worker(s) joined" in str(info.value)
    assert "weight_broadcast.timeout" in str(info.value)
    assert (tmp_path / "weights" / "step_1" / "BROADCAST.json").is_file()


def test_lora_adapters_go_through_the_filesystem(tmp_path):
    import torch

    from prime_core.weights import Adapter, is_adapter

    adapter = Adapter({"base_model.model.x.lora_A.weight": torch.ones(2, 4)}, {"peft_type": "LORA", "r": 2})
    folder = publisher(tmp_path, 1).publish(None, 1, adapter)
    assert is_adapter(folder) and (folder / "STABLE").exists()


def test_the_rendezvous_listens_only_where_its_host_says():
    from prime_plugin_vllm.broadcast import Sender

    loopback = Sender(host="127.0.0.1", port=0, world_size=2, device="cpu", timeout=5)
    everywhere = Sender(host=None, port=0, world_size=2, device="cpu", timeout=5)
    try:
        assert loopback.address == "127.0.0.1"
        assert everywhere.address == "0.0.0.0"  # several machines: the host name is advertised
        loopback.prefix.set("probe", "1")  # the store serves on the socket it was given
        assert loopback.prefix.get("probe") == b"1"
    finally:
        loopback.close()
        everywhere.close()


def test_prime_run_counts_the_receivers_for_either_backend(prime_cli, tmp_path):
    import json

    example = Path(__file__).resolve().parents[4] / "examples" / "cpu" / "rl.toml"
    args = ["run", str(example), "--model.name", "Qwen/Qwen3-0.6B", "--weight-broadcast.type", "nccl",
            "--dry-run", "--inference.parallel.dp", "2", "--inference.parallel.tp", "1"]
    cpu = {"HF_HUB_OFFLINE": "0", "CUDA_VISIBLE_DEVICES": ""}  # the CPU example's placement, on a GPU machine too
    result = prime_cli(*args, "--output-dir", str(tmp_path / "a"), env=cpu)
    assert result.exit_code == 0, result.output
    for role in ("trainer", "orchestrator"):
        section = json.loads((tmp_path / "a" / "configs" / f"{role}.json").read_text())["weight_broadcast"]
        assert (section["type"], section["inference_world_size"]) == ("nccl", 2)
        assert section["host"] == "127.0.0.1", "every role on this machine: the rendezvous stays on loopback"
    # the transformers backend receives the broadcast too; no other backend can (WeightTransport.backends)
    other = prime_cli(*args, "--inference.backend", "transformers", "--output-dir", str(tmp_path / "b"), env=cpu)
    assert other.exit_code == 0, other.output
    from prime_core.plugins import get_plugin_manager

    assert get_plugin_manager().select("weight_transports", "nccl", key="weight_broadcast.type").backends == (
        "vllm", "transformers")


def test_bucket_buffers_are_reused_only_once_no_view_of_them_is_held():
    import torch

    from prime_plugin_vllm.broadcast import BucketBuffers

    def held():
        return [buffer.data_ptr() for buffer, _ in buffers._held]

    buffers = BucketBuffers("cpu")
    first = buffers.take(100)
    second = buffers.take(100)  # the first is in use: another one
    assert held() == [first.data_ptr(), second.data_ptr()]
    kept = first[10:20].view(torch.int16)  # a consumer keeps a tensor of the first bucket
    del first
    third = buffers.take(60)  # both still in use (kept and second are alive): a new one
    assert third.data_ptr() not in (kept.data_ptr() - 10, second.data_ptr())
    assert len(held()) == 2 and third.data_ptr() in held()  # it took the place of one of them
    del kept, third
    again = buffers.take(100)  # the 60-byte one is free but too small, the second in use: a new one
    assert again.numel() == 100 and again.data_ptr() != second.data_ptr()
    del again, second
    reused = buffers.take(100)  # nothing holds the 100-byte ones any more: one of them again
    assert reused.data_ptr() in held()


def test_bucket_buffers_on_other_devices_are_never_held():
    from prime_plugin_vllm.broadcast import BucketBuffers

    buffers = BucketBuffers("meta")
    buffers.take(100)
    buffers.take(100)
    assert buffers._held == []
