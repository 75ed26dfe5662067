"""A large DCP checkpoint written by torch (FSDP2), loaded at another world
size by shardtorch (bench/dcp_load_bench.cpp) and by torch's own dcp.load,
on this machine: each load's time (the slowest rank's) and each rank's
memory during it. A benchmark, not a test: the figures depend on the machine
and on the page cache (the checkpoint is read right after it is written, or
after the other loader read it: from memory, not from disk).

usage: run_dcp_bench.py --build build --venv .venv --dir /tmp/dcp-bench [--layers 16 --width 8192 --dtype fp32]
       (make dcp-bench)"""
import argparse
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))


def launch(cmd, env=None, records=None):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-4000:]}")
    # Each rank's record is a JSON object; the ranks' lines may still meet on one.
    want, records, decoder = records, [], json.JSONDecoder()
    for line in r.stdout.splitlines():
        at = 0
        while line.startswith("{", at):
            record, at = decoder.raw_decode(line, at)
            records.append(record)
    if want is not None and len(records) != want:
        sys.exit(f"expected {want} records (one per rank), read {len(records)}: {' '.join(cmd)}\n{r.stdout[-4000:]}")
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--venv", default=".venv")
    ap.add_argument("--dir", default="/tmp/shardtorch-dcp-bench")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--save-world", type=int, default=2)
    ap.add_argument("--load-world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torchrun = os.path.join(a.venv, "bin", "torchrun")
    shape = [str(a.layers), str(a.width), a.dtype]
    meta = os.path.join(a.dir, "bench.json")
    written = json.load(open(meta)) if os.path.exists(meta) else None
    if not written or [str(written["layers"]), str(written["width"]), written["dtype"]] != shape \
            or written["saved_at_world"] != a.save_world:
        subprocess.run(["rm", "-rf", a.dir], check=True)
        launch([torchrun, "--standalone", f"--nproc-per-node={a.save_world}", os.path.join(here, "save_large.py"),
                a.dir] + shape)
        written = json.load(open(meta))
    env = dict(os.environ, PYTHONPATH=here)
    runs = {"shardtorch": [], "torch": []}
    for _ in range(a.repeats):
        runs["shardtorch"].append(launch([torchrun, "--no-python", "--standalone", f"--nproc-per-node={a.load_world}",
                                          os.path.join(a.build, "bench", "dcp_load_bench"), "--dir", a.dir,
                                          "--layers", shape[0], "--width", shape[1], "--dtype", shape[2]],
                                         records=a.load_world))
        runs["torch"].append(launch([torchrun, "--standalone", f"--nproc-per-node={a.load_world}",
                                     os.path.join(here, "load_large.py"), a.dir] + shape, env=env,
                                    records=a.load_world))
    summary = {"checkpoint": written, "load_world": a.load_world, "runs": runs}
    chunk = written["largest_chunk_bytes"]
    gib = 1024 ** 3
    print(f"{written['parameters'] / 1e9:.2f} B parameters ({a.dtype}), saved by torch at {a.save_world} ranks "
          f"(largest chunk {chunk / gib:.3f} GiB), loaded at {a.load_world} ranks:")
    for who, rs in runs.items():
        times = [max(r["seconds"] for r in ranks) for ranks in rs]
        grown = [max(r["peak_rss_during_load"] - r["rss_before_model"] for r in ranks) for ranks in rs]
        shard = max(r["shard_bytes"] for r in rs[0])
        bound = shard + chunk
        print(f"  {who:10s}: load {', '.join(f'{t:.2f}' for t in times)} s; the model's memory at its peak during "
              f"the load {max(grown) / gib:.3f} GiB per rank at most, against shard + one chunk "
              f"{bound / gib:.3f} GiB ({max(grown) / bound:.2f}x)")
        summary[who] = {"seconds": times, "peak_model_bytes": grown, "shard_bytes": shard, "bound_bytes": bound}
    wrong = sum(r.get("pieces_wrong", 0) for ranks in runs["shardtorch"] for r in ranks)
    print("  shardtorch's loaded values:", "all equal to what torch wrote" if wrong == 0 else f"{wrong} pieces differ")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
