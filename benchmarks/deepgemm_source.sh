#!/usr/bin/env bash
# Make benchmarks/.whl/deepgemm-src.tar.gz (what deepgemm_build.sh builds on the GPU machine) from git
# repositories of DeepGEMM, CUTLASS and fmt on this machine (clones or bare mirrors; no network needed):
#
#   bash benchmarks/deepgemm_source.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [DEEPGEMM_REV]
#
# DeepGEMM at DEEPGEMM_REV (default HEAD) with the CUTLASS and fmt headers at the commits its
# submodules pin (third-party/cutlass, third-party/fmt): about 3 MB. Stop 38 built 54e2261.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,8p "$0" >&2; exit 2; }
deepgemm=$1 cutlass=$2 fmt=$3 rev=${4:-HEAD}
dest=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.whl/deepgemm-src.tar.gz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pinned() { git -C "$deepgemm" ls-tree "$rev" "third-party/$1" | awk '$2 == "commit" {print $3}'; }
cutlass_rev=$(pinned cutlass) fmt_rev=$(pinned fmt)
[ -n "$cutlass_rev" ] && [ -n "$fmt_rev" ] || { echo "deepgemm_source: $deepgemm at $rev pins no cutlass/fmt submodule" >&2; exit 1; }
mkdir -p "$work/DeepGEMM/third-party/cutlass" "$work/DeepGEMM/third-party/fmt"
git -C "$deepgemm" archive "$rev" | tar -x -C "$work/DeepGEMM"
git -C "$cutlass" archive "$cutlass_rev" include | tar -x -C "$work/DeepGEMM/third-party/cutlass"
git -C "$fmt" archive "$fmt_rev" include | tar -x -C "$work/DeepGEMM/third-party/fmt"
git -C "$deepgemm" rev-parse --short "$rev" > "$work/DeepGEMM/COMMIT"
mkdir -p "$(dirname "$dest")"
tar czf "$dest" -C "$work" DeepGEMM
echo "deepgemm_source: $dest ($(du -h "$dest" | cut -f1)): DeepGEMM $(cat "$work/DeepGEMM/COMMIT"), cutlass ${cutlass_rev:0:8}, fmt ${fmt_rev:0:8}"
