"""Plots a shardtorch-sweep result: per-rank memory against throughput, one
series per strategy (and offload policy, activation checkpointing and, when
the sweep ran several, bucket size). usage: plot_sweep.py SWEEP.json OUT.png

Each point is one configuration: x = tokens/s of the slowest rank, y = the
largest rank's peak device memory the library accounts for (the sum of the
peaks of its device categories; offloaded host bytes are left out, which is
what offload buys; activations are not accounted, so activation checkpointing
shows as the same memory at lower throughput: its saving is in the peak RSS
column of the CSV). Points of one model size are labelled with it."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


DEVICE = ("sharded_params", "replicated_params", "gradients", "optimizer_state", "gathered_params",
          "grad_staging", "buckets", "master_grads")


def per_rank_bytes(r):
    """Peak bytes on the compute device, by the library's accounting: the
    peaks of every device category (host_* left out: offload moves them there)."""
    return sum(r["peak_memory"].get(k, 0) for k in DEVICE)


def main(src, out):
    with open(src) as f:
        sweep = json.load(f)
    rows = sweep["rows"]
    if not rows:
        print("plot_sweep: no rows in " + src, file=sys.stderr)
        return 1
    models = sorted({(r["layers"], r["d_model"]) for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 5), squeeze=False)
    strategies = sorted({r["strategy"] for r in rows})
    colors = {s: plt.cm.tab10(i) for i, s in enumerate(strategies)}
    buckets = sorted({r.get("bucket_mb", 0) for r in rows})
    widths = {b: 1.0 + 1.2 * i for i, b in enumerate(buckets)}  # a thicker line per larger bucket
    for ax, (layers, d) in zip(axes[0], models):
        series = {}
        for r in rows:
            if (r["layers"], r["d_model"]) == (layers, d):
                series.setdefault((r["strategy"], bool(r["offload"]), bool(r.get("activation_checkpointing")),
                                   r.get("bucket_mb", 0)), []).append(r)
        for (strategy, offload, recompute, bucket), pts in sorted(series.items()):
            pts.sort(key=lambda r: r["world"])  # one line per strategy: world sizes in order
            xs = [r["tokens_per_s"] for r in pts]
            ys = [per_rank_bytes(r) / 2**20 for r in pts]
            ax.plot(xs, ys, marker="s" if offload else ("^" if recompute else "o"),
                    linestyle="--" if offload else (":" if recompute else "-"), color=colors[strategy],
                    linewidth=widths[bucket],
                    label=strategy + (" + offload" if offload else "") + (" + recompute" if recompute else "") +
                    (f" bucket {bucket:g} MB" if len(buckets) > 1 else ""))
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(f'N={r["world"]}', (x, y), fontsize=7, textcoords="offset points", xytext=(4, 3))
        ax.set_title(f"{layers} layers x d_model {d} ({pts[0]['params'] / 1e6:.1f}M params)")
        ax.set_xlabel("tokens/s (slowest rank)")
        ax.set_ylabel("peak device memory per rank, MiB")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    # Two lines: one plot's width does not hold the title on one.
    fig.suptitle(f'shardtorch sweep: GPT, batch {sweep["batch"]} x seq {sweep["seq"]} per rank, '
                 f'{sweep["steps"]} steps\n(library accounting; host bytes of offload left out)',
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
