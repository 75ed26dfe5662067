"""Side-by-side run of shardtorch's tensor parallelism (build/bench/gpt_bench
--tp) against PyTorch's (DTensor parallelize_module, bench/tp/torch_tp.py) on
the same GPT, the same initial weights (gpt_bench --save-init; gpt_bench --tp
builds the model from the same seed, bitwise the same), the same data and the
same plan, on CPU with Gloo; and, for the cost of tensor parallelism, a
data-parallel run of the same model and global batch (shardtorch FullShard
over dp x tp ranks) alone.

Configurations (--configs):
  tp        dp 1 x tp T                     shardtorch vs parallelize_module
  tp_sp     dp 1 x tp T, sequence parallel  shardtorch vs parallelize_module with SequenceParallel
  tp_dp     dp D x tp T: shardtorch FullShard over dp of the TP slices vs FSDP2 (fully_shard over
            mesh["dp"]) after parallelize_module over mesh["tp"]
  dp        dp D*T: shardtorch FullShard, --batch * D / (D*T) rows per rank (the global batch of tp_dp)

Rounds are interleaved (for each configuration: shardtorch, then PyTorch) so
that drift in machine load hits both alike. Prints per configuration the
medians over rounds of the slowest rank's step time, the ratio shardtorch /
PyTorch, the bytes shardtorch's ranks send per step (the tensor-parallel
collectives and the sharding's, ring estimates) and the tensor-parallel bytes
the formula predicts; checks that both implementations report the same losses,
and that dp and tp_dp, which see the same rows each step, do too.

  python bench/tp/run_tp_peers.py [--tp 2] [--dp 2] [--rounds 3] [--configs tp,tp_sp,tp_dp,dp]
      [model options]

Exit status: 0 when the losses agree within --tol and the counted
tensor-parallel bytes equal the formula, 1 when they do not, 2 when a run
fails."""
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

CONFIGS = ("tp", "tp_sp", "tp_dp", "dp")
PROG = "run_tp_peers"


