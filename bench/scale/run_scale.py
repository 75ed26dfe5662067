"""Runs examples/scale_gpt under torchrun with a memory guard, and tabulates
each rank's memory per phase against the planner and the target
(docs/scale.md). The guard polls MemAvailable every 20 ms and kills the whole
run (SIGKILL to its process group) when it falls below --guard-gib, recording
each rank's RSS and the last phase each rank finished: how an eager run that
does not fit is measured without taking the machine down.

    python bench/scale/run_scale.py --world 4 --out run.json -- --mode finetune --layers 26 --d-model 3072 --checkpoint /tmp/base
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time


def meminfo(field):
    """A /proc/meminfo field in bytes (0 if absent)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available():
    return meminfo("MemAvailable")


def descendants(root):
    kids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def rss_of(pid, field="VmRSS"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def wait_for_memory(want, limit_s=120):
    """Until MemAvailable is at least `want` bytes (the previous run's memory returned), at most limit_s."""
    t0 = time.time()
    while mem_available() < want and time.time() - t0 < limit_s:
        time.sleep(0.2)
    return mem_available()


def read_some(stream):
    try:
        return stream.read()
    except (BlockingIOError, TypeError):  # non-blocking text reads raise either when nothing is there
        return None


def gib(b):
    return f"{b / 2**30:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exe", default="build/examples/scale_gpt")
    ap.add_argument("--torchrun", default=".venv/bin/torchrun")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--guard-gib", type=float, default=1.5)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", required=True)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.args if x != "--"]
    cmd = [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.world), a.exe] + args
    print(" ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # A run killed just before may still be returning its memory.
    start_avail = wait_for_memory(meminfo("MemTotal") - 3 * 2**30)
    print(f"MemAvailable at start: {gib(start_avail)} GiB", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, env=env)
    os.set_blocking(proc.stdout.fileno(), False)
    lines, buf, killed, min_avail = [], "", None, mem_available()
    while True:
        chunk = read_some(proc.stdout)
        if chunk:
            buf += chunk
            *done, buf = buf.split("\n")
            for line in done:
                print(line, flush=True)
                lines.append(line)
        avail = mem_available()
        min_avail = min(min_avail, avail)
        if killed is None and (avail < a.guard_gib * 2**30 or time.time() - t0 > a.timeout):
            ranks = [(p, rss_of(p)) for p in descendants(proc.pid)]
            killed = {"why": "memory" if avail < a.guard_gib * 2**30 else "timeout", "mem_available": avail,
                      "seconds": time.time() - t0, "rss": sorted((r for _, r in ranks if r > 0), reverse=True)}
            os.killpg(proc.pid, signal.SIGKILL)
            for p, _ in ranks:  # torchrun may start its workers in sessions of their own
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            print(f"GUARD: killed the run ({killed['why']}), MemAvailable {gib(avail)} GiB, process RSS (GiB): "
                  + ", ".join(gib(r) for r in killed["rss"][:a.world]), flush=True)
        if proc.poll() is not None:
            os.set_blocking(proc.stdout.fileno(), True)
            rest = read_some(proc.stdout) or ""
            for line in (buf + rest).split("\n"):
                if line:
                    print(line, flush=True)
                    lines.append(line)
            break
        time.sleep(0.02)
    records = []
    for line in lines:
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    model = next((r for r in records if "model" in r), None)
    phases = [r for r in records if "phase" in r]
    summary = {"command": cmd, "returncode": proc.returncode, "killed": killed, "min_mem_available": min_avail,
               "seconds": time.time() - t0, "model": model, "phases": phases,
               "steps": [r for r in records if "step" in r]}
    if model and phases:
        plan, m = model["plan"], model["model"]
        startup = [r for r in phases if r["phase"] in ("construct", "shard", "load")]
        # The target: this rank's parameters after load (model_state/N) + the largest unit + 10%.
        params_after = {}
        for r in startup:
            if "lib" in r and "sharded_params" in r["lib"]:
                params_after[r["rank"]] = r["lib"]["sharded_params"][0]
        target = {k: 1.1 * (v + m["largest_unit_bytes"]) for k, v in params_after.items()}
        per_rank = {}
        for r in startup:
            d = per_rank.setdefault(r["rank"], {"hwm_above_baseline": 0, "lib_peak": 0})
            d["hwm_above_baseline"] = max(d["hwm_above_baseline"], r["vmhwm"] - r["baseline"])
            d["lib_peak"] = max(d["lib_peak"], r.get("lib_peak_sum", 0))
        for k, d in per_rank.items():
            d["target"] = target.get(k)
            d["meets_target_lib"] = d["target"] is not None and d["lib_peak"] <= d["target"]
            d["meets_target_rss"] = d["target"] is not None and d["hwm_above_baseline"] <= d["target"]
        summary["startup"] = per_rank
        print(f"\n{m['mode']} {m['init']}: {m['params'] / 1e9:.3f} B parameters ({m['trainable']} trainable), "
              f"world {m['world']}, largest unit {gib(m['largest_unit_bytes'])} GiB; planner: startup "
              f"deferred {gib(plan['startup_deferred'])} GiB, eager {gib(plan['startup_eager'])} GiB, "
              f"step peak {gib(plan['step_peak'])} GiB (model state {gib(plan['model_state'])} GiB)")
        print(f"{'phase':9} {'rank':>4} {'VmHWM':>7} {'-base':>7} {'RSS end':>7} {'lib sum':>7}  seconds  (GiB)")
        for r in phases:
            print(f"{r['phase']:9} {r['rank']:>4} {gib(r['vmhwm']):>7} {gib(r['vmhwm'] - r['baseline']):>7} "
                  f"{gib(r['vmrss']):>7} {gib(r.get('lib_peak_sum', 0)):>7}  {r['seconds']:.1f}")
        for k, d in sorted(per_rank.items()):
            print(f"rank {k}: construct+shard+load peak {gib(d['hwm_above_baseline'])} GiB over baseline (RSS), "
                  f"{gib(d['lib_peak'])} GiB (library), target {gib(d['target'] or 0)} GiB: "
                  f"{'met' if d['meets_target_rss'] else 'NOT met'} (RSS), "
                  f"{'met' if d['meets_target_lib'] else 'NOT met'} (library)")
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    sys.exit(0 if proc.returncode == 0 else 1)


if __name__ == "__main__":
    main()
