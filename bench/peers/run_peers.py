"""Side-by-side run of shardtorch (NoShard, FullShard) against PyTorch DDP and
FSDP2 (fully_shard) on the same GPT, the same data and the same initial
weights, on CPU with Gloo.

Rounds are interleaved (shardtorch no_shard, ddp, shardtorch full_shard,
fsdp2) so that drift in machine load hits every implementation alike. Each run
writes one report JSON per rank; this script prints a table of medians over
rounds, the shardtorch/PyTorch ratios, the ZeRO model-state formula beside the
measured bytes, and checks that all implementations produce the same losses.

  python bench/peers/run_peers.py [--nproc 2] [--rounds 3] [model options]
  python bench/peers/run_peers.py --python-only ...   (DDP and FSDP2 only; no C++ binary needed)

Exit status: 0 when every check passes, 1 when losses (or parameter counts)
disagree or a model-state target is not met, 2 when a run fails."""
import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from gpt_model import add_run_args  # noqa: E402
import runner  # noqa: E402

ORDER = ["no_shard", "ddp", "full_shard", "fsdp2"]  # one round
PAIRS = [("full_shard", "fsdp2"), ("no_shard", "ddp"), ("fsdp2", "ddp"), ("full_shard", "no_shard")]
SHARDED = {"full_shard", "fsdp2"}
PHASES = ("forward", "backward", "optimizer")


def die(msg):
    runner.die("run_peers", msg)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--rounds", type=int, default=3)
    add_run_args(p)
    p.add_argument("--bf16", action="store_true", help="bf16 compute/reduce (DDP is skipped: it has no such mode)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (OMP_NUM_THREADS for both sides)")
    p.add_argument("--python-only", action="store_true",
                   help="skip the shardtorch runs; python writes the initial weights")
    p.add_argument("--no-prefetch", action="store_true",
                   help="shardtorch full_shard without prefetch (FSDP2 prefetches one unit ahead by default)")
    p.add_argument("--python-init", action="store_true",
                   help="python writes the initial weights even when the shardtorch runs are on")
    p.add_argument("--compare-steps", type=int, default=5, help="first steps whose losses are checked")
    p.add_argument("--tol", type=float, default=None,
                   help="max |loss difference| / |loss| across impls (default 1e-4; 2e-2 with --bf16)")
    p.add_argument("--gpt-bench", default=os.path.join(ROOT, "build", "bench", "gpt_bench"))
    p.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "peers"), help="reports, logs, init file")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "peers", "summary.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = p.parse_args()
    if a.tol is None:
        a.tol = 2e-2 if a.bf16 else 1e-4
    return a


def model_flags(a):
    return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
            "--vocab", str(a.vocab), "--seq", str(a.seq)]


def train_flags(a):
    f = model_flags(a) + ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                          "--lr", repr(a.lr)]
    return f + (["--bf16"] if a.bf16 else []) + (["--fused-adam"] if a.fused_adam else [])


def run(cmd, log_path, a, env):
    runner.run_logged("run_peers", cmd, log_path, env, a.timeout)


def command_for(impl, a, init, prefix):
    if impl in ("no_shard", "full_shard"):
        return [a.torchrun, "--no-python", "--standalone", "--nproc-per-node", str(a.nproc), a.gpt_bench,
                "--strategy", impl] + train_flags(a) + ["--threads", str(a.threads), "--init", init,
                                                        "--report", prefix] + \
            (["--prefetch"] if impl == "full_shard" and not a.no_prefetch else [])
    return [a.torchrun, "--standalone", "--nproc-per-node", str(a.nproc), os.path.join(HERE, "peer_train.py"),
            "--mode", impl] + train_flags(a) + ["--threads", str(a.threads), "--init", init, "--report", prefix]


def load_reports(prefix, a, impl):
    reps = []
    for r, rep in enumerate(runner.rank_reports("run_peers", prefix, a.nproc, impl)):
        path = f"{prefix}.rank{r}.json"
        if rep.get("world") != a.nproc or rep.get("rank") != r:
            die(f"{path}: world/rank {rep.get('world')}/{rep.get('rank')}, expected {a.nproc}/{r}")
        want_impl = "shardtorch" if impl in ("no_shard", "full_shard") else impl
        if rep.get("impl") != want_impl or (want_impl == "shardtorch" and rep.get("strategy") != impl):
            print(f"run_peers: warning: {path} says impl={rep.get('impl')!r} strategy={rep.get('strategy')!r}, "
                  f"expected {want_impl!r}" + (f" / {impl!r}" if want_impl == "shardtorch" else ""), file=sys.stderr)
        want = {"vocab": a.vocab, "seq_len": a.seq, "d_model": a.d_model, "n_head": a.heads,
                "n_layer": a.layers, "batch": a.batch, "dtype": "bfloat16" if a.bf16 else "float32"}
        got = rep.get("config", {})
        bad = {k: (got[k], v) for k, v in want.items() if k in got and got[k] != v}
        fused = got.get("fused_adam", rep.get("fused_adam"))
        if fused is not None and fused != a.fused_adam:
            bad["fused_adam"] = (fused, a.fused_adam)
        if bad or len(rep.get("losses", [])) != a.warmup + a.steps or len(rep.get("step_ms", [])) != a.steps:
            die(f"{path} does not match the requested run: config (got, wanted) {bad}, "
                     f"{len(rep.get('losses', []))} losses, {len(rep.get('step_ms', []))} step times")
        reps.append(rep)
    return reps


