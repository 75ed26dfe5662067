#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then configures, builds and
# runs tests/consumer against it with find_package(shardtorch).
# usage: install_test.sh BUILD_DIR SOURCE_DIR PREFIX_PATH [TORCH_DIR]
set -euo pipefail
build=$1 src=$2 prefix_path=$3 torch_dir=${4:-}
# A fixed place under the build tree, so that ccache (when the consumer's
# compiler runs through it) finds the consumer objects of the last run: the
# compiler's command line names this directory.
tmp=$build/install-test
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/include/shardtorch/sharded.h"
test -f "$tmp/prefix/lib/cmake/shardtorch/shardtorchConfig.cmake"
test -f "$tmp/prefix/share/shardtorch/examples/llama.h"  # the examples the docs show
# The installed library's run path reaches LibTorch's libraries itself.
c10=$(ldd "$build/libshardtorch.so" | awk '/libc10\.so/ {print $3}')
case $c10 in
  /*) torch_lib=$(dirname "$c10") ;;
  *) echo "ldd did not resolve libc10.so for $build/libshardtorch.so (got '$c10'): no run path to check against"; exit 1 ;;
esac
readelf -d "$tmp/prefix/lib/libshardtorch.so" | grep -E "R(UN)?PATH" | grep -q "$torch_lib" || {
  echo "installed libshardtorch.so has no run path to LibTorch's libraries ($torch_lib):"
  readelf -d "$tmp/prefix/lib/libshardtorch.so" | grep -E "R(UN)?PATH"; exit 1; }
# Each installed library finds what it needs with no help from the
# environment (the testing library: libshardtorch beside it).
for lib in libshardtorch.so libshardtorch_testing.so; do
  if env -u LD_LIBRARY_PATH ldd "$tmp/prefix/lib/$lib" | grep -q "not found"; then
    echo "the installed $lib does not find every library it needs:"
    env -u LD_LIBRARY_PATH ldd "$tmp/prefix/lib/$lib" | grep "not found"; exit 1
  fi
done
# The installed tools start with no help from the environment: their run
# path reaches libshardtorch beside them and LibTorch's libraries.
for tool in shardtorch-plan shardtorch-convert; do
  env -u LD_LIBRARY_PATH "$tmp/prefix/bin/$tool" --help > "$tmp/$tool.log" 2>&1 || {
    echo "the installed $tool did not start:"; cat "$tmp/$tool.log"; exit 1; }
done
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# As the build's own ccache settings (CMakeLists.txt): paths under the source
# tree hashed relative to it, so checkouts elsewhere share the objects.
export CCACHE_BASEDIR=$src CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime
torch=()
[ -n "$torch_dir" ] && torch=(-DTorch_DIR="$torch_dir")
cmake -S "$src/tests/consumer" -B "$tmp/build" "${launcher[@]}" "${torch[@]}" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix;$prefix_path" > "$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" -j2 > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
"$tmp/build/consumer_parity"
# A program that finds another LibTorch release than the library's is refused
# at configure time, naming both (a stand-in LibTorch package of version 1.0).
fake="$tmp/fake-torch"
mkdir -p "$fake"
echo 'set(TORCH_FOUND TRUE)' > "$fake/TorchConfig.cmake"
printf 'set(PACKAGE_VERSION "1.0.0")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' > "$fake/TorchConfigVersion.cmake"
if cmake -S "$src/tests/consumer" -B "$tmp/build-fake" -DTorch_DIR="$fake" \
     -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure-fake.log" 2>&1; then
  echo "a consumer configured against LibTorch 1.0 although the library was built against another"; exit 1
fi
# CMake wraps the message: compare it as one line.
tr -s ' \n' ' ' < "$tmp/configure-fake.log" |
  grep -q "was built against LibTorch [0-9]*\.[0-9]*.* found LibTorch '1.0.0'" || {
  echo "the LibTorch mismatch was not named:"; cat "$tmp/configure-fake.log"; exit 1; }
echo "install test: the tools started; consumer and consumer_parity built and ran; a LibTorch 1.0 consumer was refused"
