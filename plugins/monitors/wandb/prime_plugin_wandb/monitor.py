"""The ``wandb`` monitor: one W&B run per RL run (trainer and orchestrator), one per SFT run.

How the roles of an RL run meet in one W&B run:

- The run id is ``wandb.id`` when set, else a new id kept in ``output_dir/logs/wandb-run-id``
  (whichever role starts first creates it, atomically; the other reads it). ``--clean``
  deletes ``logs/`` and so starts a new W&B run; ``--resume`` keeps it and continues the run.
- Online, both roles join the run in wandb's shared mode (``mode="shared"``, labelled by
  role; the trainer is the primary writer).
- Offline, each role writes its own transaction log of that same run id under
  ``<dir>/wandb/offline-run-<time>-<id>-<role>/``; ``wandb sync`` uploads the logs of one run
  id into that one run, in order of start time.
- Every metric is logged as ``<role>/<name>`` against its own step key ``<role>/step``, so
  the two roles never collide and each has its own x axis.

The network is never waited on for long: no API key, ``offline = true``, ``WANDB_MODE`` or an
unreachable server (a 3 s connection probe) mean offline mode, announced in the role's log
with the ``wandb sync`` command to upload the run later. ``wandb`` is imported here, on first
use, never when the plugin is loaded.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import secrets
import socket
import string
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from prime_core.errors import PrimeError

RUN_ID_FILE = Path("logs") / "wandb-run-id"
SHARED_ROLES = ("trainer", "orchestrator")
PRIMARY = "trainer"
DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 3.0
INIT_TIMEOUT_S = 30.0
JOIN_PATIENCE_S = 30.0
"""Online, a non-primary role retries joining the shared run (5 s apart) for this long before it
logs offline instead: the primary may not have created the run yet."""


def missing() -> str | None:
    """``available()``: why the monitor cannot run here, or ``None``."""
    if importlib.util.find_spec("wandb") is None:
        return "the wandb package is not installed: pip install prime-plugin-wandb (or pip install wandb)"
    return None


def say(role: str, message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] wandb ({role}): {message}", flush=True)


# ---------------------------------------------------------------------------- offline or not


def base_url() -> str:
    return os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL


def missing_credentials(url: str | None = None) -> str | None:
    """``None`` when wandb would find an API key (``WANDB_API_KEY``, an identity token file, or a
    ``.netrc`` entry for the server), else the reason, as a user reads it in the log."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(url or base_url()).netloc
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        if host and netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return f"no W&B API key (WANDB_API_KEY is unset and {path} has no entry for {host})"


def unreachable(url: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """``None`` when a TCP connection to the W&B server opens within ``timeout`` seconds (name
    lookup included), else why not."""
    parts = urlsplit(url or base_url())
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=probe, daemon=True)  # name lookups ignore socket timeouts
    thread.start()
    thread.join(timeout + 1.0)
    if not outcome:
        return f"cannot reach {host}:{port} (no answer within {timeout:.0f} s)"
    return None if outcome[0] is None else f"cannot reach {host}:{port} ({outcome[0]})"


