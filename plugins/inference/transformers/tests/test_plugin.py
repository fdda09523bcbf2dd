"""The plugin without a server: ``auto`` picks it where vLLM is not installed, configs it cannot
serve are refused at load time with the key and the way out, and the memory sizing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_core.errors import PrimeError
from prime_core.testing import free_ports

pytest_plugins = ["prime_core.testing"]


def manager_with(*plugins: str):
    import importlib

    from prime_core.testing import fresh_manager

    manager = fresh_manager()
    for name in plugins:
        manager.register(importlib.import_module(name), name=name.split(".")[0].removeprefix("prime_plugin_"),
                         check_api=True)
    return manager


def test_auto_takes_transformers_where_vllm_is_not_installed_and_says_so():
    from prime_core.inference.backend import describe, select_backend

    alone = manager_with("prime_plugin_transformers.plugin")
    spec = select_backend("auto", key="inference.backend", manager=alone)
    assert spec.name == "transformers"
    assert describe(spec, "auto") == "transformers (auto: the available backend with the highest priority)"


def test_auto_prefers_vllm_where_it_runs():
    pytest.importorskip("prime_plugin_vllm")
    from prime_core.inference.backend import select_backend

    both = manager_with("prime_plugin_transformers.plugin", "prime_plugin_vllm.plugin")
    vllm = both.registry("inference_backends")["vllm"].spec
    expected = "vllm" if vllm.unavailable_reason() is None else "transformers"
    assert select_backend("auto", key="inference.backend", manager=both).name == expected


def test_available_needs_transformers_5_17(monkeypatch):
    import importlib.metadata

    from prime_plugin_transformers import plugin

    assert plugin.available() is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.16.1")
    assert "older than 5.17" in plugin.available()


def prime(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prime_core", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


BAD = """
[inference]
backend = "transformers"
[inference.args]
max_num_seqs = 8
enable_prefix_caching = true
num_blocks = 64
bogus = 1
return_logprobs = false
allow_block_sharing = false
attn_implementation = "sdpa"
[inference.parallel]
tp = 2
[orchestrator.sampling]
seed = 3
[[orchestrator.env]]
id = "arithmetic"
"""


def test_configs_it_cannot_serve_are_refused_with_the_key_and_the_way_out(tmp_path):
    pytest.importorskip("prime_plugin_lora")
    (tmp_path / "bad.toml").write_text(BAD)
    result = prime("config", "validate", str(tmp_path / "bad.toml"), "--trainer.model.lora.rank", "8")
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout + result.stderr
    bad = f"(from {tmp_path / 'bad.toml'})"  # the file that set the key (an option typed is not named)
    for expected in (
        "inference.lora: the transformers backend serves full weights only, not LoRA adapters",
        f"(trainer.model.lora needs inference.backend {bad} = 'vllm')",
        f"inference.parallel.tp {bad} = 2: the transformers backend has no tensor parallelism",
        f"inference.args.max_num_seqs {bad} is a vLLM option the transformers backend does not have: its "
        "equivalent is inference.args.max_requests_per_batch",
        f"inference.args.enable_prefix_caching {bad} is a vLLM option the transformers backend does not have: "
        "this backend has no prefix caching",
        f"inference.args.bogus {bad}: not a continuous-batching option of this transformers (options: ",
        f"inference.args.return_logprobs {bad}: set by the transformers backend",
        f"orchestrator.sampling.seed {bad} = 3: the transformers backend has no per-request seeds",
    ):
        assert expected in out, out
    for accepted in ("num_blocks", "allow_block_sharing", "attn_implementation"):
        assert f"inference.args.{accepted}" not in out


def test_auto_is_checked_as_the_backend_it_selects(tmp_path):
    (tmp_path / "c.toml").write_text('[inference.parallel]\ntp = 2\n[[orchestrator.env]]\nid = "arithmetic"\n')
    without_vllm = prime("config", "validate", str(tmp_path / "c.toml"), env={"PRIME_DISABLED_PLUGINS": "vllm"})
    assert without_vllm.returncode == 2 and "the transformers backend has no tensor parallelism" in without_vllm.stderr
    from types import SimpleNamespace

    from prime_plugin_transformers.validate import problems

    inference = SimpleNamespace(backend="transformers", lora=None, parallel=SimpleNamespace(tp=4), args={})
    assert problems(inference, "inference") == [
        "parallel.tp = 4: the transformers backend has no tensor parallelism (one replica is one device); use "
        "parallel.dp replicas, or the vllm backend"]
    inference.backend = "vllm"
    assert problems(inference, "inference") == []
    # a run on servers started elsewhere (--no-inference) has no [inference] section
    orchestrator = SimpleNamespace(client=SimpleNamespace(backend="transformers"), sampling=SimpleNamespace(seed=None),
                                   weight_broadcast=None)
    assert problems(SimpleNamespace(inference=None, orchestrator=orchestrator), "rl") == []


def test_one_gpu_is_shared_by_naming_it_for_both_roles(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "rl.toml").write_text('max_steps = 2\n[inference]\nbackend = "transformers"\n'
                                      '[[orchestrator.env]]\nid = "arithmetic"\n')
    result = prime("run", str(tmp_path / "rl.toml"), "--output-dir", str(run), "--deployment.inference-gpu-ids", "0",
                   "--deployment.trainer-gpu-ids", "0", "--inference.gpu-memory-utilization", "0.3", "--dry-run",
                   env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads((run / "configs" / "plan.json").read_text())
    gpus = {p["role"]: p["env"].get("CUDA_VISIBLE_DEVICES") for p in plan["processes"]}
    assert gpus == {"inference": "0", "orchestrator": None, "trainer": "0"}
    inference = json.loads((run / "configs" / "inference.json").read_text())
    assert inference["backend"] == "transformers" and inference["gpu_memory_utilization"] == 0.3


def test_gpu_memory_utilization_bounds_what_the_server_holds_in_all():
    from prime_plugin_transformers.cb_config import CUDA_CONTEXT_BYTES, HEADROOM, gpu_memory_percent

    gib = 2**30
    # 80 GiB GPU, 20 GiB free (a trainer holds the rest), the model holds 4 GiB: at 0.5 the
    # server may take 40 GiB in all, so 36 GiB minus the CUDA context more.
    share = gpu_memory_percent(0.5, total=80 * gib, free=20 * gib, held=4 * gib)
    assert share == 1.0  # more than is free: take what is free
    share = gpu_memory_percent(0.3, total=80 * gib, free=70 * gib, held=4 * gib)
    assert share * 70 * gib == pytest.approx(HEADROOM * (0.3 * 80 * gib - 4 * gib - CUDA_CONTEXT_BYTES))
    with pytest.raises(ValueError, match="raise it"):
        gpu_memory_percent(0.05, total=80 * gib, free=70 * gib, held=4 * gib)


def test_attention_defaults_to_prime_varlen_only_where_it_runs():
    import torch

    from prime_plugin_transformers import torch_flash
    from prime_plugin_transformers.engine import choose_attention

    assert torch_flash.unavailable_reason(torch.float32) is not None
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallbacks")
    assert choose_attention(None, torch.bfloat16) == "sdpa"
    assert choose_attention("eager", torch.bfloat16) == "eager"
    with pytest.raises(ValueError, match="inference.args.attn_implementation = 'prime_varlen': it needs a CUDA GPU"):
        choose_attention("prime_varlen", torch.bfloat16)


def test_prime_varlen_turns_on_cuda_graphs_and_async_batching_unless_args_say_otherwise():
    from types import SimpleNamespace

    import torch

    from prime_plugin_transformers.cb_config import cb_fields, settings

    def config(args):
        return SimpleNamespace(args=args, gpu_memory_utilization=0.5)

    def model(attention):
        return SimpleNamespace(dtype=torch.bfloat16, config=SimpleNamespace(_attn_implementation=attention))

    fields = cb_fields()
    out = settings(config({"num_blocks": 64}), model("paged|prime_varlen"), device="cuda", fields=fields)
    assert out["use_cuda_graph"] is True and out["use_async_batching"] is True
    out = settings(config({"num_blocks": 64, "use_cuda_graph": False}), model("prime_varlen"), device="cuda",
                   fields=fields)
    assert out["use_cuda_graph"] is False
    out = settings(config({"num_blocks": 64}), model("paged|sdpa"), device="cuda", fields=fields)
    assert "use_cuda_graph" not in out and "use_async_batching" not in out


def test_the_paged_cache_is_sized_without_masks_for_prime_varlen_which_builds_none():
    """transformers builds attention masks for eager and sdpa only, but its cache sizing counts
    one for every implementation but flash: for prime_varlen the sizing is told the truth."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching import cache
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed
    from transformers.utils.generic import is_flash_attention_requested

    from prime_plugin_transformers import torch_flash

    torch_flash.register()
    torch_flash.register()  # idempotent: wrapped once
    asked = cache.is_flash_attention_requested
    assert asked.prime_varlen_aware
    for name in ("prime_varlen", "paged|prime_varlen"):
        config = SimpleNamespace(_attn_implementation=name)
        assert asked(config) and not attn_mask_is_needed(config)
    for name in ("sdpa", "paged|sdpa", "paged|eager"):  # every other name: answered as before
        config = SimpleNamespace(_attn_implementation=name)
        assert asked(config) is is_flash_attention_requested(config) is False
    assert not asked(SimpleNamespace(_attn_implementation="paged|prime_varlen"), version=2)  # not flash itself


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from prime_core.testing.chat import chat_tokenizer
    from prime_core.testing.contracts.model_impl import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny")
    chat_tokenizer().save_pretrained(folder)
    return folder


