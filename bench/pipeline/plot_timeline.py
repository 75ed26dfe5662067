#!/usr/bin/env python3
"""Draws a pipeline step's timeline (Pipeline::write_timeline's JSON) as a PNG:
one row per rank, one box per action from its recorded start to its end.
Forwards and backwards are labelled with their stage and micro-batch; the
white space in a row is that rank's idle time (the bubble).

  plot_timeline.py TIMELINE.json OUT.png [--title TEXT]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"F": "#4c78a8", "B": "#59a14f", "recv": "#d3d3d3", "send": "#bab0ac", "unshard": "#f28e2b",
           "reshard": "#f28e2b", "sync": "#e15759"}


def kind(action):
    for k in ("F", "B"):
        if action.startswith(k) and action[1:2].isdigit():
            return k
    for k in ("recv", "send", "unshard", "reshard", "sync"):
        if action.startswith(k):
            return k
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    with open(a.timeline) as f:
        t = json.load(f)
    ranks = sorted(t["ranks"], key=lambda r: r["rank"])
    end = max((e["end"] for r in ranks for e in r["actions"]), default=1.0) * 1e3
    fig, ax = plt.subplots(figsize=(max(8, min(24, end / 8)), 0.6 * len(ranks) + 1.4))
    for row, r in enumerate(ranks):
        busy = 0.0
        for e in r["actions"]:
            k = kind(e["action"])
            s, d = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
            if k in ("F", "B"):
                busy += d
                ax.broken_barh([(s, d)], (row - 0.4, 0.8), facecolors=COLOURS[k], edgecolor="white", linewidth=0.5)
                if d > end / 60:
                    ax.text(s + d / 2, row, e["action"].split("+")[0][1:], ha="center", va="center", fontsize=7,
                            color="white")
            elif d > 0:
                ax.broken_barh([(s, d)], (row - 0.15, 0.3), facecolors=COLOURS.get(k, "#999999"))
        span = max((e["end"] for e in r["actions"]), default=0.0) * 1e3
        idle = 100.0 * (1 - busy / span) if span > 0 else 0.0
        ax.text(end * 1.005, row, f"idle {idle:.0f}%", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r['rank']} (pp {r['pipeline_rank']})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    title = a.title or (f"{t['schedule']}: {t['pipeline_ranks']} pipeline ranks x {t['chunks_per_rank']} chunk(s), "
                        f"{t['microbatches']} micro-batches (F: forward, B: backward, stage.micro-batch)")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, end * 1.08)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
