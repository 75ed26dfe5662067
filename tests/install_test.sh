#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then configures, builds and
# runs tests/consumer against it with find_package(shardtorch).
# usage: install_test.sh BUILD_DIR SOURCE_DIR PREFIX_PATH [TORCH_DIR]
set -euo pipefail
build=$1 src=$2 prefix_path=$3 torch_dir=${4:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/include/shardtorch/sharded.h"
test -f "$tmp/prefix/lib/cmake/shardtorch/shardtorchConfig.cmake"
# The installed library's run path reaches LibTorch's libraries itself.
torch_lib=$(dirname "$(ldd "$build/libshardtorch.so" | awk '/libc10\.so/ {print $3}')")
readelf -d "$tmp/prefix/lib/libshardtorch.so" | grep -E "R(UN)?PATH" | grep -q "$torch_lib" || {
  echo "installed libshardtorch.so has no run path to LibTorch's libraries ($torch_lib):"
  readelf -d "$tmp/prefix/lib/libshardtorch.so" | grep -E "R(UN)?PATH"; exit 1; }
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
torch=()
[ -n "$torch_dir" ] && torch=(-DTorch_DIR="$torch_dir")
cmake -S "$src/tests/consumer" -B "$tmp/build" "${launcher[@]}" "${torch[@]}" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix;$prefix_path" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" -j2 > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
