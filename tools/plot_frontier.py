#!/usr/bin/env python3
"""Draws the planner's frontier (frontier.csv from remat-train --plan-report)
as predicted extra time against predicted peak, the knee and the plan in
effect marked.

    python3 plot_frontier.py DIR/frontier.csv DIR/frontier.png

Needs matplotlib (Debian: apt-get install python3-matplotlib). remat-train
writes this script beside the CSV and runs it when matplotlib is there.
"""
import csv
import sys


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: plot_frontier.py FRONTIER_CSV OUTPUT_PNG")
    with open(argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{argv[1]} has no points")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = [float(r["predicted_peak_mib"]) for r in rows]
    extra = [float(r["extra_ms"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.step(peak, extra, where="post", color="0.75", linewidth=1, zorder=1)
    ax.plot(peak, extra, "o", color="tab:blue", markersize=4, zorder=2, label="plans on the frontier")
    ax.plot([peak[0], peak[-1]], [extra[0], extra[-1]], "--", color="0.6", linewidth=1,
            label="line joining the ends")
    for r, x, y in zip(rows, peak, extra):
        if r["knee"] == "1":
            ax.plot(x, y, "*", color="tab:red", markersize=14, zorder=3,
                    label=f"knee: {x:.2f} MiB, {y:.1f} ms ({float(r['budget_fraction']):.2f} of keeping all)")
        if r["chosen"] == "1":
            ax.plot(x, y, "o", markerfacecolor="none", markeredgecolor="black", markersize=11, zorder=4,
                    label="plan in effect")
    ax.set_xlabel("predicted activation peak (MiB)")
    ax.set_ylabel("predicted extra time per step (ms)")
    ax.set_title(f"planner frontier: {len(rows)} plans")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[2])


if __name__ == "__main__":
    main(sys.argv)
