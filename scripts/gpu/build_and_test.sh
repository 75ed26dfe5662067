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

mkdir -p "$DEPS/.unpacked"
for f in .gpu/debs/*.deb; do
  stamp=$DEPS/.unpacked/$(basename "$f")
  [ -e "$stamp" ] || { dpkg -x "$f" "$DEPS" && touch "$stamp"; }
done
ARCH_LIB=$DEPS/usr/lib/x86_64-linux-gnu
# Development links that point at a library the packages did not bring (the C
# runtime's, OpenSSL's, zlib's: this machine's own) are pointed at this
# machine's copy of it, found by ldconfig under the link's name.
LDCONFIG=$(command -v ldconfig || echo /sbin/ldconfig)
find "$DEPS" -xtype l 2>/dev/null | while read -r link; do
  stem=$(basename "$link"); stem=${stem%%.so*}.so
  own=$("$LDCONFIG" -p | awk -v s="$stem" 'index($1, s ".") == 1 && $1 ~ /\.so\.[0-9]+$/ && $0 ~ /x86-64/ {print $NF; exit}')
  [ -n "$own" ] && ln -sf "$own" "$link"
done
export LD_LIBRARY_PATH=$ARCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/usr/local/cuda/bin:$PATH
PY=$(command -v python3)
# torchft's lighthouse for the fault-tolerance tests: the wheel for this
# Python, unpacked (a wheel is a zip) onto PYTHONPATH.
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEEL=$(ls .gpu/wheels/torchft_nightly-*-"$PYTAG"-*.whl 2>/dev/null | head -1)
if [ -n "$WHEEL" ]; then
  [ -d "$DEPS/py/torchft" ] || "$PY" -m zipfile -e "$WHEEL" "$DEPS/py"
  export PYTHONPATH=$DEPS/py${PYTHONPATH:+:$PYTHONPATH}
fi
# Fault tolerance when gRPC's packages and the lighthouse came along, unless
# SHARDTORCH_GPU_FT=0; a configure or build that fails with it is redone
# without it, so the rest still runs.
FT=OFF
if [ "${SHARDTORCH_GPU_FT:-1}" = 1 ] && [ -d "$ARCH_LIB/cmake/grpc" ] && [ -n "$WHEEL" ]; then FT=ON; fi
TORCH_PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  nproc
} 2>&1 | tee "$LOGS/machine.txt"

rc=0
configure() {  # $1: ON or OFF (fault tolerance)
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${SHARDTORCH_CUDA_ARCH:-90}" \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$DEPS/usr" -DGLOO_INCLUDE_DIR="$DEPS/usr/include" \
    -DSHARDTORCH_FT="$1" -DSHARDTORCH_PYTHON="$PY" >"$LOGS/configure-ft-$1.log" 2>&1
}
build() {
  # SHARDTORCH_GPU_TARGETS: build only these (e.g. "shardtorch_cuda_tests").
  local targets=()
  for t in ${SHARDTORCH_GPU_TARGETS:-}; do targets+=(--target "$t"); done
  cmake --build "$BUILD" -j"$(nproc)" "${targets[@]}" >"$LOGS/build-ft-$FT.log" 2>&1
}
if [[ " $STEPS " == *" build "* ]]; then
  say "configure (fault tolerance $FT)"
  if ! configure "$FT"; then
    tail -40 "$LOGS/configure-ft-$FT.log"
    [ "$FT" = ON ] || exit 1
    say "configure failed with fault tolerance: again without it"
    FT=OFF; rm -f "$BUILD/CMakeCache.txt"
    configure OFF || { tail -40 "$LOGS/configure-ft-OFF.log"; exit 1; }
  fi
  grep -i "nccl\|cuda\|fault tolerance" "$LOGS/configure-ft-$FT.log" | head -6
  say "build"
  if ! build; then
    grep -E "error|Error" -A5 "$LOGS/build-ft-$FT.log" | head -80
    [ "$FT" = ON ] || exit 1
    say "build failed with fault tolerance: again without it"
    FT=OFF; configure OFF && build || { grep -E "error|Error" -A5 "$LOGS/build-ft-OFF.log" | head -80; exit 1; }
  fi
  say "built (fault tolerance $FT)"
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
