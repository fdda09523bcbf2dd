#!/usr/bin/env bash
# On the lent GPU machine: install flash-attention 4 from what benchmarks/fetch_fa4.sh made (/tmp/p00 from the
# call before, .fa4/p01 and .fa4/whl from this one) into python3's environment. Does nothing if it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import flash_attn.cute" 2>/dev/null && exit 0
[ -f /tmp/p00 ] || { echo "fa4_install: /tmp/p00 is missing: carry .fa4/p00 in a call just before and move it there" >&2; exit 1; }
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat /tmp/p00 .fa4/p01 | xz -d -T0 | tar x -C "$site"
python3 -m pip install -q --no-index --no-deps --no-compile .fa4/whl/*.whl
python3 -c "import flash_attn.cute"
