#!/usr/bin/env bash
# Install prime-core and every plugins/*/* (editable, --no-deps) into the lent GPU machine's python3,
# fully offline, keeping the image's torch / triton / transformers untouched.
#
# Here (network):   bash benchmarks/fetch_device_wheels.sh          # fills benchmarks/.whl/ (~3.5 MB)
# Device call:      run(command="bash benchmarks/device_setup.sh && python3 ...",
#                       carry=["benchmarks/.whl"])
#
# What it does, from the repo root of the device's copy of the working tree:
#  1. unpacks the build-only wheels (hatchling & deps) into a throw-away dir used only on PYTHONPATH
#     while pip builds our editable installs (the image has no hatchling);
#  2. walks the requirements of prime-core and the plugins (and, transitively, of what is installed
#     or chosen) and installs a carried runtime wheel only where python3 lacks the distribution or has a
#     version that does not satisfy a requirement (on the image: pydantic, pydantic-core,
#     annotated-types, typing-inspection, dynaconf, tomli-w, and typing-extensions if older than 4.16).
#     torch, transformers, triton and nvidia-* are never installed or upgraded: if one fails a
#     requirement it is only reported;
#  3. pip install --no-deps --no-build-isolation -e . -e plugins/*/*;
#  4. installs the carried kernel libraries of benchmarks/.whl/extras/ (liger-kernel), --no-deps: their
#     torch and triton are the image's;
#  5. imports every package and lists the prime.plugins entry points.
#
# Where: into python3's own environment when its site-packages is writable (the device runs as root and
# is thrown away after the session; on the image python3 is the venv /opt/torch/.venv), so a plain
# `python3` afterwards sees everything. Otherwise, or with PRIME_DEVICE_VENV=DIR, into a venv at DIR
# made with --system-site-packages plus a .pth to python3's site-packages (--system-site-packages
# alone would expose the *base* interpreter's packages, not the image venv's torch); then use
# DIR/bin/python.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
whl=${PRIME_DEVICE_WHEELS:-$root/benchmarks/.whl}
py=${PYTHON:-python3}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
if [ ! -d "$whl/runtime" ] || [ ! -d "$whl/build" ]; then
  echo "device_setup: no wheels in $whl: run benchmarks/fetch_device_wheels.sh here and name benchmarks/.whl in carry" >&2
  exit 1
fi

writable=$("$py" -c 'import os, sysconfig; print(int(os.access(sysconfig.get_paths()["purelib"], os.W_OK)))')
if [ -n "${PRIME_DEVICE_VENV:-}" ] || [ "$writable" != 1 ]; then
  venv=${PRIME_DEVICE_VENV:-$HOME/.prime-venv}
  "$py" -m venv --system-site-packages --without-pip "$venv"
  # expose the image interpreter's own site-packages (torch, transformers, pip) behind the venv's
  "$py" -c 'import site, sysconfig; print("\n".join(dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages()])))' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_image_site.pth"
  py=$venv/bin/python
  echo "device_setup: installing into venv $venv (use $venv/bin/python)"
fi

"$py" - <<'EOF'
import sys, importlib.metadata as md
def v(n):
    try: return md.version(n)
    except md.PackageNotFoundError: return "MISSING"
print(f"device_setup: {sys.executable} (Python {sys.version.split()[0]}), torch {v('torch')}, "
      f"transformers {v('transformers')}, triton {v('triton')}")
EOF

# 1. build backend, only for the build
build_site=$(mktemp -d /tmp/prime-build-site.XXXX)
trap 'rm -rf "$build_site"' EXIT
"$py" -m pip install -q --no-deps --no-compile --target "$build_site" "$whl"/build/*.whl

# 2. which carried runtime wheels are needed
plan=$("$py" - "$root" "$whl/runtime" "$build_site" <<'EOF'
import sys, tomllib, zipfile, email.parser, importlib.metadata as md
from pathlib import Path
root, wdir, build_site = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
orig_path = list(sys.path)
sys.path.append(build_site)  # `packaging` from the image if it has one, else the carried one
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon, parse_wheel_filename

def protected(n): return n in {"torch", "transformers", "triton"} or n.startswith("nvidia-")
installed = {}
for d in md.distributions(path=orig_path):  # first found wins, as for imports
    n = d.metadata["Name"]
    if n: installed.setdefault(canon(n), d)
wheels = {}
for w in sorted(wdir.glob("*.whl")):
    n, v, _, _ = parse_wheel_filename(w.name)
    with zipfile.ZipFile(w) as z:
        meta = next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))
        reqs = email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    wheels[n] = (v, w, reqs)
pyprojects = [root / "pyproject.toml", *sorted(root.glob("plugins/*/*/pyproject.toml"))]
ours, queue, core_reqs = set(), [], set()
for pp in pyprojects:
    proj = tomllib.loads(pp.read_text())["project"]
    ours.add(canon(proj["name"]))
    queue += [(r, pp.relative_to(root).as_posix()) for r in proj.get("dependencies", [])]
    if pp == root / "pyproject.toml":
        core_reqs = {canon(Requirement(r).name) for r in proj.get("dependencies", [])}
