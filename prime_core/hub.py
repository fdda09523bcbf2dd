"""Loading models and tokenizers by name, with errors a user can act on.

Roles run with ``HF_HUB_OFFLINE=1`` unless the environment says otherwise (no network at
run time beyond loopback), so a hub id works only when it is already in the local cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prime_core.errors import PrimeError


def default_offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@contextmanager
def loading(name: str, key: str) -> Iterator[None]:
    """Turn the OSError transformers raises for an unknown model into a clear message."""
    try:
        yield
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        why = "not a local folder and not in the local Hugging Face cache" if offline else str(exc).splitlines()[0]
        raise PrimeError(
            f"{key} = '{name}': cannot load the model: {why}",
            hint="point it at a local Hugging Face folder (e.g. one made by `prime model tiny OUT`)"
            + (", or set HF_HUB_OFFLINE=0 to allow downloads" if offline else ""),
        ) from None


def offline() -> bool:
    """Whether roles will run offline (``default_offline``: unless ``HF_HUB_OFFLINE`` says otherwise)."""
    return os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() not in ("", "0", "false", "no", "off")


def cache_problem(name: str, key: str) -> str | None:
    """Why the hub id ``name`` cannot be loaded by offline roles (not in the local cache), or
    ``None`` (a local folder, a cached id, or roles allowed to download)."""
    if Path(name).expanduser().is_dir() or not offline():
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id: the loader's own error names it
        return None
    if isinstance(cached, str):
        return None
    return (f"{key} = '{name}': not a local folder and not in the local Hugging Face cache, and roles run offline "
            "(HF_HUB_OFFLINE=1): download it first (HF_HUB_OFFLINE=0 hf download NAME), set HF_HUB_OFFLINE=0 to let "
            "the roles download it, or point it at a local folder")


def model_folder(name: str, *, download: bool = True) -> Path:
    """The folder of model ``name``'s config and safetensors: a local folder as is; a hub id's
    snapshot, from the local cache (``download=False``, or ``HF_HUB_OFFLINE``) or fetched."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"],
                                  local_files_only=not download))
