#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then configures, builds and
# runs tests/consumer against it with find_package(shardtorch).
# usage: install_test.sh BUILD_DIR SOURCE_DIR TORCH_PREFIX
set -euo pipefail
build=$1 src=$2 torch_prefix=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/include/shardtorch/sharded.h"
test -f "$tmp/prefix/lib/cmake/shardtorch/shardtorchConfig.cmake"
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/tests/consumer" -B "$tmp/build" "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix;$torch_prefix" > "$tmp/configure.log"
cmake --build "$tmp/build" -j2 > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
