#!/usr/bin/env bash
# Checks shardtorch against LibTorch 2.11 (the torch on the GPU machine) on a
# machine with no GPU: the torch 2.11 wheel on PyPI is a CUDA build, but its
# libtorch_cpu.so runs on the CPU once libcudart and libcupti can be loaded
# (taken from their PyPI wheels; no GPU or CUDA toolkit needed).
#
#   scripts/libtorch211/check.sh              # the freed-parameter storage code (seconds)
#   scripts/libtorch211/check.sh --deferred   # the test binary only, its Deferred* tests
#   scripts/libtorch211/check.sh --suite      # the whole build and ctest (about 15 min)
#
# WORK (default /tmp/t211) keeps the downloads (about 1 GB); BUILD (default
# $WORK/build, $WORK/build-tests for --deferred) is the build folder.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${WORK:-/tmp/t211}
pip=${PIP:-$repo/.venv/bin/pip}
mkdir -p "$work" && cd "$work"
ls torch-2.11.0-*.whl > /dev/null 2>&1 || "$pip" download --no-deps -q -d . torch==2.11.0
ls nv/nvidia_cuda_runtime-13*.whl > /dev/null 2>&1 ||
  "$pip" download --no-deps -q -d nv "nvidia-cuda-runtime==13.*" "nvidia-cuda-cupti==13.*"
# extract WHEEL DEST PATTERN...: the wheel's members matching a pattern.
extract() {
  "$repo/.venv/bin/python3" - "$@" <<'PY'
import fnmatch, sys, zipfile
whl, dest, *pats = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if any(fnmatch.fnmatch(n, p) for p in pats)])
PY
}
if [ ! -f full/torch/extracted ]; then  # written last: a partial extraction is redone
  extract "$(ls torch-2.11.0-*.whl | head -n 1)" full 'torch/lib/libtorch_cpu.so' 'torch/lib/libc10.so' \
    'torch/lib/libgomp.so.1' 'torch/include/*'
  touch full/torch/extracted
fi
# Beside torch/ as in site-packages: libtorch_cpu.so's own RPATH
# ($ORIGIN/../../nvidia/cu13/lib) finds them there, for every binary that
# loads it (an executable's RUNPATH does not serve its libraries' needs).
if [ ! -f full/nvidia/extracted ]; then
  for w in nv/*.whl; do extract "$w" full 'nvidia/*'; done
  touch full/nvidia/extracted
fi
torch=$work/full/torch

mode=${1:-}
case "$mode" in ""|--suite|--deferred) ;; *) echo "usage: $0 [--suite|--deferred]" >&2; exit 2 ;; esac
if [ -z "$mode" ]; then
  # 2.11 sets a storage's data-access error but cannot lift it; the library
  # lifts it through LibTorch's flag there (docs/design.md). Expects three "ok".
  g++ -std=c++20 -O1 -I"$repo/include" -I"$repo/src" -I"$torch/include" -I"$torch/include/torch/csrc/api/include" \
    "$here/freed_storage_probe.cpp" "$repo/src/base/errors.cpp" -o probe \
    -L"$torch/lib" -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,-rpath,"$torch/lib"
  exec ./probe
fi

# The wheel's own TorchConfig.cmake wants the CUDA toolkit; this one gives
# the CPU libraries only (so no NCCL backend and no CUDA tests).
mkdir -p cmake
cat > cmake/TorchConfig.cmake <<CONFIG
set(TORCH_INSTALL_PREFIX $torch)
if(NOT TARGET torch)
  add_library(torch INTERFACE IMPORTED)
  set_target_properties(torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "$torch/include;$torch/include/torch/csrc/api/include"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=1"
    INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed;$torch/lib/libtorch_cpu.so;$torch/lib/libc10.so;-Wl,--as-needed;-Wl,-rpath,$torch/lib")
endif()
set(TORCH_LIBRARIES torch)
set(TORCH_INCLUDE_DIRS "$torch/include;$torch/include/torch/csrc/api/include")
set(Torch_FOUND TRUE)
CONFIG
if [ "$mode" = --deferred ]; then
  # Deferred construction's tests (Deferred*, HfCheckpoint.Deferred*): the
  # library and the test binary, without fault tolerance, examples or benchmarks.
  build=${BUILD:-$work/build-tests}
  cmake -S "$repo" -B "$build" -DTorch_DIR="$work/cmake" -DSHARDTORCH_FT=OFF -DSHARDTORCH_BUILD_EXAMPLES=OFF \
    -DSHARDTORCH_BUILD_BENCH=OFF > configure.log || { cat configure.log; exit 1; }
  cmake --build "$build" -j"${JOBS:-2}" --target shardtorch_tests
  cd "$build/tests" && exec ./shardtorch_tests --gtest_filter='Deferred*:HfCheckpoint.Deferred*'
fi
build=${BUILD:-$work/build}
cmake -S "$repo" -B "$build" -DTorch_DIR="$work/cmake" -DSHARDTORCH_PYTHON="$repo/.venv/bin/python3" > configure.log ||
  { cat configure.log; exit 1; }
cmake --build "$build" -j"${JOBS:-2}"
cd "$build" && ctest --output-on-failure -j"${JOBS:-2}"
