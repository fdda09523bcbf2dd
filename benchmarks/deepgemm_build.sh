#!/usr/bin/env bash
# Build DeepGEMM (github.com/deepseek-ai/DeepGEMM, the fp8 plugin's `deep_gemm` backend) on the lent
# GPU machine, which has nvcc and torch but no network, from a source tarball carried in benchmarks/.whl/.
#
# Here, once: the tarball from git repositories of DeepGEMM, CUTLASS and fmt (deepgemm_source.sh says how):
#   bash benchmarks/deepgemm_source.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT
# Device call (carry benchmarks/.whl):
#   export PYTHONPATH=$(bash benchmarks/deepgemm_build.sh)${PYTHONPATH:+:$PYTHONPATH}
#
# Prints the directory to put on PYTHONPATH (the package is used in place, as DeepGEMM's develop.sh
# does: its JIT compiles each kernel at first use with nvcc and reads the CUTLASS headers from
# deep_gemm/include). The build takes about 70 s on the GPU image; its extension (too large to come
# back through $OUT) is rebuilt in every call.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src=${DEEPGEMM_SRC:-$root/benchmarks/.whl/deepgemm-src.tar.gz}
dest=${DEEPGEMM_DIR:-/tmp/deepgemm}
py=${PYTHON:-python3}
if [ ! -f "$src" ]; then
  echo "deepgemm_build: no $src: make it as this script's header says and carry benchmarks/.whl" >&2
  exit 1
fi
rm -rf "$dest" && mkdir -p "$dest"
tar xzf "$src" -C "$dest" --strip-components=1
cd "$dest"
for d in cutlass cute; do ln -sfn "$dest/third-party/cutlass/include/$d" "deep_gemm/include/$d"; done
# The image's g++ (/opt/gcc) links libstdc++ into an extension statically. That copy's locale
# facets share their ids with the process's shared libstdc++ (GNU unique symbols) but not its
# tables: the first std::regex, or integer put to a stream, crashed (seen with cuda-gdb). Linking
# the shared libstdc++ that torch runs with, ahead of the static one, keeps one copy.
libstdcxx=$("$py" -c 'import torch; print(next(l.split()[-1] for l in open("/proc/self/maps") if "/libstdc++.so" in l))')
export LDFLAGS="${LDFLAGS:-} -Wl,--no-as-needed $libstdcxx"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} "$py" setup.py build_ext --inplace > "$dest/build.log" 2>&1 \
  || { tail -40 "$dest/build.log" >&2; echo "deepgemm_build: build failed (log: $dest/build.log)" >&2; exit 1; }
echo "deepgemm_build: built in $(( $(date +%s) - start )) s, against $libstdcxx" >&2
if ! ldd deep_gemm/_C*.so | grep -q 'libstdc++'; then
  echo "deepgemm_build: deep_gemm/_C*.so does not link libstdc++ dynamically:" \
    "its static copy of libstdc++ would crash (build log: $dest/build.log)" >&2
  exit 1
fi
PYTHONPATH="$dest" "$py" -c 'import deep_gemm, sys; print(f"deepgemm_build: deep_gemm {deep_gemm.__version__} imports", file=sys.stderr)' >&2
echo "$dest"
