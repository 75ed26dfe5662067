#!/usr/bin/env python3
"""Each schedule's measured idle share (bubble) against its theory.

Runs gpt_bench --pp with a stand-in compute (--stand-in-ms: every layer
sleeps that long in forward and twice that in backward), so that each stage
takes a known time whatever the machine's cores, on a GPT of 6 blocks (8
pipeline layers) split into stages of equal layer counts. For each
configuration it prints the theory, (p - 1)/(v m + p - 1), and the measured
idle share of each pipeline rank: the share of the step outside its forwards
and backwards (the median over the measured steps). What the measurement
adds to the theory is what transfers, the real compute and the scheduling
cost.

  run_bubble.py --build build --venv .venv [--stand-in-ms 10] [--out bubble.json]
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import runner  # noqa: E402

CONFIGS = [  # schedule, pp, chunks per rank, micro-batches, split (8 layers: embed, blocks.0-5, head)
    ("gpipe", 2, 1, 4, "blocks.3"),
    ("1f1b", 2, 1, 4, "blocks.3"),
    ("gpipe", 2, 1, 8, "blocks.3"),
    ("1f1b", 2, 1, 8, "blocks.3"),
    ("1f1b", 4, 1, 8, "blocks.1,blocks.3,blocks.5"),
    ("interleaved_1f1b", 2, 2, 8, "blocks.1,blocks.3,blocks.5"),
    ("interleaved_1f1b", 4, 2, 8, "blocks.0,blocks.1,blocks.2,blocks.3,blocks.4,blocks.5,head"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--venv", default=".venv")
    ap.add_argument("--stand-in-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torchrun = os.path.abspath(os.path.join(a.venv, "bin", "torchrun"))
    bench = os.path.abspath(os.path.join(a.build, "bench", "gpt_bench"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sched, pp, v, m, split in CONFIGS:
            prefix = os.path.join(tmp, f"{sched}-pp{pp}-v{v}-m{m}")
            cmd = [torchrun, "--no-python", "--standalone", f"--nproc-per-node={pp}", bench, "--pp", str(pp),
                   "--schedule", sched, "--chunks", str(v), "--microbatches", str(m), "--split-at", split,
                   "--layers", "6", "--d-model", "64", "--heads", "2", "--seq", "32", "--batch", "8",
                   "--steps", str(a.steps), "--warmup", "2", "--stand-in-ms", str(a.stand_in_ms), "--quiet",
                   "--report", prefix]
            runner.run_logged("run_bubble", cmd, prefix + ".log")
            reports = runner.rank_reports("run_bubble", prefix, pp, "gpt_bench")
            idle = [rep["idle_share_p50"] for rep in sorted(reports, key=lambda x: x["pipeline_rank"])]
            rows.append({"schedule": sched, "pp": pp, "chunks": v, "microbatches": m,
                         "theory": reports[0]["theoretical_bubble"], "idle": idle,
                         "step_ms": max(rep["p50_ms"] for rep in reports)})
    print(f"stand-in {a.stand_in_ms} ms per layer forward, {2 * a.stand_in_ms} ms backward")
    print(f"{'schedule':<18}{'pp':>3}{'v':>3}{'m':>3}{'theory':>8}{'idle (mean)':>13}{'idle (max)':>12}{'step ms':>9}")
    for row in rows:
        mean = sum(row["idle"]) / len(row["idle"])
        print(f"{row['schedule']:<18}{row['pp']:>3}{row['chunks']:>3}{row['microbatches']:>3}"
              f"{100 * row['theory']:>7.1f}%{100 * mean:>12.1f}%{100 * max(row['idle']):>11.1f}%"
              f"{row['step_ms']:>9.0f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