def test_a_taken_port_is_refused_before_the_model_loads(model_dir, tmp_path):
    import socket

    from prime_core.cli.common import load_config
    from prime_plugin_transformers.server import TransformersServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = load_config("inference", ["--model.name", str(model_dir), "--backend", "transformers",
                                           "--server.port", str(port), "--output-dir", str(tmp_path)])
        server = TransformersServer(config)
        with pytest.raises(PrimeError, match=f"inference.server.port = {port}: cannot serve"):
            server.start()
        server.stop()


def test_a_model_that_cannot_load_fails_the_start_with_the_log(tmp_path):
    import torch
    from safetensors.torch import save_file

    from prime_core.cli.common import load_config
    from prime_core.testing.chat import chat_tokenizer
    from prime_plugin_transformers.server import TransformersServer

    folder = tmp_path / "not-a-model"  # passes the config's cheap checks; no architecture loads it
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    save_file({"weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    chat_tokenizer().save_pretrained(folder)
    config = load_config("inference", ["--model.name", str(tmp_path / "not-a-model"), "--backend", "transformers",
                                       "--server.port", str(free_ports(1)), "--output-dir", str(tmp_path)])
    server = TransformersServer(config)
    server.start()
    try:
        with pytest.raises(PrimeError, match="failed to start: loading .*not-a-model failed") as err:
            server.wait_healthy(120)
        assert "last lines of" in str(err.value) and Path(server.log_path).exists()
        assert server.wait() == 1
    finally:
        server.stop()
        server.stop()
