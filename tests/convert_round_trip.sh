#!/usr/bin/env bash
# shardtorch-convert end to end on tests/data/dcp's sample a: DCP -> Hugging
# Face (several files) -> DCP, and a sharded checkpoint of the same values ->
# DCP; Python's safetensors and dcp_to_torch_save read what it wrote
# (tests/python/dcp/check_converted.py).
# usage: convert_round_trip.sh PYTHON SHARDTORCH_CONVERT SHARDTORCH_TESTS SOURCE_DIR WORK_DIR
set -euo pipefail
py=$1 convert=$2 tests=$3 src=$4 work=$5
rm -rf "$work"
mkdir -p "$work"
sample=$src/tests/data/dcp/a_fsdp2_fp32
"$convert" info "$sample" > "$work/info.txt"
grep -q "^optim.param_groups.0.betas  = (0.9, 0.999)$" "$work/info.txt"
grep -q "^model.l0.weight  Float \[5, 4\]  2 chunks$" "$work/info.txt"
"$convert" dcp-to-hf "$sample" "$work/hf" --max-file-bytes 64
"$convert" hf-to-dcp "$work/hf" "$work/dcp-from-hf"
# A sharded checkpoint of sample a's values (the model and AdamW loaded at 2 ranks, saved).
SHARDTORCH_CONVERT_DIR=$work "$tests" --gtest_also_run_disabled_tests --gtest_filter=DcpConvert.* > "$work/tests.txt" \
  || { cat "$work/tests.txt"; exit 1; }
"$convert" sharded-to-dcp "$work/sharded" "$work/dcp-from-sharded"
# The same checkpoint left aside by a save interrupted between its two renames
# (no DIR, only DIR.shardtorch-old) converts to the same files.
cp -r "$work/sharded" "$work/interrupted.shardtorch-old"
"$convert" sharded-to-dcp "$work/interrupted" "$work/dcp-from-aside" 2> "$work/aside.txt" \
  || { echo "convert_round_trip: sharded-to-dcp of a checkpoint set aside failed:" >&2; cat "$work/aside.txt" >&2; exit 1; }
for f in .metadata __0_0.distcp; do
  cmp -s "$work/dcp-from-sharded/$f" "$work/dcp-from-aside/$f" \
    || { echo "convert_round_trip: $f of the checkpoint set aside differs" >&2; exit 1; }
done
# One safetensors file named without a directory, written in bf16.
"$convert" dcp-to-safetensors "$sample" "$work/one.safetensors"
(cd "$work" && "$convert" hf-to-dcp one.safetensors dcp-from-one --dtype bf16)
"$convert" info "$work/dcp-from-one" > "$work/info-one.txt"
grep -q "^model.l0.weight  BFloat16 \[5, 4\]  1 chunk$" "$work/info-one.txt" \
  || { echo "convert_round_trip: hf-to-dcp of one.safetensors in bf16 wrote:" >&2; cat "$work/info-one.txt" >&2; exit 1; }
# A layout written again in fewer files leaves none of the earlier ones.
"$convert" dcp-to-hf "$sample" "$work/hf-again" --max-file-bytes 64
"$convert" dcp-to-hf "$sample" "$work/hf-again"
files=$(ls "$work/hf-again" | grep -c "safetensors$")
[ "$files" = 1 ] || { echo "convert_round_trip: $files data files after writing one over several" >&2; exit 1; }
if "$convert" dcp-to-hf "$sample" "$work/hf-zero" --max-file-bytes 0 2> "$work/zero.txt"; then
  echo "convert_round_trip: --max-file-bytes 0 was accepted" >&2
  exit 1
fi
grep -q "max-file-bytes must be positive" "$work/zero.txt"
# A refusal names what it refuses.
if "$convert" dcp-to-safetensors "$src/tests/data/dcp/h_nodist_st" "$work/h.safetensors" --prefix "" 2> "$work/refusal.txt"; then
  echo "convert_round_trip: a SerializationFormat.SAFETENSORS checkpoint was converted, not refused" >&2
  exit 1
fi
grep -q "SerializationFormat.SAFETENSORS" "$work/refusal.txt"
"$py" "$src/tests/python/dcp/check_converted.py" "$sample.expected.safetensors" "$work/hf" "$work/dcp-from-hf" \
  "$work/dcp-from-sharded" "$work"
