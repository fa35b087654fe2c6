#!/usr/bin/python3
"""Figures from `ess trace analyze --format json` (matplotlib, Debian's python3-matplotlib).

usage: scripts/plot_trace_analysis.py ANALYSIS.json -o OUTDIR [--context N] [--steps N]

Writes, as PNG:
  similarity_per_layer.png   intra-layer (vs previous step) and inter-layer (vs layer L-1) similarity
  misses_per_layer.png       steady-state misses per layer at every analyzed pool size (LRU + warm-up)
  warmup_first_steps.png     misses over the first decode steps, LRU with and without warm-up
  misses_vs_context.png      steady-state mean misses vs context length (LRU + warm-up, Belady)
  policies.png               every policy side by side with the Belady-optimal bound: overall, and each policy's
                             misses per layer as a multiple of Belady's (the gap to the bound)
  miss_ratio_curve.png       the sizing figure: steady-state misses against pool slots, per context, every policy
                             beside Belady, the target and the recommended pool marked (needs two or more pool
                             sizes: --ratio / --slots with several values)
  prefetch.png               inter-layer prefetch per layer: useful vs wasted entries, misses left
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
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
except ImportError:
    print("plot_trace_analysis: matplotlib is not installed (Debian: python3-matplotlib); no figures drawn")
    sys.exit(77)

COLORS = {"lru": "#d62728", "lru_warmup": "#1f77b4", "fifo": "#8c564b", "clock": "#9467bd", "lfu": "#e377c2",
          "s3fifo": "#2ca02c", "belady": "#000000"}


def title_suffix(a):
    s = f"{a['model']}, MTP {a['mtp']}, top-k {a['topk']}"
    if a.get("synthetic"):
        s += " — SYNTHETIC trace"
    return s


def pool_label(p):
    return f"ratio {p['ratio']:g}" if p.get("ratio") is not None else f"{p['slots']} slots"


def group_for(policy_entry, context):
    """The per-context stats of `context` when the trace has several contexts, else overall."""
    if context is not None:
        for g in policy_entry.get("per_context", []):
            if g["context"] == context:
                return g
    return policy_entry


def readable_log_y(ax):
    """A log y axis with ticks at 1, 2 and 5 of each decade, written as plain numbers: a range within one decade
    still gets several labelled ticks."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def slots_of(pool, context):
    """A sweep entry's slots per request-layer at `context` (ceil(ratio x context), as the analyzer sizes them)."""
    if pool.get("slots") is not None:
        return pool["slots"]
    return -(-int(round(pool["ratio"] * context * 1e6)) // 1000000)


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("analysis")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--context", type=int, default=None, help="context for the per-layer figures (default: smallest)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps shown in the warm-up figure")
    args = ap.parse_args()
    a = json.load(open(args.analysis))
    os.makedirs(args.out, exist_ok=True)
    layers = list(range(a["layers"]))
    contexts = a.get("contexts", [])
    ctx = args.context if args.context is not None else (contexts[0] if len(contexts) > 1 else None)
    ctx_note = f" at context {ctx}" if ctx else ""

    # 1. similarity per layer
    sim = a.get("similarity", {})
    if sim.get("intra"):
        fig, ax = plt.subplots(figsize=(9, 3.6))
        ax.plot(layers, sim["intra"], "o-", ms=3, label=f"intra-layer (vs previous step), mean {sim['intra_mean']:.3f}")
        inter = [float("nan") if x is None else x for x in sim["inter"]]
        ax.plot(layers, inter, "s-", ms=3, label=f"inter-layer (vs layer L-1), mean {sim['inter_mean']:.3f}")
        ax.set_xlabel("layer")
        ax.set_ylabel("overlap / |top-k set|")
        ax.set_ylim(0, 1.02)
        ax.set_title("Top-k similarity per layer\n" + title_suffix(a), fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        save(fig, args.out, "similarity_per_layer.png")

    # 2. misses per layer for several pool sizes
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for p in sorted(a["sweep"], key=lambda p: p["ratio"] if p.get("ratio") is not None else p["slots"]):
        pol = p["policies"].get("lru_warmup") or next(iter(p["policies"].values()))
        g = group_for(pol, ctx)
        ax.plot(layers, g["per_layer"], "o-", ms=3, label=f"{pool_label(p)}: mean {g['mean_misses']:.1f}")
    readable_log_y(ax)
    ax.set_xlabel("layer")
    ax.set_ylabel("misses per request-step (steady state)")
    ax.set_title("Misses per layer, LRU + warm-up" + ctx_note + "\n" + title_suffix(a), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save(fig, args.out, "misses_per_layer.png")

    # 3. first decode steps with and without warm-up
    pols = a["policies"]
    if "lru" in pols and "lru_warmup" in pols:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for name, label in (("lru", "LRU, cold start"), ("lru_warmup", "LRU + warm-up (last 32 prefill windows)")):
            g = group_for(pols[name], ctx)
            steps = g["per_step"][: args.steps]
            ax.plot(range(len(steps)), steps, "o-", ms=3, color=COLORS[name], label=label)
        readable_log_y(ax)
        ax.set_xlabel("decode step")
        ax.set_ylabel("misses per request-layer")
        ax.set_title(f"First decode steps ({pool_label(a['pool'])}{ctx_note})\n" + title_suffix(a), fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
        save(fig, args.out, "warmup_first_steps.png")

    # 4. mean misses vs context length
    if len(contexts) > 1:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name in ("lru_warmup", "belady"):
            if name not in pols:
                continue
            xs = [g["context"] for g in pols[name]["per_context"]]
            ys = [g["mean_misses"] for g in pols[name]["per_context"]]
            ax.plot(xs, ys, "o-", color=COLORS[name], label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context length")
        ax.set_ylabel("mean misses per request-layer-step")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Mean misses vs context at {pool_label(a['pool'])}\n" + title_suffix(a), fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, args.out, "misses_vs_context.png")

    # 5. policies side by side with the optimal bound
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    names = list(pols.keys())
    means = [group_for(pols[n], ctx)["mean_misses"] for n in names]
    ax1.bar(names, means, color=[COLORS.get(n, "gray") for n in names])
    if "belady" in pols:
        ax1.axhline(group_for(pols["belady"], ctx)["mean_misses"], color="black", ls="--", lw=1, label="Belady bound")
        ax1.legend(fontsize=8)
    ax1.set_ylabel("mean misses per request-layer-step")
    ax1.tick_params(axis="x", rotation=45)
    ax1.set_title(f"Policies at {pool_label(a['pool'])}{ctx_note}", fontsize=10)
    if "belady" in pols:
        bound = group_for(pols["belady"], ctx)["per_layer"]
        for n in names:
            if n == "belady":
                continue
            g = group_for(pols[n], ctx)
            gap = [m / b if b > 0 else float("nan") for m, b in zip(g["per_layer"], bound)]
            ax2.plot(layers, gap, "-", lw=1.2, color=COLORS.get(n, "gray"), label=n, zorder=3)
        ax2.axhline(1.0, color="black", lw=2.2, label="belady (the bound)", zorder=2)
        ax2.set_ylabel("misses / Belady's, per request-step")
        ax2.set_title("Per layer: each policy's gap to the bound\n" + title_suffix(a), fontsize=10)
    else:
        for n in names:
            g = group_for(pols[n], ctx)
            ax2.plot(layers, g["per_layer"], "-", lw=1, color=COLORS.get(n, "gray"), label=n)
        readable_log_y(ax2)
        ax2.set_ylabel("misses per request-step")
        ax2.set_title("Per layer\n" + title_suffix(a), fontsize=10)
    ax2.set_xlabel("layer")
    ax2.legend(fontsize=7, ncol=4)
    ax2.grid(alpha=0.3, which="both")
    save(fig, args.out, "policies.png")

    # 5b. the miss-ratio curve: misses against pool slots, the target and the recommendation marked
    sweep = a.get("sweep", [])
    if len(sweep) >= 2:
        curve_contexts = contexts if contexts else [None]
        fig, axes = plt.subplots(1, len(curve_contexts), figsize=(5.2 * len(curve_contexts) + 2.2, 3.9), squeeze=False)
        rec = a.get("recommended_pool") or {}
        target = rec.get("target_misses")
        recommended = {r["context"]: r for r in rec.get("per_context", [])}
        for ax, c in zip(axes[0], curve_contexts):
            context = c if c is not None else max(int(x) for x in a.get("contexts", [0]) or [0])
            for n in sweep[0]["policies"]:
                xs, ys = [], []
                for p in sweep:
                    if n not in p["policies"]:
                        continue
                    xs.append(slots_of(p, context) if context else pool_label(p))
                    ys.append(group_for(p["policies"][n], c)["mean_misses"])
                if context:  # the sweep in the order given: drawn by pool size
                    xs, ys = map(list, zip(*sorted(zip(xs, ys)))) if xs else (xs, ys)
                ax.plot(xs, ys, "o-", ms=3, lw=2.2 if n == "belady" else 1.2, color=COLORS.get(n, "gray"), label=n)
            if target is not None:
                ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
            r = recommended.get(c)
            if r is not None:
                ax.axvline(r["slots"], color=COLORS["lru_warmup"], ls=":", lw=1.5,
                           label=f"recommended pool ({rec.get('policy', 'lru_warmup')} at the target)")
                ax.annotate(f"{r['slots']:,} slots\n(ratio {r['ratio']:.3f})", xy=(r["slots"], 1.0),
                            xycoords=("data", "axes fraction"), xytext=(4, -4), textcoords="offset points",
                            ha="left", va="top", fontsize=7, color=COLORS["lru_warmup"])
            readable_log_y(ax)
            ax.set_xlabel("pool slots per request-layer" + (f" (context {context // 1024}K)" if context else ""))
            ax.set_ylabel("mean misses per request-layer-step")
            ax.set_title(f"Misses against pool size{f' at {context // 1024}K' if c is not None else ''}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(title_suffix(a), fontsize=10)
        save(fig, args.out, "miss_ratio_curve.png")
    else:
        print("miss_ratio_curve.png: one pool size analyzed; give --ratio (or --slots) two or more values")

    # 6. inter-layer prefetch
    pf = a.get("prefetch")
    if pf:
        pl = pf["per_layer"]
        fig, ax = plt.subplots(figsize=(9, 3.6))
        xs = layers[1:]
        ax.bar(xs, pl["useful"][1:], color="#2ca02c", label=f"useful (mean {pf['mean_useful']:.1f})")
        ax.bar(xs, pl["wasted"][1:], bottom=pl["useful"][1:], color="#d62728",
               label=f"wasted (mean {pf['mean_wasted']:.1f}, max {pf['max_wasted']:.0f})")
        ax.plot(xs, pl["misses_left"][1:], "k.-", ms=3, label=f"misses left (mean {pf['mean_misses_left']:.1f})")
        ax.set_xlabel("layer")
        ax.set_ylabel("entries per request-step")
        ax.set_title(f"Inter-layer prefetch of layer L-1's top-k ({pool_label(a['pool'])})\n" + title_suffix(a),
                     fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, args.out, "prefetch.png")


if __name__ == "__main__":
    main()
