#!/usr/bin/env bash
# Runs the library's freed-parameter storage code (src/storage_access.cpp)
# against LibTorch 2.11's own headers and libraries, on a machine with no GPU:
# the torch 2.11 wheel on PyPI is a CUDA build, so its libtorch_cpu.so needs
# libcudart/libcupti, which load without a GPU (taken from their PyPI wheels).
# 2.11 sets a storage's data-access error but cannot lift it; the library
# lifts it through LibTorch's flag there (docs/design.md). Expects three "ok".
# Usage: scripts/libtorch211/check.sh [workdir]   (downloads about 1 GB once)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${1:-/tmp/t211}
pip=${PIP:-$repo/.venv/bin/pip}
mkdir -p "$work" && cd "$work"
ls torch-2.11.0-*.whl > /dev/null 2>&1 || "$pip" download --no-deps -q -d . torch==2.11.0
ls nv/nvidia_cuda_runtime-13*.whl > /dev/null 2>&1 ||
  "$pip" download --no-deps -q -d nv "nvidia-cuda-runtime==13.*" "nvidia-cuda-cupti==13.*"
if [ ! -f full/torch/lib/libtorch_cpu.so ]; then
  unzip -o -q torch-2.11.0-*.whl 'torch/lib/libtorch_cpu.so' 'torch/lib/libc10.so' 'torch/lib/libgomp.so.1' \
    'torch/include/*' -d full
fi
[ -f nv/nvidia/cu13/lib/libcudart.so.13 ] || (cd nv && for w in *.whl; do unzip -o -q "$w"; done)
inc=$work/full/torch/include lib=$work/full/torch/lib cuda=$work/nv/nvidia/cu13/lib
g++ -std=c++17 -O1 -I"$inc" -I"$inc/torch/csrc/api/include" "$here/freed_storage_probe.cpp" -o probe \
  -L"$lib" -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,-rpath,"$lib:$cuda"
./probe
