#!/usr/bin/env bash
# Builds a checkpoint parser fuzz target with clang (libFuzzer, ASan, UBSan)
# and runs it for a short fixed time on its seed corpus (copied, so the
# repo's corpus is not modified).
# usage: run_fuzz.sh SOURCE_DIR BUILD_DIR [SECONDS] [TARGET]
#   TARGET: safetensors_header (the default: tests/fuzz/corpus) or
#           checkpoint_index (index.json: tests/fuzz/index_corpus)
#           hf_index (model.safetensors.index.json: tests/fuzz/hf_index_corpus)
#           dcp_metadata (a DCP checkpoint's .metadata pickle: tests/fuzz/dcp_metadata_corpus)
set -euo pipefail
src=$(cd "$1" && pwd) build=$2 seconds=${3:-20} target=${4:-safetensors_header}
cxx=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$cxx" ]; then
  echo "run_fuzz: clang++ not found; scripts/setup.sh installs clang-14 and libclang-rt-14-dev" >&2
  exit 1
fi
case $target in
  safetensors_header) corpus=corpus; sources=("$src/src/checkpoint/safetensors_format.cpp"); libs=() ;;
  checkpoint_index) corpus=index_corpus; sources=("$src/src/checkpoint/index_format.cpp" "$src/src/checkpoint/checksum.cpp"); libs=(-lboost_json) ;;
  hf_index) corpus=hf_index_corpus; sources=("$src/src/checkpoint/hf_index.cpp"); libs=(-lboost_json) ;;
  dcp_metadata) corpus=dcp_metadata_corpus
    sources=("$src/src/checkpoint/dcp_metadata.cpp" "$src/src/checkpoint/pickle_reader.cpp" "$src/src/checkpoint/hf_index.cpp")
    libs=(-lboost_json) ;;
  *) echo "run_fuzz: unknown target '$target' (safetensors_header, checkpoint_index, hf_index or dcp_metadata)" >&2; exit 1 ;;
esac
out=$build/fuzz/$target
mkdir -p "$out/corpus" "$out/artifacts"
out=$(cd "$out" && pwd)
seeds=("$src/tests/fuzz/$corpus"/*)
if [ ! -e "${seeds[0]}" ]; then
  echo "run_fuzz: the seed corpus $src/tests/fuzz/$corpus is missing or empty" >&2
  exit 1
fi
for f in "${seeds[@]}"; do  # the corpus kept from earlier runs stays
  [ -e "$out/corpus/$(basename "$f")" ] || cp "$f" "$out/corpus/"
done
bin=$out/fuzz_$target
stale=0
[ -x "$bin" ] || stale=1
for f in "${sources[@]}" "$src/tests/fuzz/fuzz_$target.cpp" "$src"/src/checkpoint/*.h "$src"/include/shardtorch/checkpoint/*.h; do
  if [ "$f" -nt "$bin" ]; then stale=1; fi
done
if [ $stale = 1 ]; then
  # One object per source through ccache where there is one: a fresh build
  # tree then compiles (about 20 s for the largest target) only what changed.
  flags=(-std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$src/include" -I"$src/src")
  launcher=$(command -v ccache || true)
  objects=()
  for f in "$src/tests/fuzz/fuzz_$target.cpp" "${sources[@]}"; do
    o=$out/$(basename "$f" .cpp).o
    # As the build's own ccache settings: paths under the source directory
    # hashed relative to the working directory, so that another clone of the
    # same sources (every CI run's) hits.
    (cd "$out" && CCACHE_BASEDIR="$src" CCACHE_NOHASHDIR=1 $launcher "$cxx" "${flags[@]}" -c "$f" -o "$o")
    objects+=("$o")
  done
  "$cxx" "${flags[@]}" "${objects[@]}" "${libs[@]}" -o "$bin"
fi
"$bin" -max_total_time="$seconds" -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$out/corpus" 2>&1 | tail -15
