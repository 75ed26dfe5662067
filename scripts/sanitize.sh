#!/usr/bin/env bash
# Builds the library and its test suite with AddressSanitizer and
# UndefinedBehaviorSanitizer in build-sanitize/ and runs the suite there
# (docs/testing.md, "Sanitizers"). LibTorch stays uninstrumented: ASan sees
# every heap block (it replaces malloc) but checks only our code's accesses.
#
#   scripts/sanitize.sh                 # every test (a 13-minute build, then ~10 minutes on 2 cores)
#   scripts/sanitize.sh 'Recompute'     # a ctest regex (-R)
#   BUILD=/tmp/san SANITIZE=address scripts/sanitize.sh
#
# Runs ctest there, less the fuzz targets (their own ASan build, run by
# `make test`) and the install test (its consumer is built without the
# sanitizer runtime). Exits non-zero on a build failure, a failing test, or
# any sanitizer report (-fno-sanitize-recover and halt_on_error: the first
# report ends its process, and its test fails).
set -euo pipefail
cd "$(dirname "$0")/.."
REGEX=${1:-.}
BUILD=${BUILD:-build-sanitize}
SANITIZE=${SANITIZE:-address,undefined}
JOBS=${JOBS:-2}
bash scripts/setup.sh
PY=.venv/bin/python3
cmake -S . -B "$BUILD" -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DSHARDTORCH_PYTHON="$PWD/$PY" -DSHARDTORCH_SANITIZE="$SANITIZE" \
  -DSHARDTORCH_BUILD_EXAMPLES=ON -DSHARDTORCH_BUILD_BENCH=ON -DSHARDTORCH_BUILD_TESTS=ON > "$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j"$JOBS"
# detect_leaks=0: LibTorch's registries are allocated once and never freed.
# alloc_dealloc_mismatch=0: LibTorch and the standard library may pair
# new[]/delete differently across uninstrumented code.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$BUILD" && ctest --output-on-failure -j"$JOBS" -R "$REGEX" -E 'fuzz|install'