def round_figures(reps):
    """One run's figures: the slowest rank's step time, every rank's peak memory."""
    def mx(key):
        vals = [r.get(key) for r in reps if r.get(key) is not None]
        return max(vals) if vals else None
    return {
        "p50_ms": max(r["p50_ms"] for r in reps),
        "p95_ms": max(r["p95_ms"] for r in reps),
        "tokens_per_s": min(r["tokens_per_s"] for r in reps),
        "peak_rss_bytes": mx("peak_rss_bytes"),
        "rss_above_baseline_bytes": (max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in reps)
                                     if all("baseline_rss_bytes" in r for r in reps) else None),
        "model_state_bytes": mx("model_state_bytes"),
        "comm_buffer_bytes": mx("comm_buffer_bytes"),
        # the slowest rank's p50 of each phase (forward, backward with its
        # communication, optimizer step)
        **{f"{k}_ms": max(r["phase_p50_ms"][k] for r in reps) if all("phase_p50_ms" in r for r in reps) else None
           for k in PHASES},
        "params": reps[0]["params"],
        "losses": reps[0]["losses"],
        "loss_rank_spread": max(abs(x - y) for r in reps for x, y in zip(r["losses"], reps[0]["losses"])),
    }


def median_of(rounds, key):
    vals = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def zero_formulas(a):
    """Bytes per rank of model state by the ZeRO paper's count, 16 bytes per
    element either way: fp32 params + grads + Adam moments (4+4+8), or under
    --bf16 its mixed-precision count, bf16 params + grads and fp32 masters +
    moments (2+2+12). Replicated (DDP / NoShard), ZeRO-3 exact 16*psi/N, and
    ZeRO-3 with the padding each sharded implementation adds (FSDP2: every
    parameter's dim 0 padded to a multiple of N; shardtorch: every unit's flat
    parameter padded to a multiple of N, units = blocks and the root)."""
    import torch
    from gpt_model import GPT

    with torch.device("meta"):
        m = GPT(vocab=a.vocab, seq_len=a.seq, d_model=a.d_model, n_head=a.heads, n_layer=a.layers)
    N = a.nproc
    psi = sum(p.numel() for p in m.parameters())
    fsdp2_local = 0
    for p in m.parameters():
        rows = p.shape[0]
        fsdp2_local += math.ceil(rows / N) * (p.numel() // rows)
    units = [list(b.parameters()) for b in m.blocks]
    in_blocks = {id(p) for u in units for p in u}
    units.append([p for p in m.parameters() if id(p) not in in_blocks])
    flat_local = sum(math.ceil(sum(p.numel() for p in u) / N) for u in units)
    return {
        "psi": psi,
        "replicated": 16 * psi,
        "zero3": 16 * psi / N,
        "zero3_padded": {"fsdp2": 16 * fsdp2_local, "full_shard": 16 * flat_local},
        "adam_step_tensors": len(list(m.parameters())),
    }


def fmt_mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def fmt(x, spec):
    if x is None:
        width = spec.split(".")[0]
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(x, spec)


def main():
    a = parse_args()
    impls = [i for i in ORDER if not (a.python_only and i in ("no_shard", "full_shard"))]
    if a.bf16 and "ddp" in impls:
        impls.remove("ddp")
        print("run_peers: --bf16: DDP skipped (it has no mixed-precision mode)")
    cpp = any(i in ("no_shard", "full_shard") for i in impls)
    if cpp and not os.path.exists(a.gpt_bench):
        die(f"{a.gpt_bench} not found: build it (target gpt_bench) or pass --python-only")
    if not os.path.exists(a.torchrun):
        die(f"torchrun not found at {a.torchrun}; pass --torchrun")
    os.makedirs(a.workdir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))

    init = os.path.join(a.workdir, "init.safetensors")
    if os.path.exists(init):
        os.remove(init)
    if cpp and not a.python_init:
        run([a.gpt_bench, "--save-init", init] + model_flags(a), os.path.join(a.workdir, "save_init.log"), a, env)
    else:
        run([sys.executable, os.path.join(HERE, "peer_train.py"), "--save-init", init] + model_flags(a),
            os.path.join(a.workdir, "save_init.log"), a, env)

    per_impl = {i: [] for i in impls}
    for k in range(a.rounds):
        for impl in impls:
            d = os.path.join(a.workdir, f"round{k}")
            os.makedirs(d, exist_ok=True)
            prefix = os.path.join(d, impl)
            for r in range(a.nproc):
                if os.path.exists(f"{prefix}.rank{r}.json"):
                    os.remove(f"{prefix}.rank{r}.json")
            print(f"[round {k + 1}/{a.rounds}] {impl}", flush=True)
            run(command_for(impl, a, init, prefix), prefix + ".log", a, env)
            per_impl[impl].append(round_figures(load_reports(prefix, a, impl)))

    formulas = zero_formulas(a)
    summary = {"config": {"nproc": a.nproc, "rounds": a.rounds, "layers": a.layers, "d_model": a.d_model,
                          "heads": a.heads, "vocab": a.vocab, "seq": a.seq, "batch": a.batch, "steps": a.steps,
                          "warmup": a.warmup, "lr": a.lr, "dtype": "bfloat16" if a.bf16 else "float32",
                          "threads": a.threads, "python_only": a.python_only, "fused_adam": a.fused_adam},
               "zero_formula": formulas, "impls": {}, "ratios": {}, "checks": []}
    med = {}
    for impl in impls:
        rounds = per_impl[impl]
        med[impl] = {key: median_of(rounds, key) for key in
                     ("p50_ms", "p95_ms", "tokens_per_s", "peak_rss_bytes", "rss_above_baseline_bytes",
                      "model_state_bytes", "comm_buffer_bytes") + tuple(f"{k}_ms" for k in PHASES)}
        summary["impls"][impl] = {"median": med[impl], "rounds": rounds}

    N = a.nproc
    print()
    print(f"GPT layers={a.layers} d_model={a.d_model} heads={a.heads} vocab={a.vocab} seq={a.seq} "
          f"batch/rank={a.batch} | {N} ranks, {a.threads} thread(s) each, Gloo, "
          f"{'bf16' if a.bf16 else 'fp32'} | {'fused AdamW' if a.fused_adam else 'AdamW'} | {a.steps} measured steps after {a.warmup} warm-up | "
          f"median of {a.rounds} rounds | psi = {formulas['psi']} parameters")
    print("step time: slowest rank's p50/p95 per run; memory: largest rank per run")
    hdr = (f"{'impl':<11} {'p50 ms':>9} {'p95 ms':>9} {'tokens/s':>10} {'peak RSS MiB':>13} "
           f"{'RSS-base MiB':>13} {'state B':>11} {'formula B':>11} {'+padding B':>11} {'state/form':>10}")
    print(hdr)
    print("-" * len(hdr))
    for impl in impls:
        m = med[impl]
        form = formulas["zero3"] if impl in SHARDED else formulas["replicated"]
        padded = formulas["zero3_padded"][impl] if impl in SHARDED else formulas["replicated"]
        m["formula_bytes"] = form
        m["formula_padded_bytes"] = padded
        ratio = m["model_state_bytes"] / form if m["model_state_bytes"] is not None else None
        print(f"{impl:<11} {fmt(m['p50_ms'], '9.2f')} {fmt(m['p95_ms'], '9.2f')} {fmt(m['tokens_per_s'], '10.0f')} "
              f"{fmt_mib(m['peak_rss_bytes']):>13} {fmt_mib(m['rss_above_baseline_bytes']):>13} "
              f"{fmt(m['model_state_bytes'], '11.0f')} {form:>11.0f} {padded:>11.0f} {fmt(ratio, '10.4f')}")
    print(f"phases (p50 ms): " + "; ".join(
        f"{impl} " + " / ".join(fmt(med[impl][f"{k}_ms"], ".1f") for k in PHASES) for impl in impls) +
        "  (" + " / ".join(PHASES) + ")")
    count = "(2+2+12)" if a.bf16 else "(4+4+8)"
    print(f"formula: DDP/no_shard {count}*psi = {formulas['replicated']} B; ZeRO-3 {count}*psi/N = "
          f"{formulas['zero3']:.0f} B; PyTorch AdamW adds a 4 B step tensor per parameter "
          f"({formulas['adam_step_tensors']} tensors)")
    if "ddp" in med and med["ddp"].get("comm_buffer_bytes"):
        print(f"DDP also keeps {med['ddp']['comm_buffer_bytes']:.0f} B of gradient buckets per rank "
              "(gradient_as_bucket_view=False), not counted in its state")

    if any(x in med and y in med for x, y in PAIRS):
        print()
        print("ratios (A / B)      step p50   tokens/s   peak RSS   RSS-base   model state")
    for x, y in PAIRS:
        if x not in med or y not in med:
            continue
        def r(key):
            u, v = med[x].get(key), med[y].get(key)
            return u / v if u is not None and v else None
        rat = {k: r(k) for k in ("p50_ms", "tokens_per_s", "peak_rss_bytes", "rss_above_baseline_bytes",
                                 "model_state_bytes")}
        summary["ratios"][f"{x}/{y}"] = rat
        print(f"{x + ' / ' + y:<20}{fmt(rat['p50_ms'], '9.3f')} {fmt(rat['tokens_per_s'], '10.3f')} "
              f"{fmt(rat['peak_rss_bytes'], '10.3f')} {fmt(rat['rss_above_baseline_bytes'], '10.3f')} "
              f"{fmt(rat['model_state_bytes'], '13.3f')}")

    failed = False
    # The step-time targets are reported, not enforced: timings depend on the
    # machine and its load (docs/benchmarks.md records measured runs).
    targets = [("full_shard", "fsdp2", "p50_ms", 0.8, "FullShard step time <= 0.8x FSDP2"),
               ("no_shard", "ddp", "p50_ms", 0.9, "NoShard step time <= 0.9x DDP")]
    summary["targets"] = []
    if any(x in med and y in med for x, y, *_ in targets):
        print()
    for x, y, key, limit, text in targets:
        rat = summary["ratios"].get(f"{x}/{y}", {}).get(key)
        if rat is None:
            continue
        met = rat <= limit
        summary["targets"].append({"target": text, "ratio": rat, "met": met})
        print(f"target {'MET' if met else 'NOT MET'}: {text} (measured {rat:.3f})")
    for impl in ("no_shard", "full_shard"):
        if impl in med and med[impl]["model_state_bytes"] is not None:
            bound = med[impl]["formula_padded_bytes"]
            met = med[impl]["model_state_bytes"] <= bound
            text = f"{impl} model state <= ZeRO formula plus padding ({bound:.0f} B)"
            summary["targets"].append({"target": text, "measured": med[impl]["model_state_bytes"], "met": met})
            print(f"target {'MET' if met else 'NOT MET'}: {text} (measured {med[impl]['model_state_bytes']:.0f} B)")
            # Unlike step time, memory does not depend on the machine's load:
            # this target is enforced.
            failed |= not met

    # losses: every impl, every round, rank-mean losses of the first steps
    print()
    K = min(a.compare_steps, a.warmup + a.steps)
    print("losses (rank mean, round 1)")
    print(f"{'step':>4} " + " ".join(f"{i:>12}" for i in impls) + f" {'max rel diff':>13}")
    for s in range(K):
        vals = [rd["losses"][s] for i in impls for rd in per_impl[i]]
        ref = abs(per_impl[impls[0]][0]["losses"][s]) or 1.0
        rel = (max(vals) - min(vals)) / ref
        print(f"{s:>4} " + " ".join(f"{per_impl[i][0]['losses'][s]:12.6f}" for i in impls) + f" {rel:13.3g}")
        ok = rel <= a.tol and all(math.isfinite(v) for v in vals)
        summary["checks"].append({"check": f"loss step {s}", "rel_diff": rel, "tol": a.tol, "pass": ok})
        failed |= not ok
    for s in range(K):
        c = summary["checks"][s]
        print(f"{'PASS' if c['pass'] else 'FAIL'} loss step {s}: max |diff| / |loss| = {c['rel_diff']:.3g} "
              f"across {len(impls)} impls x {a.rounds} rounds (tol {a.tol:g})")
    # informative: the whole run and the ranks' agreement
    all_rel = max((max(rd["losses"][s] for i in impls for rd in per_impl[i]) -
                   min(rd["losses"][s] for i in impls for rd in per_impl[i])) /
                  (abs(per_impl[impls[0]][0]["losses"][s]) or 1.0)
                  for s in range(a.warmup + a.steps))
    summary["all_steps_max_rel_loss_diff"] = all_rel
    print(f"info: over all {a.warmup + a.steps} steps max |diff| / |loss| = {all_rel:.3g}; "
          f"final losses " + ", ".join(f"{i} {per_impl[i][0]['losses'][-1]:.6f}" for i in impls))
    params = {i: per_impl[i][0]["params"] for i in impls}
    ok = len(set(params.values())) == 1 and formulas["psi"] in params.values()
    summary["checks"].append({"check": "params", "values": params, "pass": ok})
    print(f"{'PASS' if ok else 'FAIL'} parameter count: " + ", ".join(f"{i} {n}" for i, n in params.items())
          + f" (python model {formulas['psi']})")
    failed |= not ok

    summary["pass"] = not failed
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary: {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
