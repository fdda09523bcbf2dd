#!/usr/bin/env bash
# Fetch (on THIS machine, which reaches PyPI) flash-attention 4 and what it needs for the lent GPU machine
# (CPython 3.12, no network): flash-attn-4, nvidia-cutlass-dsl (its compiler, 235 MB unpacked), quack,
# apache-tvm-ffi, torch-c-dlpack-ext. Writes .fa4/ (gitignored) in the repo root:
#   .fa4/p00, .fa4/p01   the cutlass-dsl cu12 libraries, re-packed as one xz tarball (about 51 MiB) in two
#                        parts: with the tracked tree, one call carries at most 64 MiB
#   .fa4/whl/            the other wheels (about 10 MiB)
# The device image has einops, cuda-bindings and protobuf. Re-packing takes about 5 minutes here.
#
# On the GPU machine, two calls, the second within 30 s of the first (the machine stays warm and keeps /tmp):
#   run(command="mv .fa4/p00 /tmp/p00", carry=[".fa4/p00"])
#   run(command="bash benchmarks/fa4_install.sh && ...", carry=[".fa4/p01", ".fa4/whl", "benchmarks/.whl"])
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.fa4"; work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
[ -x "$root/.venv/bin/python" ] && py=${PYTHON:-$root/.venv/bin/python}
version=${CUTLASS_DSL:-4.8.1}
get() {  # get DIR SPEC...
  "$py" -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform any -d "$@" 2> >(grep -v "is ignored" >&2)
}
rm -rf "$dest"; mkdir -p "$dest/whl" "$work/cu12"
get "$dest/whl" "flash-attn-4==${FA4:-4.0.0b36}" "nvidia-cutlass-dsl==$version" "nvidia-cutlass-dsl-libs-base==$version" \
  "nvidia-cutlass-dsl-libs-core==$version" "apache-tvm-ffi<0.2,>=0.1.11" torch-c-dlpack-ext "quack-kernels>=0.5.3"
get "$work" "nvidia-cutlass-dsl-libs-cu12==$version"
(cd "$work/cu12" && unzip -q "$work"/nvidia_cutlass_dsl_libs_cu12-*.whl \
  && tar cf - . | xz -T1 --lzma2=preset=9e,dict=256MiB > "$work/cu12.tar.xz")
split -b 27000000 -d "$work/cu12.tar.xz" "$dest/p"
du -sh "$dest"/*
