#!/usr/bin/env bash
# Runs shardtorch-sweep and checks what it leaves behind, not only its exit
# status: sweep.csv with a header and one row per configuration, sweep.json
# with the same rows and nothing failed, and sweep.png a PNG image.
# usage: sweep_outputs.sh PYTHON ROWS OUT -- SWEEP_COMMAND... (the command gets --out OUT)
set -euo pipefail
python=$1 rows=$2 out=$3
shift 3
[ "$1" = "--" ] && shift
rm -rf "$out"
"$@" --out "$out"
fail() { echo "sweep_outputs: $*"; exit 1; }
[ -s "$out/sweep.csv" ] || fail "no sweep.csv"
lines=$(wc -l < "$out/sweep.csv")
[ "$lines" -eq $((rows + 1)) ] || fail "sweep.csv has $lines lines, expected a header and $rows rows"
header=$(head -1 "$out/sweep.csv")
for col in strategy world bucket_mb p50_ms p95_ms tokens_per_s peak_rss_bytes model_state_bytes \
           planned_model_state_bytes bytes_sent_per_step theory_bytes_per_step peak_gradients; do
  [[ ",$header," == *",$col,"* ]] || fail "sweep.csv has no column $col"
done
"$python" - "$out/sweep.json" "$rows" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
rows = s["rows"]
assert len(rows) == int(sys.argv[2]), f"sweep.json has {len(rows)} rows, expected {sys.argv[2]}"
assert s["failed"] == 0 and s["over_theory"] == 0, s
for r in rows:
    assert r["p50_ms"] > 0 and r["p95_ms"] >= r["p50_ms"] and r["tokens_per_s"] > 0, r
    assert r["model_state_bytes"] > 0 and r["peak_rss_bytes"] > r["model_state_bytes"], r
    assert abs(r["plan_error"]) <= 0.05, r
    assert (r["bytes_sent_per_step"] > 0) == (r["world"] > 1), r
print(f"sweep_outputs: sweep.json has {len(rows)} rows, all measured")
PY
[ "$(head -c 8 "$out/sweep.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] || fail "sweep.png is not a PNG"
echo "sweep_outputs: sweep.csv, sweep.json and sweep.png are complete"
