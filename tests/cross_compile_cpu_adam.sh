#!/usr/bin/env bash
# The fused CPU Adam's kernels compile for aarch64 (the portable variant; the
# x86 variants are left out there): src/optim/adam_kernels.cpp, which sees no
# LibTorch header, with the flags CMakeLists.txt gives it, through the
# aarch64 cross compiler. The object must be an aarch64 object.
# Usage: cross_compile_cpu_adam.sh CROSS_CXX SOURCE_DIR OUT_DIR
set -euo pipefail
cxx=$1 src=$2 out=$3
mkdir -p "$out"
obj=$out/adam_kernels.aarch64.o
rm -f "$obj"
"$cxx" -std=c++20 -O3 -fno-math-errno -fPIC -Wall -Wextra -Wno-unused-parameter \
  -I"$src/include" -I"$src/src" -c "$src/src/optim/adam_kernels.cpp" -o "$obj"
desc=$(file -b "$obj" 2>/dev/null || readelf -h "$obj" | grep Machine)
echo "adam_kernels.cpp for aarch64: $desc"
case $desc in
  *aarch64* | *AArch64* | *ARM\ aarch64*) ;;
  *) echo "not an aarch64 object"; exit 1 ;;
esac
# The x86 variants are left out, the portable one is in.
syms=$(nm -C "$obj")
if grep -q 'adam_avx' <<<"$syms"; then
  echo "the aarch64 object has x86 variants:"; grep 'adam_avx' <<<"$syms"; exit 1
fi
grep -q 'adam_default' <<<"$syms" || { echo "the aarch64 object has no portable variant"; exit 1; }
