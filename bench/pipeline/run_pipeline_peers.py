"""Side-by-side run of shardtorch's pipeline (build/bench/gpt_bench --pp) against
PyTorch's torch.distributed.pipelining (bench/pipeline/torch_pipeline.py) on
the same GPT, the same initial weights (gpt_bench --save-init; the pipeline
builds the model deferred from the same seed, bitwise the same), the same
data and global batch, the same stages, schedules and micro-batch counts, on
CPU with Gloo.

Rounds are interleaved (for each schedule: shardtorch, then PyTorch) so that
drift in machine load hits both alike. Prints, per schedule, the medians over
rounds of the slowest rank's step time and idle share, the ratio
shardtorch / PyTorch, and checks that both report the same losses.

  python bench/pipeline/run_pipeline_peers.py [--nproc 2] [--pp 2] [--rounds 3]
      [--schedules gpipe,1f1b,interleaved_1f1b] [--microbatches 8] [model options]

Exit status: 0 when the losses agree within --tol, 1 when they do not, 2 when
a run fails."""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "peers"))
sys.path.insert(0, os.path.dirname(HERE))

from gpt_model import add_run_args  # noqa: E402
import runner  # noqa: E402

IMPLS = ("shardtorch", "pytorch")


def die(msg):
    runner.die("run_pipeline_peers", msg)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (pp x dp)")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--chunks", type=int, default=2, help="chunks per rank for interleaved_1f1b")
    add_run_args(p)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (OMP_NUM_THREADS for both)")
    p.add_argument("--tol", type=float, default=1e-5, help="max |loss difference| / |loss| across the two")
    p.add_argument("--gpt-bench", default=os.path.join(ROOT, "build", "bench", "gpt_bench"))
    p.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "pipeline-peers"))
    p.add_argument("--out", default=os.path.join(ROOT, "build", "pipeline-peers", "summary.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = p.parse_args()
    if a.nproc % a.pp:
        p.error(f"--pp {a.pp} does not divide --nproc {a.nproc}")
    return a


def model_flags(a):
    return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
            "--vocab", str(a.vocab), "--seq", str(a.seq)]


def run_flags(a, schedule):
    chunks = a.chunks if schedule == "interleaved_1f1b" else 1
    return model_flags(a) + ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                             "--lr", repr(a.lr), "--pp", str(a.pp), "--schedule", schedule,
                             "--microbatches", str(a.microbatches), "--chunks", str(chunks),
                             "--threads", str(a.threads)]


def run(cmd, log_path, a, env):
    runner.run_logged("run_pipeline_peers", cmd, log_path, env, a.timeout)


def command_for(impl, a, schedule, init, prefix):
    if impl == "shardtorch":
        return [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.nproc), a.gpt_bench,
                "--strategy", "no_shard" if a.nproc == a.pp else "full_shard", "--report", prefix,
                "--quiet"] + run_flags(a, schedule)
    return [a.torchrun, "--standalone", "--nproc-per-node", str(a.nproc), os.path.join(HERE, "torch_pipeline.py"),
            "--init", init, "--report", prefix] + run_flags(a, schedule)


def load(prefix, a, impl):
    reps = runner.rank_reports("run_pipeline_peers", prefix, a.nproc, impl)
    for r, rep in enumerate(reps):
        if len(rep.get("losses", [])) != a.warmup + a.steps:
            die(f"{prefix}.rank{r}.json: {len(rep.get('losses', []))} losses, expected {a.warmup + a.steps}")
    return reps


def figures(reps):
    return {
        "p50_ms": max(r["p50_ms"] for r in reps),
        "idle_share": max(r.get("idle_share_p50", 0.0) for r in reps),
        "losses": reps[0]["losses"],
        "stages": reps[0].get("stages"),
    }


def main():
    a = parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    init = os.path.join(a.workdir, "init.safetensors")
    if not os.path.exists(a.gpt_bench):
        die(f"no {a.gpt_bench}; build it first (make build)")
    run([a.gpt_bench, "--save-init", init] + model_flags(a), os.path.join(a.workdir, "save-init.log"), a, env)
    schedules = a.schedules.split(",")
    results = {s: {i: [] for i in IMPLS} for s in schedules}
    for rnd in range(a.rounds):
        for s in schedules:
            for impl in IMPLS:
                prefix = os.path.join(a.workdir, f"{s}.{impl}.round{rnd}")
                run(command_for(impl, a, s, init, prefix), prefix + ".log", a, env)
                results[s][impl].append(figures(load(prefix, a, impl)))
    worst, summary = 0.0, {}
    print(f"\n{a.nproc} ranks: pp {a.pp} x dp {a.nproc // a.pp}, {a.microbatches} micro-batches, GPT "
          f"{a.layers} layers d_model {a.d_model} seq {a.seq} batch {a.batch} per pipeline, medians of {a.rounds} "
          f"rounds of {a.steps} steps")
    print(f"{'schedule':<18} {'shardtorch ms':>14} {'pytorch ms':>11} {'ratio':>6} {'idle st':>8} {'idle pt':>8} "
          f"{'max loss diff':>14}")
    for s in schedules:
        st, pt = results[s]["shardtorch"], results[s]["pytorch"]
        m_st = statistics.median(r["p50_ms"] for r in st)
        m_pt = statistics.median(r["p50_ms"] for r in pt)
        diff = max(abs(x - y) / max(1.0, abs(y)) for r in st for q in pt for x, y in zip(r["losses"], q["losses"]))
        worst = max(worst, diff)
        def layers(stages):  # shardtorch lists each stage's layers; PyTorch's report, dicts with "layers"
            return [x["layers"] if isinstance(x, dict) else x for x in stages]

        if layers(st[0]["stages"]) != layers(pt[0]["stages"]):
            print(f"run_pipeline_peers: {s}: the stages differ: {st[0]['stages']} vs {pt[0]['stages']}",
                  file=sys.stderr)
            worst = float("inf")
        summary[s] = {"shardtorch_p50_ms": m_st, "pytorch_p50_ms": m_pt, "ratio": m_st / m_pt,
                      "shardtorch_idle": statistics.median(r["idle_share"] for r in st),
                      "pytorch_idle": statistics.median(r["idle_share"] for r in pt), "max_loss_diff": diff,
                      "rounds": {"shardtorch": st, "pytorch": pt}}
        print(f"{s:<18} {m_st:>14.1f} {m_pt:>11.1f} {m_st / m_pt:>6.2f} "
              f"{summary[s]['shardtorch_idle']:>8.2f} {summary[s]['pytorch_idle']:>8.2f} {diff:>14.2e}")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "schedules": summary}, f, indent=1)
    print(f"summary: {a.out}")
    if worst > a.tol:
        print(f"run_pipeline_peers: losses differ by {worst:.2e} > {a.tol}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
