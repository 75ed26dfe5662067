#!/usr/bin/env bash
# Builds the safetensors header fuzz target with clang (libFuzzer, ASan, UBSan)
# and runs it for a short fixed time on the seed corpus (copied, so the repo's
# corpus is not modified). usage: run_fuzz.sh SOURCE_DIR BUILD_DIR [SECONDS]
set -euo pipefail
src=$1 build=$2 seconds=${3:-20}
cxx=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$cxx" ]; then
  echo "run_fuzz: clang++ not found; scripts/setup.sh installs clang-14 and libclang-rt-14-dev" >&2
  exit 1
fi
out=$build/fuzz
mkdir -p "$out/corpus" "$out/artifacts"
cp -n "$src"/tests/fuzz/corpus/* "$out/corpus/" 2>/dev/null || true
bin=$out/fuzz_safetensors_header
if [ ! -x "$bin" ] || [ "$src/src/checkpoint/safetensors_format.cpp" -nt "$bin" ] || \
   [ "$src/tests/fuzz/fuzz_safetensors_header.cpp" -nt "$bin" ]; then
  "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$src/include" "$src/tests/fuzz/fuzz_safetensors_header.cpp" "$src/src/checkpoint/safetensors_format.cpp" -o "$bin"
fi
"$bin" -max_total_time="$seconds" -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$out/corpus" 2>&1 | tail -15
