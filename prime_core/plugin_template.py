"""``prime plugin new NAME``: write a new, installable plugin from the template.

The template lives in ``plugin_template_files/``; ``${...}`` placeholders are filled with
string.Template. The plugin it writes implements three hooks (a config section, a CLI
command and a config check) that the core really calls, and ships tests that use
``prime_core.testing``.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from prime_core import PLUGIN_API_VERSION, __version__
from prime_core.errors import PrimeError

TEMPLATE = Path(__file__).with_name("plugin_template_files")
_VALID = re.compile(r"^[a-z][a-z0-9_-]*[a-z0-9]$")


def names(name: str) -> dict[str, str]:
    if not _VALID.match(name):
        raise PrimeError(
            f"plugin name {name!r} is invalid: use lower-case letters, digits, '-' or '_', "
            "starting with a letter (e.g. 'my-monitor')"
        )
    short = name.replace("-", "_")
    major, minor = (__version__.split(".") + ["0"])[:2]
    return {
        "name": short,
        "dist": f"prime-plugin-{name.replace('_', '-')}",
        "module": f"prime_plugin_{short}",
        "title": "".join(p.capitalize() for p in short.split("_")),
        "api": str(PLUGIN_API_VERSION),
        "core_range": f">={major}.{minor},<{major}.{int(minor) + 1}" if minor.isdigit() else ">=0.1",
    }


def create_plugin(name: str, directory: Path) -> Path:
    values = names(name)
    target = Path(directory) / values["dist"]
    if target.exists():
        raise PrimeError(f"{target} already exists; choose another name or --dir")
    for source in sorted(TEMPLATE.rglob("*")):
        if source.is_dir() or source.suffix == ".pyc" or "__pycache__" in source.parts:
            continue
        relative = source.relative_to(TEMPLATE)
        parts = [values["module"] if p == "package" else p for p in relative.parts]
        parts[-1] = parts[-1].removesuffix(".tmpl")
        dest = target.joinpath(*parts)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(Template(source.read_text(encoding="utf-8")).substitute(values), encoding="utf-8")
    return target
