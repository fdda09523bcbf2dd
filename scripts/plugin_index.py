"""Write prime_core/plugin_index.json: the config keys and registered names of every
first-party plugin (``plugins/*/*``), for the core's "install prime-plugin-X" hints.

    python scripts/plugin_index.py            # print it (tests/test_docs.py checks the file is current)
    python scripts/plugin_index.py --write    # rewrite prime_core/plugin_index.json

Needs every first-party plugin installed (``scripts/install.sh`` does that).
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_party() -> dict[str, str]:
    """Entry-point name -> distribution name of every plugin folder in this repository."""
    out = {}
    for pyproject in sorted(ROOT.glob("plugins/*/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        for name in project.get("entry-points", {}).get("prime.plugins", {}):
            out[name] = project["name"]
    return out


def index() -> dict:
    from prime_core.config.schema import BASE_ROOTS, sections_for
    from prime_core.plugins import REGISTRIES, PluginManager

    manager = PluginManager(autoload=True, disabled=()).load()
    kinds = {reg.hook: kind for kind, reg in REGISTRIES.items()}
    out = {}
    for name, dist in first_party().items():
        record = manager.records.get(name)
        if record is None or record.status not in ("active", "unavailable"):
            raise SystemExit(f"plugin '{name}' ({dist}) is not loaded: install every plugin first (scripts/install.sh)")
        provided = manager.provided_by(record)
        sections = [(s, name) for s in provided.get("prime_config_sections", [])]
        keys = {}
        for root in BASE_ROOTS:
            paths = []
            for path, section, _ in sections_for(root, sections):
                if section.merge:
                    paths += [f"{path}.{field}" if path else field for field in section.model.model_fields]
                else:
                    paths.append(path)
            if paths:
                keys[root] = sorted(set(paths))
        # Aliases too: a config that spells a name the other project's way gets the same hint.
        provides = {kinds[hook]: sorted(k for spec in specs for k in (spec.key, *spec.alias_keys))
                    for hook, specs in provided.items() if hook != "prime_config_sections"}
        out[dist] = {"plugin": name, "distribution": dist, "keys": keys, "provides": provides}
    return dict(sorted(out.items()))


def render() -> str:
    return json.dumps(index(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    text = render()
    if "--write" in sys.argv[1:]:
        (ROOT / "prime_core" / "plugin_index.json").write_text(text)
    else:
        sys.stdout.write(text)
