"""Every example config of prime-rl's releases, through ``prime config validate`` and
``prime run --dry-run`` unchanged, as a table.

    .venv/bin/python scripts/prime_rl_configs.py PRIME_RL_CHECKOUT              # v0.5.0 and v0.6.0
    .venv/bin/python scripts/prime_rl_configs.py PRIME_RL_CHECKOUT --tags v0.6.0 --verbose

PRIME_RL_CHECKOUT is a git clone of prime-rl (``git clone https://github.com/PrimeIntellect-ai/prime-rl``);
nothing of it is copied into this project: the TOMLs under ``examples/`` and ``configs/`` of each
tag are read with ``git show`` into a temporary folder.

A prime-rl config is written for one of its entry points (``rl``, ``sft``, ``trainer``,
``orchestrator``, ``inference``) and its own test accepts a file that one of them loads; so
does this table: each root is tried, the one the file's name suggests first. The validation
is ``prime config validate`` as on a cluster (a hub id is downloaded there: this machine's model
cache is not checked); the dry run is ``prime run`` / ``prime sft`` /
``prime inference`` with ``--dry-run --output_dir TMP`` (a trainer or orchestrator config of a
multi-run setup is a role config: it has no launch of its own, and its dry run is marked n/a).

With ``--keys``, also every key of the tag's ``rl`` and ``sft`` schemas (its pydantic models,
walked in a subprocess with stand-ins for the two non-config packages they import) is looked up
in prime's schema (``prime_core.config.prime_rl.has_home``): printed are the keys with no home.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # no waiting on a network this machine does not have
os.environ.setdefault("PRIME_NO_PROGRESS", "1")

ROOTS = ("rl", "sft", "inference", "orchestrator", "trainer")
LAUNCHED = ("rl", "sft", "inference")
CATEGORIES = (
    ("teacher", ("training_mode", "teacher", "student", "'loss:sft'", "loss.type = 'sft'")),
    ("nccl", ("weight transport named 'nccl'",)),
    ("replicas", ("num_infer_replicas",)),
    ("environment", ("no installed plugin provides an environment", "environment 'reverse_text' has no argument")),
    ("this-cpu", ("vLLM on CPU binds",)),
)
"""Failures that are not this table's business, by what they wait for: prime-rl's distillation keys
(``training_mode``, a ``teacher`` model: the teacher branch), the ``nccl`` weight transport and
``deployment.num_infer_replicas`` (the inference-at-scale branch), and environments that are not
installed here (a verifiers environment of prime-rl's hub, which a cluster installs), and vLLM's
tensor parallelism, which this CPU machine cannot serve (its GPU hosts can)."""


def example_files(checkout: Path, tag: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(checkout), "ls-tree", "-r", "--name-only", tag],
                         check=True, capture_output=True, text=True).stdout.split()
    return sorted(p for p in out if p.endswith(".toml") and p.split("/")[0] in ("examples", "configs"))


def extract(checkout: Path, tag: str, paths: list[str], into: Path) -> None:
    for path in paths:
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(subprocess.run(["git", "-C", str(checkout), "show", f"{tag}:{path}"],
                                          check=True, capture_output=True).stdout)


def guess_roots(path: Path) -> list[str]:
    """Roots to try, the likeliest first (by the file's name and its top-level keys)."""
    name = path.stem
    data = tomllib.loads(path.read_text())
    if "orchestrator" not in data and (name == "sft" or "sft" in path.parts[-2] or isinstance(data.get("data"), dict)):
        first = "sft"
    elif name in ("infer", "inference"):
        first = "inference"
    elif name in ("orch", "orchestrator"):
        first = "orchestrator"
    elif name in ("trainer", "train") and "orchestrator" not in data:
        first = "trainer"
    else:
        first = "rl"
    return [first, *(r for r in ROOTS if r != first)]


def _quiet(fn, *args):
    """``fn(*args)`` with its console output kept; returns (result or exception, output)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            result = fn(*args)
        except SystemExit as exc:
            result = exc
        except Exception as exc:
            result = exc
    return result, buffer.getvalue()


def validate(root: str, path: Path):
    from prime_core.cli.common import load_config
    from prime_core.config.checks import check
    from prime_core.errors import ConfigError

    config = load_config(root, [str(path)])
    problems = check(config, root, here=False)  # as on a cluster: its model cache is not this machine's
    if problems:
        raise ConfigError(problems)
    return config


def dry_run(root: str, path: Path, out: Path) -> int:
    from prime_core.cli.run_cmd import launch

    return launch(root, [str(path), "--dry-run", "--output_dir", str(out)])


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # A ConfigError starts with a header line; its problems follow as "- ..." lines.
    problems = [ln.lstrip("- ") for ln in lines if ln.startswith("- ")]
    import re

    text = "; ".join(problems[:3]) if problems else (lines[0] if lines else type(exc).__name__)
    return re.sub(r" \(from [^)]*\)", "", text)


def loads(root: str, path: Path):
    from prime_core.cli.common import load_config

    return load_config(root, [str(path)])


def one_file(path: Path, work: Path) -> dict:
    """The first root (likeliest first) the file validates for; otherwise the likeliest one the
    file loads for (the schema takes it, an installed-plugin check fails), else the likeliest."""
    roots = guess_roots(path)
    errors, loaded = {}, None
    for root in roots:
        result, output = _quiet(validate, root, path)
        if not isinstance(result, BaseException):
            return _with_dry_run({"root": root, "loads": True, "validate": True}, root, path, work, output)
        errors[root] = first_line(result)
        if loaded is None and not isinstance(_quiet(loads, root, path)[0], BaseException):
            loaded = root
    root = loaded or roots[0]
    row = {"root": root, "loads": loaded is not None, "validate": False, "reason": errors[root],
           "waits_for": waits_for(errors[root])}
    return _with_dry_run(row, root, path, work, "") if loaded else {**row, "dry_run": False}


def _with_dry_run(row: dict, root: str, path: Path, work: Path, output: str) -> dict:
    row["notes"] = [ln.removeprefix("warning: ") for ln in output.splitlines() if ln.startswith("warning: ")]
    if root not in LAUNCHED:
        row["dry_run"] = None
        return row
    out = work / "out" / str(abs(hash(path)))
    result, output = _quiet(dry_run, root, path, out)
    row["dry_run"] = result == 0 and (out / "configs").is_dir()
    if not row["dry_run"] and row["validate"]:
        row["reason"] = first_line(result) if isinstance(result, BaseException) else output.strip()[-300:]
    return row


def waits_for(reason: str) -> str | None:
    """The category (``CATEGORIES``) every problem of ``reason`` belongs to, if they share one
    (distillation keys together with anything else count as distillation)."""
    found = set()
    for line in reason.split("; "):
        kinds = [name for name, marks in CATEGORIES if any(m in line for m in marks)]
        if not kinds:
            return None
        found.add(kinds[0])
    if len(found) == 1:
        return found.pop()
    return "teacher" if "teacher" in found else "+".join(sorted(found))


def run_tag(checkout: Path, tag: str, verbose: bool) -> dict:
    files = example_files(checkout, tag)
    with tempfile.TemporaryDirectory(prefix=f"prime-rl-{tag}-") as tmp:
        work = Path(tmp)
        extract(checkout, tag, files, work / "src")
        rows = []
        for rel in files:
            row = one_file(work / "src" / rel, work)
            row["file"] = rel
            rows.append(row)
            mark = {True: "ok", False: "FAIL", None: "n/a"}
            print(f"{tag}  {rel:60s} {row['root']:12s} loads {mark[row['loads']]:4s} validate "
                  f"{mark[row['validate']]:4s} dry-run {mark[row['dry_run']]:4s}"
                  + (f"  {row['reason'][:200]}" if row.get("reason") else ""), flush=True)
            if verbose:
                for note in row.get("notes", []):
                    print(f"      note: {note}")
    n = len(rows)
    valid = sum(r["validate"] for r in rows)
    loaded = sum(r["loads"] for r in rows)
    dry = sum(r["dry_run"] is not False for r in rows)
    waiting = Counter(r["waits_for"] for r in rows if r.get("waits_for"))
    return {"tag": tag, "files": n, "loads": loaded, "validate": valid, "dry_run": dry, "waiting": waiting,
            "rows": rows}


def print_summary(results: list[dict]) -> None:
    print()
    kinds = [name for name, _ in CATEGORIES]
    print(f"{'tag':8s} {'files':>5s} {'loads':>14s} {'validate':>14s} {'dry-run':>14s}   validation fails only "
          "for: " + ", ".join(kinds))
    for r in results:
        n = r["files"]
        other = sum(v for k, v in r["waiting"].items() if k not in kinds)
        waiting = " ".join(f"{r['waiting'].get(k, 0):3d}" for k in kinds) + (f"  (mixed: {other})" if other else "")
        print(f"{r['tag']:8s} {n:5d} {r['loads']:5d} ({100 * r['loads'] / n:5.1f}%) "
              f"{r['validate']:5d} ({100 * r['validate'] / n:5.1f}%) "
              f"{r['dry_run']:5d} ({100 * r['dry_run'] / n:5.1f}%)   {waiting}")
        fixable = r["validate"] + sum(r["waiting"].values())
        print(f"{'':8s} {'':5s} validate, or fail only for those: {fixable} ({100 * fixable / n:5.1f}%)")
    reasons = Counter()
    for r in results:
        for row in r["rows"]:
            if row.get("reason"):
                reasons[(row.get("waits_for") or "-", row["reason"][:150])] += 1
    if reasons:
        print("\nreasons (files):")
        for (kind, reason), count in reasons.most_common():
            print(f"  {count:3d}  [{kind}] {reason}")


WALK = r"""
import json, sys, types, typing
from pydantic import BaseModel
sys.path[:0] = [sys.argv[1], sys.argv[2]]
for name in ("prime_rl.utils.logger", "prime_rl.utils.utils"):
    module = types.ModuleType(name)
    module.get_logger = lambda *a, **k: None
    module.rgetattr = module.rsetattr = None
    sys.modules[name] = module

def models(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in models(a)]

def walk(cls, prefix, out, depth=0):
    for name, info in cls.model_fields.items():
        out.add(prefix + name)
        if depth < 8:
            for sub in models(info.annotation):
                walk(sub, f"{prefix}{name}.", out, depth + 1)

import importlib
keys = {}
for root, cls in (("rl", "RLConfig"), ("sft", "SFTConfig")):
    out = set()
    walk(getattr(importlib.import_module(f"prime_rl.configs.{root}"), cls), "", out)
    keys[root] = sorted(out)
print(json.dumps(keys))
"""

STUBS = {
    # prime-rl's config modules import these; their models are not needed to list the keys.
    "pydantic_config/__init__.py": "from pydantic import BaseModel, ConfigDict\n"
                                   "class BaseConfig(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n"
                                   "cli = None\n",
    "renderers/__init__.py": "from pydantic import BaseModel, ConfigDict\n"
                             "class RendererConfig(BaseModel):\n    model_config = ConfigDict(extra='allow')\n"
                             "    name: str = 'auto'\nclass AutoRendererConfig(RendererConfig):\n    pass\n",
    "renderers/base/__init__.py": "MODEL_RENDERER_MAP = {}\n",
}


def schema_keys_of_checkout(checkout: Path, tag: str) -> dict[str, list[str]]:
    """Every dotted key of prime-rl's ``rl`` and ``sft`` config models at ``tag`` (its pydantic
    models walked in a subprocess, with stand-ins for the few non-config modules they import)."""
    with tempfile.TemporaryDirectory(prefix=f"prime-rl-src-{tag}-") as tmp:
        work = Path(tmp)
        files = subprocess.run(["git", "-C", str(checkout), "ls-tree", "-r", "--name-only", tag],
                               check=True, capture_output=True, text=True).stdout.split()
        configs = [f for f in files if "/prime_rl/configs/" in f or "/prime_rl/utils/" in f]
        extract(checkout, tag, [f for f in configs if f.endswith(".py")], work / "src")
        source = next(p.parents[2] for p in (work / "src").rglob("prime_rl/configs/rl.py"))
        for relative, text in STUBS.items():
            (work / "stubs" / relative).parent.mkdir(parents=True, exist_ok=True)
            (work / "stubs" / relative).write_text(text)
        for package in (source / "prime_rl", source / "prime_rl" / "configs", source / "prime_rl" / "utils"):
            (package / "__init__.py").touch()
        out = subprocess.run([sys.executable, "-c", WALK, str(work / "stubs"), str(source)],
                             check=True, capture_output=True, text=True).stdout
    import json

    return json.loads(out)


def missing_keys(checkout: Path, tag: str) -> list[str]:
    """prime-rl's config keys of ``tag`` with no home in prime (``prime_core.config.prime_rl.has_home``),
    a table's keys shown once as the table."""
    from prime_core.config.checks import schema_for
    from prime_core.config.prime_rl import has_home

    missing = []
    for root, keys in schema_keys_of_checkout(checkout, tag).items():
        schema = schema_for(root)
        missing += [f"{root}: {key}" for key in keys if not has_home(schema, key)]
    found = set(missing)
    return [m for m in missing if "." not in m or m.rsplit(".", 1)[0] not in found]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a git clone of prime-rl")
    parser.add_argument("--tags", nargs="+", default=["v0.5.0", "v0.6.0"])
    parser.add_argument("--verbose", action="store_true", help="also print each config's compatibility notes")
    parser.add_argument("--keys", action="store_true", help="also list schema keys with no home in prime")
    args = parser.parse_args()
    if not (args.checkout / ".git").exists() and not (args.checkout / "HEAD").exists():
        print(f"{args.checkout}: not a git checkout of prime-rl", file=sys.stderr)
        return 2
    results = [run_tag(args.checkout, tag, args.verbose) for tag in args.tags]
    print_summary(results)
    if args.keys:
        for tag in args.tags:
            missing = missing_keys(args.checkout, tag)
            print(f"\n{tag}: {len(missing)} schema keys without a home in prime")
            for key in missing:
                print(f"  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
