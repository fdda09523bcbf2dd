#!/usr/bin/env bash
# Fetch (on THIS machine, which reaches PyPI) the wheels that benchmarks/device_setup.sh installs on the
# lent GPU machine, which has no network. Target: CPython 3.12, x86-64 Linux.
#
#   bash benchmarks/fetch_device_wheels.sh            # the pinned defaults below
#   bash benchmarks/fetch_device_wheels.sh NAME==VER  # add/override runtime wheels
#
# Layout (benchmarks/.whl/ is gitignored by the repo's `.whl/` rule, so it never lands in git and
# must be named in the device call's `carry`):
#   benchmarks/.whl/runtime/  pure deps of prime-core / plugins that the device image lacks
#                             (pydantic & friends, dynaconf, tomli-w) + typing-extensions as a fallback.
#                             device_setup.sh installs one only where the device's python3 lacks it or
#                             has a version that does not satisfy a requirement.
#   benchmarks/.whl/build/    hatchling and its deps: the build backend of our pyprojects. Used only
#                             on PYTHONPATH while pip builds the editable installs; never installed.
#   benchmarks/.whl/extras/   kernel libraries that plugins import lazily and do not require (pure-Python
#                             wheels: liger-kernel for prime-plugin-liger). device_setup.sh installs
#                             them --no-deps, so that the GPU sweep runs those plugins' GPU tests too.
# torch / transformers / triton are deliberately NOT fetched: the device image's builds are used.
# Pins follow the versions tested in the local .venv (py3.11 there; these are the cp312 builds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest="$here/.whl"
runtime=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
         typing-extensions==4.16.0 dynaconf==3.3.5 tomli-w==1.2.0)
extras=(liger-kernel==0.8.5)
build=(hatchling==1.33.0 packaging==26.3 pathspec==1.1.1 pluggy==1.7.0 trove-classifiers==2026.9.21.13 tomlkit==0.15.2 editables==0.6)
if [ $# -gt 0 ]; then runtime+=("$@"); fi
py=${PYTHON:-python3}
[ -x "$here/../.venv/bin/python" ] && py=${PYTHON:-$here/../.venv/bin/python}

fetch() {  # fetch DIR SPEC...
  local d=$1; shift
  mkdir -p "$d"
  for p in "$@"; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$d" "$p" 2> >(grep -v "is ignored" >&2)
  done
}
rm -rf "$dest/runtime" "$dest/build" "$dest/extras"  # not the rest: deepgemm_build.sh's source tarball lives here too
fetch "$dest/runtime" "${runtime[@]}"
fetch "$dest/build" "${build[@]}"
fetch "$dest/extras" "${extras[@]}"
# One version per distribution, or the offline install stops.
dups=$(ls "$dest"/runtime/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "fetch_device_wheels: more than one wheel of: $dups" >&2; exit 1; }
du -sh "$dest"
ls "$dest"/*