def die(msg):
    runner.die(PROG, msg)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas of tp_dp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    add_run_args(p)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (OMP_NUM_THREADS for both)")
    p.add_argument("--tol", type=float, default=1e-5, help="max |loss difference| / max(1, |loss|)")
    p.add_argument("--gpt-bench", default=os.path.join(ROOT, "build", "bench", "gpt_bench"))
    p.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "tp-peers"))
    p.add_argument("--out", default=os.path.join(ROOT, "build", "tp-peers", "summary.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = p.parse_args()
    a.configs = a.configs.split(",")
    for c in a.configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; known: {','.join(CONFIGS)}")
    if "dp" in a.configs and (a.batch * a.dp) % (a.dp * a.tp):
        p.error(f"dp: the global batch {a.batch * a.dp} does not split over {a.dp * a.tp} ranks")
    return a


def shape(a, config):
    """(nproc, tp, dp, sequence parallel, rows per rank's replica)"""
    if config == "tp":
        return a.tp, a.tp, 1, False, a.batch
    if config == "tp_sp":
        return a.tp, a.tp, 1, True, a.batch
    if config == "tp_dp":
        return a.tp * a.dp, a.tp, a.dp, False, a.batch
    return a.tp * a.dp, 0, a.tp * a.dp, False, a.batch * a.dp // (a.tp * a.dp)


def impls(config):
    return ("shardtorch",) if config == "dp" else ("shardtorch", "pytorch")


def model_flags(a):
    return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
            "--vocab", str(a.vocab), "--seq", str(a.seq)]


def command_for(impl, a, config, init, prefix):
    nproc, tp, dp, sp, batch = shape(a, config)
    run = model_flags(a) + ["--batch", str(batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                            "--lr", repr(a.lr), "--threads", str(a.threads)]
    if a.fused_adam:
        run.append("--fused-adam")
    if impl == "shardtorch":
        cmd = [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(nproc), a.gpt_bench,
               "--strategy", "no_shard" if dp == 1 else "full_shard", "--report", prefix, "--quiet"] + run
        if tp:
            cmd += ["--tp", str(tp)] + (["--sequence-parallel"] if sp else [])
        return cmd
    return ([a.torchrun, "--standalone", "--nproc-per-node", str(nproc), os.path.join(HERE, "torch_tp.py"),
             "--tp", str(tp), "--init", init, "--report", prefix] + (["--sequence-parallel"] if sp else []) + run)


def load(prefix, a, config, impl):
    reps = runner.rank_reports(PROG, prefix, shape(a, config)[0], impl)
    for r, rep in enumerate(reps):
        if len(rep.get("losses", [])) != a.warmup + a.steps:
            die(f"{prefix}.rank{r}.json: {len(rep.get('losses', []))} losses, expected {a.warmup + a.steps}")
    return reps


def figures(reps):
    f = {"p50_ms": max(r["p50_ms"] for r in reps), "losses": reps[0]["losses"]}
    if "bytes_sent_per_step" in reps[0]:
        f["bytes_sent_per_step"] = max(r["bytes_sent_per_step"] for r in reps)
    if "tp_traffic_per_step" in reps[0]:
        f["tp_traffic"] = reps[0]["tp_traffic_per_step"]
        f["dp_traffic"] = reps[0]["dp_traffic_per_step"]
        f["tp_bytes"] = max(r["tp_traffic_per_step"]["bytes_sent"] for r in reps)
        f["dp_bytes"] = max(r["dp_traffic_per_step"]["bytes_sent"] for r in reps)
    return f


def tp_bytes_formula(a, config):
    """Bytes each rank sends per step in the tensor-parallel collectives (ring
    estimates: an all-reduce of S bytes sends 2 S (n-1)/n, an all-gather or a
    reduce-scatter of S bytes in all S (n-1)/n), float32, n = tp, A = B T d * 4
    the bytes of one activation [B, T, d] of a replica:
      each block: 2 all-reduces of A in forward (proj, fc2), 2 in backward (the
        input gradients of qkv and fc1): 8 A (n-1)/n; under sequence
        parallelism 4 all-gathers and 4 reduce-scatters instead, the same bytes,
        plus the all-reduce of the gradients of the parameters that run on a
        slice of the sequence (ln1, ln2: 2d each; the biases of proj and fc2:
        d each): 2 (6d * 4) (n-1)/n
      the ends: the embedding's all-reduce (forward) and the head's input
        gradient (backward): 4 A (n-1)/n; under sequence parallelism the
        embedding's reduce-scatter (forward) and all-gather (backward), the
        head's all-gather (forward) and reduce-scatter (backward), the same, plus
        ln_f's gradients (2 (2d * 4) (n-1)/n) and the position embedding's
        gradient all-gathered (T d * 4 (n-1)/n)
      the loss: 3 all-reduces of B (T-1) float32 (the logits' maximum, the sum
        of exponentials, the target's logit): 6 B (T-1) * 4 (n-1)/n"""
    _, n, _, sp, B = shape(a, config)
    T, d, L = a.seq, a.d_model, a.layers
    f = (n - 1) / n
    A = B * T * d * 4
    block = 8 * A * f + (2 * 6 * d * 4 * f if sp else 0)
    ends = 4 * A * f + ((2 * 2 * d * 4 + T * d * 4) * f if sp else 0)
    loss = 6 * B * (T - 1) * 4 * f
    return {"per_block": block, "total": L * block + ends + loss}


def loss_diff(xs, ys):
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(xs, ys))


def fmt_bytes(b):
    return "-" if b is None else f"{b / 2**20:.2f} MiB"


def main():
    a = parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    init = os.path.join(a.workdir, "init.safetensors")
    if not os.path.exists(a.gpt_bench):
        die(f"no {a.gpt_bench}; build it first (make build)")
    runner.run_logged(PROG, [a.gpt_bench, "--save-init", init] + model_flags(a),
                      os.path.join(a.workdir, "save-init.log"), env, a.timeout)
    results = {c: {i: [] for i in impls(c)} for c in a.configs}
    for rnd in range(a.rounds):
        for c in a.configs:
            for impl in impls(c):
                prefix = os.path.join(a.workdir, f"{c}.{impl}.round{rnd}")
                runner.run_logged(PROG, command_for(impl, a, c, init, prefix), prefix + ".log", env, a.timeout)
                results[c][impl].append(figures(load(prefix, a, c, impl)))

    failed, summary = [], {}
    print(f"\nGPT {a.layers} layers d_model {a.d_model} heads {a.heads} vocab {a.vocab} seq {a.seq}, "
          f"{a.batch} rows per replica, tp {a.tp}, dp {a.dp}; medians of {a.rounds} rounds of {a.steps} steps; "
          f"bytes: sent per step by the busiest rank (shardtorch)")
    print(f"{'config':<22} {'shardtorch ms':>13} {'pytorch ms':>11} {'ratio':>6} {'sent (tp + dp)':>22} "
          f"{'tp formula':>11} {'max loss diff':>14}")
    for c in a.configs:
        nproc, tp, dp, sp, batch = shape(a, c)
        st = results[c]["shardtorch"]
        m_st = statistics.median(r["p50_ms"] for r in st)
        s = {"nproc": nproc, "tp": tp, "dp": dp, "sequence_parallel": sp, "rows_per_replica": batch,
             "shardtorch_p50_ms": m_st, "bytes_sent_per_step": st[0]["bytes_sent_per_step"],
             "rounds": results[c]}
        diff = None
        if "pytorch" in results[c]:
            pt = results[c]["pytorch"]
            m_pt = statistics.median(r["p50_ms"] for r in pt)
            diff = max(loss_diff(r["losses"], q["losses"]) for r in st for q in pt)
            s.update(pytorch_p50_ms=m_pt, ratio=m_st / m_pt, max_loss_diff=diff)
            if diff > a.tol:
                failed.append(f"{c}: the losses differ by {diff:.2e} > {a.tol}")
        if tp:
            want = tp_bytes_formula(a, c)
            s.update(tp_bytes_sent_per_step=st[0]["tp_bytes"], dp_bytes_sent_per_step=st[0]["dp_bytes"],
                     tp_bytes_formula=want, tp_traffic=st[0]["tp_traffic"], dp_traffic=st[0]["dp_traffic"])
            if abs(st[0]["tp_bytes"] - want["total"]) > 1e-6 * want["total"] + 8:
                failed.append(f"{c}: the tensor-parallel collectives sent {st[0]['tp_bytes']:.0f} bytes per step, "
                              f"the formula says {want['total']:.0f}")
        summary[c] = s
        label = {"tp": f"tp {tp}", "tp_sp": f"tp {tp} + SP", "tp_dp": f"dp {dp} x tp {tp}",
                 "dp": f"dp {dp} (FullShard)"}[c]
        sent = (f"{fmt_bytes(st[0]['tp_bytes'])} + {fmt_bytes(st[0]['dp_bytes'])}" if tp
                else fmt_bytes(st[0]["bytes_sent_per_step"]))
        print(f"{label:<22} {m_st:>13.1f} {s.get('pytorch_p50_ms', float('nan')):>11.1f} "
              f"{s.get('ratio', float('nan')):>6.2f} {sent:>22} "
              f"{fmt_bytes(s['tp_bytes_formula']['total']) if tp else '-':>11} "
              f"{'-' if diff is None else f'{diff:.2e}':>14}")
    if "dp" in a.configs and "tp_dp" in a.configs:  # the same rows each step: the same losses
        diff = max(loss_diff(r["losses"], q["losses"])
                   for r in results["dp"]["shardtorch"] for q in results["tp_dp"]["shardtorch"])
        summary["dp_vs_tp_dp_max_loss_diff"] = diff
        print(f"dp {a.dp * a.tp} against dp {a.dp} x tp {a.tp} (shardtorch, the same global batch): "
              f"max loss diff {diff:.2e}")
        if diff > a.tol:
            failed.append(f"dp against tp_dp: the losses differ by {diff:.2e} > {a.tol}")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "configs": summary}, f, indent=1)
    print(f"summary: {a.out}")
    for msg in failed:
        print(f"{PROG}: {msg}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
