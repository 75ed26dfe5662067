#!/usr/bin/env bash
# The GPU procedure's pieces that need no GPU (scripts/gpu/measure.sh,
# docs/gpu.md), on the CPU with a tiny GPT: gpt_bench's LibTorch-alone
# baseline (--strategy plain) trains and reports; --profile writes a Chrome
# trace that scripts/gpu/trace_summary.py reads (the phases, CPU operators);
# the plain baseline and FullShard start from the same seed and agree on the
# first loss; measure.sh parses.
# usage: gpu_procedure_dry_run.sh PYTHON GPT_BENCH TORCHRUN SOURCE_DIR OUTDIR
set -euo pipefail
python=$1 gpt=$2 torchrun=$3 src=$4 out=$5
rm -rf "$out" && mkdir -p "$out"
bash -n "$src/scripts/gpu/measure.sh"
tiny=(--layers 2 --d-model 32 --heads 4 --vocab 64 --seq 16 --batch 2 --steps 3 --warmup 1 --quiet)
"$torchrun" --no-python --standalone --nproc-per-node 1 "$gpt" "${tiny[@]}" --strategy plain \
  --report "$out/plain" > "$out/plain.log" 2>&1 || { cat "$out/plain.log"; exit 1; }
"$torchrun" --no-python --standalone --nproc-per-node 1 "$gpt" "${tiny[@]}" --strategy full_shard \
  --report "$out/full" --profile "$out/trace" > "$out/full.log" 2>&1 || { cat "$out/full.log"; exit 1; }
"$torchrun" --no-python --standalone --nproc-per-node 1 "$gpt" "${tiny[@]}" --strategy full_shard --deferred \
  --report "$out/deferred" > "$out/deferred.log" 2>&1 || { cat "$out/deferred.log"; exit 1; }
# Refused: the baseline is one process without the library's options.
if "$torchrun" --no-python --standalone --nproc-per-node 1 "$gpt" "${tiny[@]}" --strategy plain --offload \
    > "$out/refused.log" 2>&1; then
  echo "gpt_bench --strategy plain --offload was accepted"; exit 1
fi
grep -q "strategy plain takes none of --offload" "$out/refused.log" || { cat "$out/refused.log"; exit 1; }
"$python" "$src/scripts/gpu/trace_summary.py" "$out/trace.rank0.json" > "$out/summary.txt"
"$python" - "$out" <<'PY'
import json, sys
d = sys.argv[1]
plain = json.load(open(f"{d}/plain.rank0.json"))
full = json.load(open(f"{d}/full.rank0.json"))
assert plain["strategy"] == "plain" and full["strategy"] == "full_shard", (plain["strategy"], full["strategy"])
for r in (plain, full):
    assert len(r["step_ms"]) == 3 and r["p50_ms"] > 0 and r["tokens_per_s"] > 0, r
    assert r["threads"] == 1, r["threads"]  # one ATen thread a rank on the CPU
    assert "device_peak_allocated_bytes" in r
assert plain["model_state_bytes"] == 0 and full["model_state_bytes"] > 0
# Same seed, same data, same model: the first loss is the same computation.
assert abs(plain["losses"][0] - full["losses"][0]) <= 1e-5 * abs(plain["losses"][0]), (plain["losses"], full["losses"])
# Deferred construction initialises each unit as eager construction would: the same losses, bitwise.
deferred = json.load(open(f"{d}/deferred.rank0.json"))
assert deferred["losses"] == full["losses"], (deferred["losses"], full["losses"])
s = open(f"{d}/summary.txt").read()
for phase in ("gpt_bench.forward", "gpt_bench.backward", "gpt_bench.optimizer"):
    assert phase in s, f"trace summary lacks {phase}:\n{s}"
assert "aten::" in s, s
print("gpu_procedure_dry_run: plain and full_shard reports, profile and its summary are complete")
PY
