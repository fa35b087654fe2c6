"""The running and the arithmetic of scripts/bench_compare.sh (which builds both sides first).

  bench_compare.py check-list --list FILE [--dir BUILD --benches A,B]
      parses the gate list; with --dir, checks that BUILD's programs have every name it lists.
  bench_compare.py run --list FILE --runs N --benches A,B --json OUT
                   --base-ref R --base-id ID --base-dir BUILD --head-ref R --head-id ID --head-dir BUILD
                   [--filter REGEX] [--min-time S] [--no-gate]
      runs every selected benchmark once per side per round (BASE, then HEAD), prints the
      comparison, writes OUT, exits 1 when a listed benchmark is below the list's threshold.

Standard library only: it runs under any Python 3.9+.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


class InputError(Exception):
    pass


def parse_list(path: Path) -> tuple[float, list[str]]:
    """The gate list: one `threshold R` line (0 < R <= 10) and exact benchmark names."""
    threshold = None
    names: list[str] = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        if line.startswith("threshold"):
            parts = line.split()
            if len(parts) != 2:
                raise InputError(f"{where}: expected 'threshold R', got '{line}'")
            if threshold is not None:
                raise InputError(f"{where}: a second threshold line ('{line}'); the list has one")
            try:
                threshold = float(parts[1])
            except ValueError:
                raise InputError(f"{where}: threshold '{parts[1]}' is not a number") from None
            if not 0 < threshold <= 10:
                raise InputError(f"{where}: threshold {threshold} outside (0, 10]")
            continue
        if any(c.isspace() for c in line):
            raise InputError(f"{where}: '{line}' is not one benchmark name (names have no spaces)")
        if line in names:
            raise InputError(f"{where}: '{line}' is listed twice")
        names.append(line)
    if threshold is None:
        raise InputError(f"{path}: no 'threshold R' line")
    if not names:
        raise InputError(f"{path}: names no benchmark")
    return threshold, names


def exact(name: str) -> str:
    """A Google Benchmark filter matching `name` only."""
    return "^" + re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", name) + "$"


def find_program(build: Path, name: str) -> Path | None:
    for p in sorted((build / "bench").rglob(name)):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def list_tests(program: Path, regex: str | None) -> list[str]:
    cmd = [str(program), "--benchmark_list_tests=true"]
    if regex:
        cmd.append(f"--benchmark_filter={regex}")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def catalogue(build: Path, benches: list[str], regex: str | None) -> dict[str, Path]:
    """Benchmark name -> the program that has it, over the programs `build` has."""
    found: dict[str, Path] = {}
    for b in benches:
        prog = find_program(build, b)
        if prog is None:
            continue
        for name in list_tests(prog, regex):
            found.setdefault(name, prog)
    return found


def run_once(program: Path, name: str, min_time: str | None) -> dict:
    cmd = [str(program), f"--benchmark_filter={exact(name)}", "--benchmark_format=json"]
    if min_time:
        cmd.append(f"--benchmark_min_time={min_time}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{program} {name}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    runs = [b for b in json.loads(proc.stdout)["benchmarks"] if b.get("run_type", "iteration") == "iteration"]
    if len(runs) != 1 or runs[0]["name"] != name:
        raise RuntimeError(f"{program}: filter {exact(name)} ran {[b['name'] for b in runs]}, expected [{name}]")
    b = runs[0]
    field = "real_time" if name.endswith("/real_time") else "cpu_time"
    return {
        "time_ns": b[field] * UNIT_NS[b.get("time_unit", "ns")],
        "items_per_second": b.get("items_per_second"),
        "iterations": b["iterations"],
    }


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def fmt_time(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.4g} {unit}"
    return f"{ns:.4g} ns"


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def check_list(args) -> int:
    threshold, names = parse_list(Path(args.list))
    if args.dir:
        have = catalogue(Path(args.dir), args.benches.split(","), None)
        missing = [n for n in names if n not in have]
        if missing:
            raise InputError(f"{args.list}: {len(missing)} listed benchmark(s) that {args.dir}'s programs "
                             f"({args.benches}) do not have: {', '.join(missing)}")
        print(f"{args.list}: threshold {threshold}, {len(names)} benchmarks, all in {args.dir}")
    return 0


def run(args) -> int:
    threshold, gated = parse_list(Path(args.list))
    benches = args.benches.split(",")
    base_dir, head_dir = Path(args.base_dir), Path(args.head_dir)
    regex = args.filter if args.filter else "^(" + "|".join(exact(n)[1:-1] for n in gated) + ")$"
    head = catalogue(head_dir, benches, regex)
    base = catalogue(base_dir, benches, regex)
    if not args.filter:
        missing = [n for n in gated if n not in head]
        if missing:
            raise InputError(f"{args.list} names benchmark(s) HEAD ({args.head_ref}) does not have in "
                             f"{args.benches}: {', '.join(missing)}")
    if not head:
        raise InputError(f"no benchmark of {args.benches} in HEAD ({args.head_ref}) matches '{regex}'")
    names = sorted(head)
    both = [n for n in names if n in base]
    only_head = [n for n in names if n not in base]

    load_before = loadavg()
    print(f"bench_compare: BASE {args.base_ref} ({args.base_id[:12]}) vs HEAD {args.head_ref} ({args.head_id[:12]}): "
          f"{len(both)} benchmarks x {args.runs} interleaved rounds (BASE, HEAD); load average {load_before}",
          flush=True)
    samples: dict[str, dict[str, list[dict]]] = {n: {"base": [], "head": []} for n in both}
    for r in range(args.runs):
        for n in both:
            samples[n]["base"].append(run_once(base[n], n, args.min_time))
            samples[n]["head"].append(run_once(head[n], n, args.min_time))
        print(f"  round {r + 1}/{args.runs} done", file=sys.stderr, flush=True)
    load_after = loadavg()

    results = []
    failed = []
    for n in both:
        bt = [s["time_ns"] for s in samples[n]["base"]]
        ht = [s["time_ns"] for s in samples[n]["head"]]
        ratios = [b / h for b, h in zip(bt, ht)]  # > 1: HEAD faster
        q1, q3 = quartiles(ratios)
        med = statistics.median(ratios)
        entry = {
            "name": n,
            "program": head[n].name,
            "time_field": "real_time" if n.endswith("/real_time") else "cpu_time",
            "base_ns": bt,
            "head_ns": ht,
            "base_median_ns": statistics.median(bt),
            "head_median_ns": statistics.median(ht),
            "base_items_per_second": [s["items_per_second"] for s in samples[n]["base"]],
            "head_items_per_second": [s["items_per_second"] for s in samples[n]["head"]],
            "ratios": ratios,
            "ratio_median": med,
            "ratio_of_medians": statistics.median(bt) / statistics.median(ht),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_q1": q1,
            "ratio_q3": q3,
            "gated": n in gated,
        }
        if n in gated:
            entry["threshold"] = threshold
            entry["pass"] = med >= threshold
            if not entry["pass"]:
                failed.append(n)
        results.append(entry)

    width = max(len("benchmark"), *(len(e["name"]) for e in results)) if results else 9
    print()
    print(f"{'benchmark':<{width}}  {'BASE median':>12}  {'HEAD median':>12}  {'HEAD speed':>10}  "
          f"{'min - max':>13}  {'q1 - q3':>13}  gate")
    for e in results:
        gate = ""
        if e["gated"]:
            gate = ("ok" if e["pass"] else "SLOWER") + f" (>= {threshold:g})"
        print(f"{e['name']:<{width}}  {fmt_time(e['base_median_ns']):>12}  {fmt_time(e['head_median_ns']):>12}  "
              f"{e['ratio_median']:>9.3f}x  {e['ratio_min']:>5.3f} - {e['ratio_max']:<5.3f}  "
              f"{e['ratio_q1']:>5.3f} - {e['ratio_q3']:<5.3f}  {gate}")
    for n in only_head:
        print(f"{n:<{width}}  {'(none)':>12}  {'-':>12}  no baseline: BASE's programs lack it")
    print(f"\nHEAD speed = BASE time / HEAD time, median over {args.runs} rounds (> 1: HEAD faster); "
          f"min - max and q1 - q3 of the per-round ratios. Load average before {load_before}, after {load_after}.")

    report = {
        "base": {"ref": args.base_ref, "commit": args.base_id, "build": str(base_dir)},
        "head": {"ref": args.head_ref, "commit": args.head_id, "build": str(head_dir)},
        "runs": args.runs,
        "order": "interleaved per benchmark: BASE then HEAD, every round",
        "filter": regex,
        "min_time": args.min_time,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after},
        "gate": {"list": args.list, "threshold": threshold, "enabled": not args.no_gate, "failed": failed},
        "benchmarks": results,
        "no_baseline": only_head,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"JSON: {out}")
    if failed:
        verdict = "FAILED" if not args.no_gate else "(not gated: --no-gate)"
        print(f"gate {verdict}: {len(failed)} listed benchmark(s) below {threshold:g}x of BASE: {', '.join(failed)}")
        return 0 if args.no_gate else 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check-list")
    c.add_argument("--list", required=True)
    c.add_argument("--dir")
    c.add_argument("--benches", default="swap_engine_bench,offload_step_bench,prefix_admission_bench,trace_replay_bench")
    r = sub.add_parser("run")
    for a in ("list", "benches", "json", "base-ref", "base-id", "base-dir", "head-ref", "head-id", "head-dir"):
        r.add_argument(f"--{a}", required=True)
    r.add_argument("--runs", type=int, required=True)
    r.add_argument("--filter")
    r.add_argument("--min-time")
    r.add_argument("--no-gate", action="store_true")
    args = p.parse_args()
    try:
        return check_list(args) if args.cmd == "check-list" else run(args)
    except InputError as e:
        print(f"bench_compare: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        print(f"bench_compare: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
