"""Inference replicas: ``inference.parallel.dp = N`` is N independent servers.

Each replica is one ``prime inference`` process with its own resolved config file: the
inference config with ``parallel.dp = 1`` and port ``server.port + i``. With one replica
that file is ``configs/inference.json`` itself; with N > 1, ``configs/inference.json``
describes all of them (``prime inference`` on it starts N) and replica i runs
``configs/inference_i.json``. Launchers start the replica files and give each ``tp`` GPUs;
the orchestrator gets one URL per replica (``orchestrator.client.base_url``).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    config: Path
    """Its resolved config file (written by ``write_replicas``)."""
    url: str
    """Its OpenAI API root as seen from this machine (``http://127.0.0.1:PORT/v1``)."""


def local_url(host: str, port: int) -> str:
    """``http://HOST:PORT/v1``, with a wildcard bind address reached through loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def replica_paths(path: Path, dp: int) -> list[Path]:
    """The config file of each replica: ``path`` itself for one, ``<stem>_<i>.json`` for several."""
    path = Path(path)
    if dp == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(dp)]


def replicas(config, path: Path) -> list[Replica]:
    """The replicas of an ``inference`` config whose resolved file is ``path``."""
    port, host = config.server.port, config.server.host
    return [Replica(i, port + i, p, local_url(host, port + i))
            for i, p in enumerate(replica_paths(path, config.parallel.dp))]


def replica_data(data: dict, index: int) -> dict:
    """Replica ``index``'s config from the dumped config of all replicas."""
    out = copy.deepcopy(data)
    out["parallel"]["dp"] = 1
    out["server"]["port"] = data["server"]["port"] + index
    return out


def write_replicas(data: dict, path: Path) -> list[Path]:
    """Write the replica files of the dumped inference config ``data`` (already written to
    ``path``); stale replica files of an earlier, larger ``dp`` are removed."""
    from prime_core.run_dir import atomic_write_text

    path = Path(path)
    paths = replica_paths(path, data["parallel"]["dp"])
    if paths != [path]:
        for i, replica_path in enumerate(paths):
            atomic_write_text(replica_path, json.dumps(replica_data(data, i), indent=2) + "\n")
    pattern = re.compile(rf"^{re.escape(path.stem)}_(\d+){re.escape(path.suffix)}$")
    for old in path.parent.glob(f"{path.stem}_*{path.suffix}"):
        match = pattern.match(old.name)
        if match and old not in paths:
            old.unlink(missing_ok=True)
    return paths
