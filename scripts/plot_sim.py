#!/usr/bin/python3
"""The throughput and OTPS figure of `ess sim --format json` (matplotlib, Debian's python3-matplotlib).

usage: scripts/plot_sim.py SIM.json -o OUTDIR

Writes load.png: per batch, throughput per node (left) and tokens/s per request (right) of ESS and of the
all-on-GPU step at the same batch (where it fits), the all-on-GPU memory wall, where offload starts to pay
(`offload_pays_from_batch`) and, with `--residency adaptive`, how many requests are whole. Made for
`ess sim --concurrency` (one engine's pool from one request past the memory wall); any `ess sim` JSON works.
Exit status 77 when matplotlib is not installed (ctest treats it as skipped).
"""
import argparse
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("plot_sim: matplotlib is not installed (Debian: python3-matplotlib); no figure drawn")
    sys.exit(77)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    with open(a.json) as f:
        s = json.load(f)
    rows = [r for r in s["rows"] if "refused" not in r]
    if not rows:
        sys.exit("plot_sim: no row of the simulation runs")
    batch = [r["batch"] for r in rows]
    base = [(r["batch"], r["all_on_gpu_at_batch"]) for r in rows if r.get("all_on_gpu_at_batch")]
    wall = s["baseline"]["batch"] if s.get("baseline") else None
    pays = s.get("offload_pays_from_batch")
    adaptive = s.get("residency") == "adaptive"

    # Batches closer than 15 % to the last one kept (the wall and the batch after it) share its tick and label.
    ticks = []
    for b in batch:
        if not ticks or b > 1.15 * ticks[-1]:
            ticks.append(b)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in ((axes[0], "throughput_tokens_per_s", "output tokens/s per node"),
                           (axes[1], "otps", "output tokens/s per request (OTPS)")):
        ax.plot(batch, [r[key] for r in rows], "o-", color="#1f77b4",
                label="ESS" + (" (adaptive residency)" if adaptive else ""))
        if base:
            ax.plot([b for b, _ in base], [x[key] for _, x in base], "s--", color="#7f7f7f",
                    label="all-on-GPU, same batch")
        if wall:
            ax.axvline(wall, color="#d62728", lw=1, ls=":")
            ax.annotate(f"memory wall\nbatch {wall}", (wall, 0.97), xycoords=("data", "axes fraction"),
                        ha="right", va="top", fontsize=8, color="#d62728")
        if pays:
            ax.axvline(pays, color="#2ca02c", lw=1, ls=":")
            ax.annotate(f"offload pays\nfrom batch {pays}", (pays, 0.75), xycoords=("data", "axes fraction"),
                        ha="left", va="top", fontsize=8, color="#2ca02c")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(b) for b in ticks], rotation=45, fontsize=8)
        ax.set_xlabel("requests per GPU (batch)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
    if adaptive:
        for r in rows:
            if r["batch"] not in ticks:
                continue
            axes[0].annotate(f"{r['whole_requests']}", (r["batch"], r["throughput_tokens_per_s"]),
                             textcoords="offset points", xytext=(6, -10), ha="left", fontsize=7, color="#1f77b4")
        axes[0].text(0.01, 0.99, "numbers: whole requests", transform=axes[0].transAxes, va="top",
                     fontsize=8, color="#1f77b4")
    axes[0].legend(loc="lower right", fontsize=8)
    dep = s["deployment"]
    fig.suptitle(f"ess sim: {s['model']} on {s['gpu'] or s['hardware']}, {dep['nodes']} x {dep['gpus_per_node']} GPUs, "
                 f"context {s['context']}, MTP {dep['mtp_tokens']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "load.png")
    fig.savefig(path, dpi=110)
    print(path)


if __name__ == "__main__":
    main()
