#!/usr/bin/env python3
"""Plots a remat memory timeline (the Chrome trace JSON of remat-train's
--memory-trace or Engine::trace_memory) as a stacked area of the memory by
category over the step, with the step's phases, recomputes and collectives
in lanes below and the peak marked.

    python3 tools/plot_memory_trace.py TRACE.json [OUT.png]

OUT.png defaults to TRACE's name with .png. Needs matplotlib (Debian/Ubuntu:
apt-get install python3-matplotlib); exits with status 3 without it.
"""
import json
import sys

COUNTER = " memory by category"
TRACKED = " memory tracked"
# The categories' colours, in the trace's order (otherData.categories).
COLOURS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer state": "#8172b3",
    "gathered units": "#64b5cd",
    "saved activations": "#55a868",
    "checkpoint inputs": "#c44e52",
    "offloaded host copies": "#937860",
    "communication buffers": "#da8bc3",
    "other": "#b0b0b0",
    "host optimizer": "#ccb974",
    "host parameters": "#8c8c3c",
}


def unit_for(peak):
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= 4 * size:
            return name, float(size)
    return "bytes", 1.0


def counters(events, device):
    by_cat, tracked = [], []
    for e in events:
        if e.get("ph") != "C":
            continue
        if e["name"] == device + COUNTER:
            by_cat.append((e["ts"] / 1000.0, e["args"]))
        elif e["name"] == device + TRACKED:
            tracked.append((e["ts"] / 1000.0, e["args"]["tracked"]))
    by_cat.sort(key=lambda x: x[0])
    tracked.sort(key=lambda x: x[0])
    return by_cat, tracked


def spans(events):
    """(lane, name, begin ms, end ms) of the phases, recomputes and collectives."""
    out, begun = [], {}
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            lane = "phase" if e.get("cat") == "phase" else e.get("cat", "span")
            out.append((lane, e["name"], e["ts"] / 1000.0, (e["ts"] + e["dur"]) / 1000.0))
        elif ph == "b":
            begun[e["id"]] = e
        elif ph == "e" and e["id"] in begun:
            b = begun.pop(e["id"])
            out.append((b.get("cat", "async"), b["name"], b["ts"] / 1000.0, e["ts"] / 1000.0))
    return out


def main(argv):
    if len(argv) not in (2, 3) or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    source = argv[1]
    target = argv[2] if len(argv) == 3 else (source[:-5] if source.endswith(".json") else source) + ".png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_memory_trace.py: matplotlib is not installed (Debian/Ubuntu: apt-get install "
              "python3-matplotlib; elsewhere: pip install matplotlib)", file=sys.stderr)
        return 3
    with open(source) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    other = trace.get("otherData", {})
    devices = sorted({e["name"][: -len(COUNTER)] for e in events
                      if e.get("ph") == "C" and e["name"].endswith(COUNTER)})
    if not devices:
        print("plot_memory_trace.py: %s holds no memory counters" % source, file=sys.stderr)
        return 1
    # The model's device first (a GPU run also counts host memory).
    main_device = other.get("device", devices[0])
    devices.sort(key=lambda d: d != main_device)
    categories = other.get("categories") or list(COLOURS)
    lanes = ["phase", "recompute", "collective"]
    marks = spans(events)

    fig, axes = plt.subplots(len(devices) + 1, 1, figsize=(11, 3.6 * len(devices) + 1.6), sharex=True,
                             gridspec_kw={"height_ratios": [4] * len(devices) + [1]})
    for ax, device in zip(axes, devices):
        by_cat, tracked = counters(events, device)
        times = [t for t, _ in by_cat]
        peak_t, peak = max(tracked, key=lambda x: x[1]) if tracked else (0.0, 0)
        unit, size = unit_for(peak)
        shown = [c for c in categories if any(args.get(c, 0) for _, args in by_cat)]
        ax.stackplot(times, *[[args.get(c, 0) / size for _, args in by_cat] for c in shown],
                     labels=shown, colors=[COLOURS.get(c, None) for c in shown], step="post", linewidth=0)
        ax.plot([t for t, _ in tracked], [v / size for _, v in tracked], color="black", linewidth=0.6,
                drawstyle="steps-post", label="tracked (total)")
        ax.annotate("peak %.1f %s at %.1f ms" % (peak / size, unit, peak_t), xy=(peak_t, peak / size),
                    xytext=(0.02, 0.93), textcoords="axes fraction", va="top",
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})
        for lane, name, begin, end in marks:
            if lane == "phase":
                ax.axvline(begin, color="black", linewidth=0.4, linestyle=":")
        ax.set_ylabel("%s memory (%s)" % (device, unit))
        ax.set_ylim(0, peak / size * 1.15 if peak else 1)
        ax.legend(loc="upper right", fontsize=8, ncol=2)
        ax.grid(axis="y", linewidth=0.3)
    lane_ax = axes[-1]
    palette = {"phase": "#4c72b0", "recompute": "#c44e52", "collective": "#da8bc3"}
    extent = max([end for _, _, _, end in marks] + [1e-3])
    for lane, name, begin, end in marks:
        if lane not in lanes:
            lanes.append(lane)
        y = lanes.index(lane)
        lane_ax.broken_barh([(begin, max(end - begin, 1e-3))], (y - 0.4, 0.8),
                            facecolors=palette.get(lane, "#888888"), edgecolor="white", linewidth=0.3)
        if lane == "phase" and end - begin > 0.08 * extent:
            lane_ax.text((begin + end) / 2, y, name, ha="center", va="center", fontsize=7, color="white")
    lane_ax.set_yticks(range(len(lanes)))
    lane_ax.set_yticklabels(lanes, fontsize=8)
    lane_ax.set_ylim(len(lanes) - 0.5, -0.5)
    lane_ax.set_xlabel("time since the step began (ms)")
    title = "remat memory timeline"
    if "step" in other:
        title += ": step %s" % other["step"]
    if "rank" in other:
        title += ", rank %s" % other["rank"]
    details = [("ZeRO stage %s" % other["zero_stage"]) if "zero_stage" in other else None,
               ("checkpointing %s" % other["activation_checkpointing"]) if "activation_checkpointing" in other
               else None]
    details = [d for d in details if d]
    if details:
        title += " (" + ", ".join(details) + ")"
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
