"""Loading models and tokenizers by name, with errors a user can act on.

Roles run with ``HF_HUB_OFFLINE=1`` unless the environment says otherwise (no network at
run time beyond loopback), so a hub id works only when it is already in the local cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
