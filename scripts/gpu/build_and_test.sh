#!/usr/bin/env bash
# Run on a lent GPU machine (docs/gpu.md): unpacks the .deb files that
# scripts/gpu/fetch_debs.sh downloaded (carried in .gpu/debs), builds the
# project against the machine's CUDA torch, runs the CUDA tests and then the
# whole CPU suite. Logs go to $OUT (the device tool's folder) when set, else
# to build-gpu/logs. With the device tool, from this machine:
#   scripts/gpu/fetch_debs.sh
#   run(command="scripts/gpu/build_and_test.sh", carry=[".gpu"])
# SHARDTORCH_GPU_STEPS picks the steps (default "build cuda ctest"); "bench"
# adds the GPU measurements (scripts/gpu/bench.sh). SHARDTORCH_GPU_TARGETS
# limits the build to some targets.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${OUT:-$ROOT/build-gpu/logs}
DEPS=/opt/shardtorch-deps
BUILD=$ROOT/build-gpu
STEPS=${SHARDTORCH_GPU_STEPS:-build cuda ctest}
mkdir -p "$LOGS"
say() { echo "[gpu $(date +%H:%M:%S)] $*"; }

if [ ! -d "$DEPS/usr" ]; then
  mkdir -p "$DEPS"
  for f in .gpu/debs/*.deb; do dpkg -x "$f" "$DEPS"; done
fi
ARCH_LIB=$DEPS/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$ARCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/usr/local/cuda/bin:$PATH
PY=$(command -v python3)
TORCH_PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  nproc
} 2>&1 | tee "$LOGS/machine.txt"

rc=0
if [[ " $STEPS " == *" build "* ]]; then
  say "configure"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${SHARDTORCH_CUDA_ARCH:-90}" \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$DEPS/usr" -DGLOO_INCLUDE_DIR="$DEPS/usr/include" \
    -DSHARDTORCH_FT=OFF -DSHARDTORCH_PYTHON="$PY" >"$LOGS/configure.log" 2>&1 || { tail -40 "$LOGS/configure.log"; exit 1; }
  grep -i "nccl\|cuda" "$LOGS/configure.log" | head -5
  say "build"
  # SHARDTORCH_GPU_TARGETS: build only these (e.g. "shardtorch_cuda_tests").
  targets=()
  for t in ${SHARDTORCH_GPU_TARGETS:-}; do targets+=(--target "$t"); done
  cmake --build "$BUILD" -j"$(nproc)" "${targets[@]}" >"$LOGS/build.log" 2>&1 || { grep -E "error|Error" -A5 "$LOGS/build.log" | head -80; exit 1; }
  say "built"
fi
if [[ " $STEPS " == *" cuda "* ]]; then
  say "CUDA tests"
  # One process per test (ctest), as in the CPU suite.
  (cd "$BUILD" && ctest -L cuda --timeout 600 --output-on-failure) >"$LOGS/cuda_tests.log" 2>&1 || rc=1
  grep -E "Test +#|tests passed|rank [0-9]+:" "$LOGS/cuda_tests.log" | cut -c1-400 | head -40
fi
if [[ " $STEPS " == *" ctest "* ]]; then
  say "CPU suite (ctest)"
  # GPUs hidden: the suite forks its ranks, and a parent that has touched
  # CUDA (torch::manual_seed does, on a CUDA build) leaves the children
  # unable to use it (docs/testing.md).
  (cd "$BUILD" && CUDA_VISIBLE_DEVICES= ctest -LE cuda -j12 --timeout 300 --output-on-failure) >"$LOGS/ctest.log" 2>&1 || rc=1
  grep -E "tests passed|FAILED|Failed|\*\*\*" "$LOGS/ctest.log" | head -40
fi
if [[ " $STEPS " == *" bench "* ]]; then
  bash scripts/gpu/bench.sh "$BUILD" "$LOGS" || rc=1
fi
say "done rc=$rc"
exit $rc
