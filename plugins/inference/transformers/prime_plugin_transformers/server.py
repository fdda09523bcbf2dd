"""The ``transformers`` server, inside the ``inference`` role's own process.

``start()`` binds the port at once (a taken port is reported before anything loads) and
answers HTTP from a background thread (``GET /health`` says 503 until the model is served);
``wait_healthy()`` loads the model in the calling thread, the role's main thread: started from
another thread, transformers' generation thread ran 10-30 times slower on a CPU (torch's
OpenMP threads fight), so the load is not in a thread of its own and ``startup_timeout`` cannot
cut it short. Nothing runs in a child process, so nothing can outlive the role: ``stop()`` stops
the generation loop and closes the socket, and the remaining threads are daemons. The engine's
log (model, device, KV-cache sizing, each weight load, what each version of the weights
served) goes to ``output_dir/logs/transformers-PORT.log``, with transformers' own messages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from prime_core.errors import PrimeError
from prime_core.launch.supervise import tail

LOGGERS = ("prime.transformers", "transformers", "ContinuousBatchingLogger")
LOG_TAIL_LINES = 30
LOAD_ERRORS = (OSError, ValueError, RuntimeError, ImportError, KeyError, TypeError, AttributeError, MemoryError)
"""What loading a model can raise; anything else (the role's stop signal) passes through."""


class _State:
    engine = None
    failure: str | None = None


class TransformersServer:
    """One replica: an ``Engine`` behind the HTTP API, configured by an ``InferenceConfig``."""

    def __init__(self, config) -> None:
        self.config = config
        self.state = _State()
        self._httpd = None
        self._engine = None
        self._stopped = threading.Event()
        self._start_lock = threading.Lock()
        self._log_handler: logging.Handler | None = None

    @property
    def base_url(self) -> str:
        from prime_core.inference.replicas import local_url

        return local_url(self.config.server.host, self.config.server.port)

    @property
    def log_path(self) -> Path:
        return Path(self.config.output_dir) / "logs" / f"transformers-{self.config.server.port}.log"

    def start(self) -> None:
        from prime_plugin_transformers.api import Server, handler

        if self._httpd is not None:
            raise PrimeError(f"the transformers server on port {self.config.server.port} is already started")
        host, port = self.config.server.host, self.config.server.port
        try:
            self._httpd = Server((host, port), handler(self.state))
        except OSError as exc:
            raise PrimeError(
                f"inference.server.port = {port}: cannot serve on {host}:{port} ({exc.strerror or exc}); another "
                "process (maybe an earlier inference server) is using it",
                hint="stop that process, or pick a free port with --inference.server.port "
                     "(--server.port for `prime inference`)") from None
        self._open_log()
        threading.Thread(target=self._httpd.serve_forever, name="prime-http", daemon=True).start()

    def _open_log(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        level = getattr(logging, self.config.log.level.upper(), logging.INFO)
        handler.setLevel(level)
        for name in LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(handler)
            if logger.level == logging.NOTSET or logger.level > level:
                logger.setLevel(level)
        self._log_handler = handler

    def _load(self) -> None:
        from prime_plugin_transformers.engine import Engine

        os.environ.update(self.config.env)
        engine = Engine(self.config)
        with self._start_lock:  # stop() from another thread during loading: the engine never serves
            if self._stopped.is_set():
                return
            self._engine = engine
        try:
            engine.load()
        except LOAD_ERRORS as exc:
            logging.getLogger("prime.transformers").exception("loading %s failed", self.config.model.name)
            self.state.failure = f"loading {self.config.model.name} failed: {type(exc).__name__}: {exc}"
            return
        if self._stopped.is_set():
            engine.stop()
            return
        self.state.engine = engine

    def _failure(self, what: str, hint: str | None = None) -> PrimeError:
        return PrimeError(f"{what}\n--- last lines of {self.log_path} ---\n{tail(self.log_path, LOG_TAIL_LINES)}",
                          hint=hint)

    def wait_healthy(self, timeout: float) -> None:
        """Load the model here (see the module's docstring), then wait until it serves."""
        if self._httpd is None:
            raise PrimeError("the transformers server was not started")
        if self.state.engine is None and self.state.failure is None:
            self._load()
        deadline = time.monotonic() + timeout
        while True:
            if self.state.failure:
                raise self._failure(f"the transformers server failed to start: {self.state.failure}")
            engine = self.state.engine
            if engine is not None:
                if engine.alive():
                    return
                raise self._failure(f"the transformers server stopped while starting: {engine.death()}")
            if self._stopped.is_set():
                raise PrimeError("the transformers server was stopped while it was starting")
            if time.monotonic() >= deadline:
                raise self._failure(f"the transformers server did not become healthy within {timeout:g} s "
                                    f"(inference.startup_timeout); log: {self.log_path}",
                                    hint="raise inference.startup_timeout if it was still loading the model")
            time.sleep(0.2)

    def wait(self) -> int:
        """Block until ``stop()`` (0) or until the engine dies (1, after logging why)."""
        while not self._stopped.wait(0.5):
            engine = self.state.engine
            reason = self.state.failure or (engine.death() if engine is not None and not engine.alive() else None)
            if reason:
                logging.getLogger("prime.transformers").error("the transformers server stops: %s", reason)
                print(f"error: the transformers server stops: {reason}", flush=True)
                return 1
        return 0

    def stop(self) -> None:
        """Stop the engine and close the socket. Idempotent."""
        with self._start_lock:
            self._stopped.set()
            engine = self._engine
        if engine is not None:
            engine.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._log_handler is not None:
            for name in LOGGERS:
                logging.getLogger(name).removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
