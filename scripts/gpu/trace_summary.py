#!/usr/bin/env python3
"""Summarises a Chrome trace written by gpt_bench --profile (LibTorch's
profiler, one training step) into a few lines kept in the repository
(docs/gpu.md): the step's phases (gpt_bench.forward/backward/optimizer), the
CPU operators and CUDA runtime calls with the most time of their own, the
device's kernels and copies by kind (a copy's name says pinned or pageable),
and the host's waits.

  python3 scripts/gpu/trace_summary.py trace.rank0.json [--top 25]"""
import argparse
import collections
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    with open(a.trace) as f:
        events = json.load(f).get("traceEvents", [])
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    by_cat = collections.defaultdict(list)
    for e in complete:
        by_cat[e.get("cat", "")].append(e)
    print(f"{a.trace}: {len(complete)} complete events; categories: "
          + ", ".join(f"{k} {len(v)}" for k, v in sorted(by_cat.items())))

    print("\n== phases (user annotations), ms")
    for e in sorted(by_cat.get("user_annotation", []), key=lambda e: e["ts"]):
        print(f"  {e['name']:<28} {e['dur'] / 1e3:9.2f}")

    # Self time of CPU ops on each thread: duration less that of the ops nested in it.
    cpu = sorted(by_cat.get("cpu_op", []), key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    self_us = collections.Counter()
    calls = collections.Counter()
    stack = []
    for e in cpu:
        while stack and (stack[-1].get("tid") != e.get("tid") or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        if stack:
            self_us[stack[-1]["name"]] -= e["dur"]
        self_us[e["name"]] += e["dur"]
        calls[e["name"]] += 1
        stack.append(e)
    print(f"\n== CPU operators by self time (top {a.top}), ms")
    for name, us in self_us.most_common(a.top):
        print(f"  {name[:60]:<60} {us / 1e3:9.2f}  x{calls[name]}")

    rt = collections.Counter()
    rt_n = collections.Counter()
    for e in by_cat.get("cuda_runtime", []) + by_cat.get("cuda_driver", []):
        rt[e["name"]] += e["dur"]
        rt_n[e["name"]] += 1
    print(f"\n== CUDA runtime calls by time (top {a.top}), ms")
    for name, us in rt.most_common(a.top):
        print(f"  {name[:60]:<60} {us / 1e3:9.2f}  x{rt_n[name]}")

    dev = collections.Counter()
    dev_n = collections.Counter()
    dev_bytes = collections.Counter()
    for cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        for e in by_cat.get(cat, []):
            name = e["name"] if cat != "kernel" else "kernel: " + e["name"][:50]
            dev[name] += e["dur"]
            dev_n[name] += 1
            dev_bytes[name] += int(e.get("args", {}).get("bytes", 0) or 0)
    print(f"\n== device activity by name (top {a.top}), ms (copies with bytes and GB/s)")
    for name, us in dev.most_common(a.top):
        extra = ""
        if dev_bytes[name]:
            extra = f"  {dev_bytes[name] / 1e6:9.1f} MB  {dev_bytes[name] / us / 1e3:6.1f} GB/s"
        print(f"  {name[:60]:<60} {us / 1e3:9.2f}  x{dev_n[name]}{extra}")
    busy = sum(e["dur"] for c in ("kernel", "gpu_memcpy", "gpu_memset") for e in by_cat.get(c, []))
    ann = by_cat.get("user_annotation", [])
    if ann:
        span = max(e["ts"] + e["dur"] for e in ann) - min(e["ts"] for e in ann)
        print(f"\nstep span {span / 1e3:.2f} ms; device busy (sum of kernels and copies) {busy / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