def choose_mode(cfg) -> tuple[str, str]:
    """(``online`` | ``offline`` | ``disabled``, why): ``WANDB_MODE`` first, then the config, then
    credentials and the network."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env == "disabled":
        return "disabled", "WANDB_MODE=disabled"
    if env in ("offline", "dryrun"):
        return "offline", f"WANDB_MODE={env}"
    if cfg.offline:
        return "offline", "wandb.offline = true"
    why = missing_credentials() or unreachable()
    return ("offline", why) if why else ("online", "")


# ---------------------------------------------------------------------------- the run id


def _new_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def shared_run_id(output_dir: Path) -> str:
    """The W&B run id of the run in ``output_dir``: read from ``logs/wandb-run-id``, or created
    there (``O_EXCL``: of two roles starting at once, exactly one writes it)."""
    path = Path(output_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        for _ in range(50):  # the other role may be between creating and writing it
            run_id = path.read_text(encoding="utf-8").strip()
            if run_id:
                return run_id
            time.sleep(0.1)
        raise PrimeError(f"{path} is empty: it should hold the W&B run id of this output_dir",
                         hint="delete it to start a new W&B run, or set wandb.id") from None
    run_id = _new_id()
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    return run_id


# ---------------------------------------------------------------------------- the monitor


class WandbMonitor:
    """``make(config, *, output_dir, role)`` of the ``wandb`` monitor (see the module doc)."""

    def __init__(self, config=None, *, output_dir: str | Path, role: str) -> None:
        from prime_plugin_wandb.config import WandbConfig

        cfg = getattr(config, "wandb", None) or WandbConfig()
        self.role = role
        self.step_key = f"{role}/step"
        self.run = None
        self._warned = False
        self.mode, why = choose_mode(cfg)
        if self.mode == "disabled":
            say(role, f"disabled ({why}): nothing is logged to W&B")
            return
        if cfg.log_extras is not None:
            say(role, "wandb.log_extras is accepted for prime-rl configs, but prime logs scalar metrics only: "
                      "no sample tables or distributions are logged")
        output_dir = Path(output_dir).resolve()
        self.shared = cfg.shared and role in SHARED_ROLES and not getattr(config, "bench", None)
        self.run_id = cfg.id or shared_run_id(output_dir)
        name = cfg.name or output_dir.name
        if role in SHARED_ROLES and not cfg.shared:
            self.run_id, name = f"{self.run_id}-{role}", f"{name}-{role}"
        self.root = output_dir / cfg.dir if cfg.dir is not None else output_dir
        try:
            import wandb
        except ImportError as exc:
            raise PrimeError(f"the wandb monitor needs the wandb package ({exc})",
                             hint="pip install prime-plugin-wandb") from None
        self.root.mkdir(parents=True, exist_ok=True)
        # wandb's own logs and caches go beside the run instead of the user's home, unless set.
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.root / "wandb" / "cache"))
        run_config = config.model_dump(mode="json") if hasattr(config, "model_dump") else {}
        self.init_args = {"project": cfg.project, "entity": cfg.entity, "name": name, "group": cfg.group,
                          "tags": cfg.tags, "id": self.run_id, "resume": "allow", "dir": str(self.root),
                          "config": {role: run_config}, "reinit": "create_new"}
        if self.mode == "online":
            self.run = self._init_online(wandb)
        if self.run is None:
            if self.mode == "online":
                why = "the online run could not start (see above)"
            self.mode = "offline"
            self.run = self._init(wandb, wandb.Settings(mode="offline", x_label=role,
                                                        x_sync_dir_suffix=role if self.shared else ""))
            say(role, f"OFFLINE mode, because of: {why}. The {role} metrics of W&B run {self.run_id} are written "
                      f"to {self.run_dir()} and nothing is uploaded; upload later with: {self.sync_command()}")
        else:
            say(role, f"logging {role} metrics to {self.run.url} (run {self.run_id}"
                      + (", shared with the other role)" if self.shared else ")"))
        self.run.define_metric(f"{role}/*", step_metric=self.step_key)

    def _init(self, wandb, settings):
        try:
            return wandb.init(**self.init_args, settings=settings)
        except Exception as exc:  # noqa: BLE001 -- whatever wandb raises, the user gets one clear error
            raise PrimeError(f"wandb could not start the {settings.mode} run {self.run_id} in {self.root}: "
                             f"{type(exc).__name__}: {exc}",
                             hint="see the wandb messages above; remove the [wandb] table to run without it") from None

    def _init_online(self, wandb):
        primary = self.role == PRIMARY
        if self.shared:
            settings = wandb.Settings(mode="shared", x_label=self.role, x_primary=primary,
                                      x_update_finish_state=primary, init_timeout=INIT_TIMEOUT_S)
        else:
            settings = wandb.Settings(mode="online", init_timeout=INIT_TIMEOUT_S)
        patience = JOIN_PATIENCE_S if self.shared and not primary else 0.0
        start = time.monotonic()
        while True:
            try:
                return wandb.init(**self.init_args, settings=settings)
            except Exception as exc:  # noqa: BLE001 -- any failure online falls back to offline
                retry = time.monotonic() - start + 5 < patience
                say(self.role, f"online init failed ({type(exc).__name__}: {exc})"
                               + ("; retrying in 5 s" if retry else ""))
                wandb.teardown()  # a failed init keeps the run id registered in the wandb service
                if not retry:
                    return None
                time.sleep(5)

    def run_dir(self) -> Path:
        return Path(self.run.settings.sync_dir) if self.run is not None else self.root / "wandb"

    def sync_command(self) -> str:
        return f"wandb sync {self.root / 'wandb'}/offline-run-*-{self.run_id}*"

    def log(self, metrics: dict, step: int) -> None:
        if self.run is None:
            return
        row = {f"{self.role}/{key}": value for key, value in metrics.items()}
        row[self.step_key] = step
        try:
            self.run.log(row)
        except Exception as exc:  # noqa: BLE001 -- a metrics sink never stops training; metrics.jsonl has every step
            if not self._warned:
                say(self.role, f"logging step {step} failed ({type(exc).__name__}: {exc}); W&B logging stops here, "
                               "metrics.jsonl keeps every step")
                self._warned = True
            self.run = None

    def close(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        run.finish()
        if self.mode == "offline":
            say(self.role, f"offline run written to {run.settings.sync_dir}; upload with: {self.sync_command()}")
