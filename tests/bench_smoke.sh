#!/usr/bin/env bash
# The micro-benchmarks run and write the JSON `make bench` writes, with every
# benchmark in it and a time for each; briefly (figures from a run this short
# mean nothing, and none is checked: docs/benchmarks.md has the real ones).
# usage: bench_smoke.sh PYTHON BENCH_CPU_ADAM BENCH_COMM OUTDIR BENCH_CHECKSUM
set -euo pipefail
python=$1 adam=$2 comm=$3 out=$4 sums=$5
rm -rf "$out" && mkdir -p "$out"
"$adam" --benchmark_min_time=0.01 --benchmark_filter='/1048576/' --benchmark_out="$out/cpu_adam.json" \
  --benchmark_out_format=json > "$out/cpu_adam.log" 2>&1 || { cat "$out/cpu_adam.log"; exit 1; }
"$comm" --benchmark_min_time=0.01 --benchmark_out="$out/comm.json" --benchmark_out_format=json \
  > "$out/comm.log" 2>&1 || { cat "$out/comm.log"; exit 1; }
"$sums" --benchmark_min_time=0.01 --benchmark_out="$out/checksum.json" --benchmark_out_format=json \
  > "$out/checksum.log" 2>&1 || { cat "$out/checksum.log"; exit 1; }
"$python" - "$out" <<'PY'
import json, sys
want = {
    "cpu_adam.json": ["BM_ShardtorchFusedAdam", "BM_AtFusedAdam", "BM_TorchOptimAdam", "BM_ShardtorchFusedAdamW",
                      "BM_ShardtorchFusedAdamWBf16Copy",
                      "BM_AtFusedAdamW", "BM_TorchOptimAdamW", "BM_StreamRoofline", "BM_TensorCopy",
                      "BM_PairedAdam", "BM_PairedAdamW"],
    "comm.json": ["BM_AllGather", "BM_ReduceScatter", "BM_BucketerCoalescing", "BM_AllReduceBucketer",
                  "BM_FlattenParams", "BM_UnflattenParams", "BM_StageGrads"],
    "checksum.json": ["BM_ChecksumXxh3", "BM_ChecksumFnv1a"],
}
for name, benches in want.items():
    runs = json.load(open(f"{sys.argv[1]}/{name}"))["benchmarks"]
    for b in benches:
        mine = [r for r in runs if r["name"].split("/")[0] == b]
        assert mine, f"{name}: no {b}"
        for r in mine:
            assert r.get("error_occurred") is not True and r["real_time"] > 0, r
    print(f"bench_smoke: {name}: {len(runs)} runs of {len(benches)} benchmarks")
PY
