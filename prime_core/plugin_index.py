"""Which first-party distribution provides a config key or a registered name, for messages
about plugins that are not loaded here ("``trainer.model.ep`` is a key of prime-plugin-ep,
which is not installed: pip install prime-plugin-ep").

The data (``plugin_index.json``) is generated from the plugins themselves by
``python scripts/plugin_index.py --write``; ``tests/test_docs.py`` fails when it is stale. It
only shapes hints: the core never selects or configures anything from it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

INDEX = Path(__file__).with_name("plugin_index.json")


@functools.cache
def _index() -> dict[str, Any]:
    try:
        return json.loads(INDEX.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def key_owner(root: str, key: str) -> dict | None:
    """The index entry of the distribution whose config sections add ``key`` (a dotted path
    in a config of ``root``), or ``None``."""
    for entry in _index().values():
        for path in entry.get("keys", {}).get(root, []):
            if key == path or key.startswith(f"{path}."):
                return entry
    return None


def name_owner(registry: str, name: str) -> dict | None:
    """The index entry of the distribution that registers ``name`` in ``registry``."""
    for entry in _index().values():
        if name in entry.get("provides", {}).get(registry, []):
            return entry
    return None


def owner_hint(entry: dict, manager) -> str | None:
    """Why the owner's plugin is not providing it here, and the fix; ``None`` when it is loaded
    (what it does not provide is then not its: a typo in one of its sections, say)."""
    record = manager.records.get(entry["plugin"])
    if record is not None and record.status in ("active", "unavailable"):
        return None
    label = f"plugin '{entry['plugin']}' ({entry['distribution']})"
    if record is not None and record.status == "disabled":
        return f"{label}, which is disabled: remove it from PRIME_DISABLED_PLUGINS / --disable-plugin"
    if record is not None and record.status == "failed":
        return f"{label}, which failed to load: {(record.reason or '').splitlines()[0]}"
    return f"{entry['distribution']}, which is not installed here: pip install {entry['distribution']}"
