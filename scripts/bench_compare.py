"""The running and the arithmetic of scripts/bench_compare.sh (which builds both sides first).

  bench_compare.py check-list --list FILE [--dir BUILD --benches A,B]
      parses the gate list; with --dir, checks that BUILD's programs have every name it lists.
  bench_compare.py run --list FILE --runs N --benches A,B --json OUT
                   --base-ref R --base-id ID --base-dir BUILD --base-src SRC
                   --head-ref R --head-id ID --head-dir BUILD --head-src SRC
                   [--filter REGEX] [--min-time S] [--no-gate]
      runs every selected benchmark once per side per round (BASE, then HEAD), prints the
      comparison, writes OUT, exits 1 when a listed benchmark is below the list's threshold.

The programs are Google Benchmark's, and `python_overhead`: bench/python_overhead.py of the side's
source on the side's libess.so, whose timings are named python_overhead/<timing> (wrapper_batch0:
the package's whole per-layer call). The gate is the median of the per-round ratios (the rounds
interleave BASE and HEAD, so a load that drifts hits both); Google Benchmark's own comparison
(compare.py's gbench.report, Debian's libbenchmark-tools) adds its time change and its Mann-Whitney
U test over the rounds.
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
PYTHON_PROGRAM = "python_overhead"
# Google Benchmark's comparison tooling (compare.py's package), where Debian's libbenchmark-tools puts it.
GBENCH_DIRS = ("/usr/share/benchmark",)


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


def gbench_report():
    """gbench.report of Google Benchmark's tools, or None where they are not installed."""
    for d in GBENCH_DIRS:
        if (Path(d) / "gbench" / "report.py").is_file() and d not in sys.path:
            sys.path.append(d)
    try:
        from gbench import report
        return report
    except ImportError:
        return None


class PythonProgram:
    """bench/python_overhead.py of one side (its source, its build's libess.so): one run per round gives every
    timing, python_overhead/<key>."""

    def __init__(self, src: Path, build: Path):
        self.script = src / "bench" / "python_overhead.py"
        self.library = build / "src" / "capi" / "libess.so"
        self.name = PYTHON_PROGRAM
        self._last: tuple[int, dict] | None = None

    def exists(self) -> bool:
        return self.script.is_file() and self.library.exists()

    def names(self) -> list[str]:
        return [f"{PYTHON_PROGRAM}/{k}" for k in ("ctypes_batch0", "wrapper_batch0", "ctypes_step", "wrapper_step")]

    def run(self, name: str, round_: int) -> dict:
        if self._last is None or self._last[0] != round_:
            env = dict(os.environ, ESS_LIBRARY=str(self.library))
            proc = subprocess.run([sys.executable if sys.executable else "python3", str(self.script), "--format", "json",
                                   "--repeats", "3"], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"{self.script}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
            self._last = (round_, json.loads(proc.stdout))
        key = name.split("/", 1)[1]
        if key not in self._last[1]:
            raise RuntimeError(f"{self.script} reports no {key}")
        return {"time_ns": self._last[1][key]["median_us"] * 1e3, "items_per_second": None, "iterations": None}


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


def catalogue(build: Path, benches: list[str], regex: str | None, src: Path | None = None) -> dict:
    """Benchmark name -> the program that has it, over the programs `build` has (and python_overhead, over
    `src`'s script and `build`'s libess)."""
    found: dict = {}
    for b in benches:
        if b == PYTHON_PROGRAM:
            py = PythonProgram(src or Path("."), build)
            if py.exists():
                for name in py.names():
                    if regex is None or re.search(regex, name):
                        found.setdefault(name, py)
            continue
        prog = find_program(build, b)
        if prog is None:
            continue
        for name in list_tests(prog, regex):
            found.setdefault(name, prog)
    return found


def run_once(program, name: str, min_time: str | None, round_: int = 0) -> dict:
    if isinstance(program, PythonProgram):
        return program.run(name, round_)
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
        have = catalogue(Path(args.dir), args.benches.split(","), None, Path(args.src) if args.src else None)
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
    head = catalogue(head_dir, benches, regex, Path(args.head_src))
    base = catalogue(base_dir, benches, regex, Path(args.base_src))
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
            samples[n]["base"].append(run_once(base[n], n, args.min_time, r))
            samples[n]["head"].append(run_once(head[n], n, args.min_time, r))
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

    # Google Benchmark's own comparison of the same rounds (each round one repetition): its time change and
    # U test, beside the gate's per-round ratio.
    gb = gbench_report()
    if gb is not None and results:
        def as_json(side):
            return {"benchmarks": [{"name": e["name"], "run_type": "iteration", "repetitions": args.runs,
                                    "repetition_index": i, "threads": 1, "iterations": 1, "time_unit": "ns",
                                    "real_time": t, "cpu_time": t}
                                   for e in results for i, t in enumerate(e[f"{side}_ns"])]}
        for d in gb.get_difference_report(as_json("base"), as_json("head"), utest=True):
            e = next((x for x in results if x["name"] == d["name"]), None)
            if e is None:
                continue
            u = d.get("utest") or {}
            e["gbench"] = {"time_change": statistics.median(m["time"] for m in d["measurements"]),
                           "utest_p": u.get("time_pvalue"), "utest_optimal_repetitions": u.get("have_optimal_repetitions")}
    width = max(len("benchmark"), *(len(e["name"]) for e in results)) if results else 9
    print()
    print(f"{'benchmark':<{width}}  {'BASE median':>12}  {'HEAD median':>12}  {'HEAD speed':>10}  "
          f"{'min - max':>13}  {'U test p':>8}  gate")
    for e in results:
        gate = ""
        if e["gated"]:
            gate = ("ok" if e["pass"] else "SLOWER") + f" (>= {threshold:g})"
        p = (e.get("gbench") or {}).get("utest_p")
        print(f"{e['name']:<{width}}  {fmt_time(e['base_median_ns']):>12}  {fmt_time(e['head_median_ns']):>12}  "
              f"{e['ratio_median']:>9.3f}x  {e['ratio_min']:>5.3f} - {e['ratio_max']:<5.3f}  "
              f"{(f'{p:.3f}' if p is not None else '-'):>8}  {gate}")
    for n in only_head:
        print(f"{n:<{width}}  {'(none)':>12}  {'-':>12}  no baseline: BASE's programs lack it")
    print(f"\nHEAD speed = BASE time / HEAD time, median over {args.runs} rounds (> 1: HEAD faster); min - max of "
          f"the per-round ratios; U test p: Google Benchmark's compare.py U test of the two sides' rounds "
          + ("(low: a real difference)" if gb is not None else "(not run: Google Benchmark's tools are not installed)")
          + f". Load average before {load_before}, after {load_after}.")

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
    c.add_argument("--src")
    c.add_argument("--benches", default="swap_engine_bench,offload_step_bench,prefix_admission_bench,trace_replay_bench,"
                                        "python_overhead")
    r = sub.add_parser("run")
    for a in ("list", "benches", "json", "base-ref", "base-id", "base-dir", "base-src", "head-ref", "head-id", "head-dir",
              "head-src"):
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