chosen, seen_installed, problems = {}, set(), []
while queue:
    spec, why = queue.pop(0)
    req = Requirement(spec)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    n = canon(req.name)
    if n in ours:
        continue
    if n in chosen:
        if not req.specifier.contains(chosen[n][0], prereleases=True):
            problems.append(f"carried {n} {chosen[n][0]} does not satisfy {spec} ({why})")
        continue
    have = installed.get(n)
    if have is not None and req.specifier.contains(have.version, prereleases=True):
        if n not in seen_installed and not protected(n):
            seen_installed.add(n)
            queue += [(r, f"{n} {have.version}") for r in (have.requires or [])]
        continue
    now = f"installed {have.version}" if have is not None else "missing"
    if protected(n):
        problems.append(f"{n} ({now}) does not satisfy {spec} ({why}); left as is, never installed here")
    elif n in wheels and req.specifier.contains(wheels[n][0], prereleases=True):
        chosen[n] = wheels[n]
        print(f"  + {n} {wheels[n][0]}  ({now}; {spec} from {why})", file=sys.stderr)
        queue += [(r, f"{n} {wheels[n][0]}") for r in wheels[n][2]]
    elif why.startswith("plugins/") and n not in core_reqs:
        # A plugin's own dependency (a tracker, a kernel library): the plugin imports it lazily and
        # reports itself unavailable without it; carry its wheels to use it here.
        print(f"device_setup: note: {n} ({now}) for {spec} ({why}) is not carried: that plugin is unavailable here",
              file=sys.stderr)
    else:
        problems.append(f"{n} ({now}) does not satisfy {spec} ({why}) and no carried wheel does")
for p in problems:
    print("device_setup: WARNING:", p, file=sys.stderr)
if any("no carried wheel" in p or p.startswith("carried") for p in problems):
    sys.exit(2)
print(" ".join(str(w) for _, w, _ in chosen.values()))
EOF
)
if [ -n "$plan" ]; then
  # shellcheck disable=SC2086
  "$py" -m pip install -q --no-deps --no-compile $plan
else
  echo "device_setup: every runtime requirement is already met"
fi

# 3. our packages, editable, no deps
args=(-e .)
for d in plugins/*/*/; do [ -f "$d/pyproject.toml" ] && args+=(-e "${d%/}"); done
PYTHONPATH="$build_site${PYTHONPATH:+:$PYTHONPATH}" \
  "$py" -m pip install -q --no-deps --no-build-isolation "${args[@]}"

# 4. kernel libraries the plugins import lazily (their GPU tests skip without them)
shopt -s nullglob
extras=("$whl"/extras/*.whl)
shopt -u nullglob
if [ ${#extras[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-deps --no-compile "${extras[@]}"
  echo "device_setup: installed $(printf '%s ' "${extras[@]##*/}")"
fi

# 5. check
"$py" - <<'EOF'
import importlib, importlib.metadata as md, tomllib
from pathlib import Path
mods = ["prime_core"]
for pp in sorted(Path("plugins").glob("*/*/pyproject.toml")):
    mods += tomllib.loads(pp.read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:  # list them all, then fail
        bad.append(f"{m}: {type(e).__name__}: {e}")
if bad:
    raise SystemExit("device_setup: import failed:\n  " + "\n  ".join(bad))
eps = sorted(e.name for e in md.entry_points(group="prime.plugins"))
print(f"device_setup: ok: imported {len(mods)} packages; prime.plugins entry points: {', '.join(eps)}")
EOF
