# Fills docs/simulator.md.in with the outputs of `ess sim` / `ess plan` (and the sweep benchmark):
#   python3 docs/gen_simulator_md.py BUILD/tools/ess/ess docs/simulator.md.in [BUILD/bench/sim/sim_bench] > docs/simulator.md
#   python3 docs/gen_simulator_md.py BUILD/tools/ess/ess docs/simulator.md.in --check docs/simulator.md
import json, subprocess, sys
E = sys.argv[1]
def run(*args):
    return subprocess.run([E, *args], check=True, capture_output=True, text=True).stdout.rstrip()
d = json.loads(run("sim", "--format", "json"))
rows = ["| batch | ratio (paper) | ratio (predicted) | tok/s/node (paper) | tok/s/node (predicted) | error | OTPS (paper) | OTPS (predicted) | error | step ms (predicted) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
worst = 0
for r in d["rows"]:
    p = r["paper"]
    et = 100 * (r["throughput_tokens_per_s"] / p["throughput_tokens_per_s"] - 1)
    eo = 100 * (r["otps"] / p["otps"] - 1)
    worst = max(worst, abs(et), abs(eo))
    rows.append(f"| {r['batch']} | {p['ratio']:.2f} | {r['ratio']:.3f} | {p['throughput_tokens_per_s']:.2f} | {r['throughput_tokens_per_s']:.0f} | {et:+.1f} % | {p['otps']:.2f} | {r['otps']:.2f} | {eo:+.1f} % | {r['step_ms']:.2f} |")
table = "\n".join(rows)
out = open(sys.argv[2]).read()
out = out.replace("@PAPER_TABLE@", table).replace("@WORST@", f"{worst:.1f}")
for key, args in {
    "@OUT_DEFAULT@": ["sim"],
    "@OUT_NONE@": ["sim", "--overlap", "none", "--batch", "128,160"],
    "@OUT_DA@": ["sim", "--overlap", "da", "--batch", "128,160"],
    "@OUT_DBA@": ["sim", "--overlap", "dba", "--batch", "128,160"],
    "@OUT_MTP1@": ["sim", "--mtp", "1", "--batch", "52,64,96,128,160"],
    "@OUT_MTP3@": ["sim", "--mtp", "3", "--accept", "2.3", "--batch", "52,64,96,128,160"],
    "@OUT_MTP4@": ["sim", "--mtp", "4", "--accept", "2.8", "--batch", "52,64,96,128,160"],
    "@OUT_128K@": ["sim", "--context", "131072", "--batch", "13,16,24,32,48,64"],
    "@OUT_128K_NO_TBO@": ["sim", "--context", "131072", "--batch", "13,16,24,32,48,64", "--no-tbo"],
    "@OUT_PLAN@": ["plan", "--min-otps", "15", "--context", "32768,131072"],
    "@OUT_RESIDENCY@": ["sim", "--hardware", "h200", "--concurrency"],
}.items():
    out = out.replace(key, run(*args))
# The sparse MLA model per query token: one call over `rows` query tokens (MTP 1, whole cache,
# no TBO; a 4K context keeps top-k 2048 and lets every batch fit), read from the timeline.
import os, tempfile
mla = []
with tempfile.TemporaryDirectory() as tmp:
    for rows in (1, 13, 26, 52, 66, 104, 160, 320):
        tl = os.path.join(tmp, "tl.json")
        run("sim", "--mtp", "1", "--context", "4096", "--ratio", "1", "--no-tbo", "--batch", str(rows),
            "--timeline", tl, "--format", "csv")
        ev = json.load(open(tl))
        ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        us = next(e["dur"] for e in ev if e["name"].endswith(" attn.sparse_mla"))
        flops = 2 * rows * 128 * 2048 * (576 + 512)
        mla.append(f"  | {rows} | {us / rows:.2f} | {flops / us / 1e6:.0f} |")
out = out.replace("@MLA_TABLE@", "\n".join(mla))
# This model beside the previous one (docs/simulator_previous_model.csv) outside the five rows.
prev = {}
for line in open(os.path.join(os.path.dirname(sys.argv[2]), "simulator_previous_model.csv")):
    if line.startswith("#") or line.startswith("config,"):
        continue
    c, b, step, tput, otps = line.strip().split(",")
    prev[(c, int(b))] = (float(step), float(tput)) if step != "refused" else None
configs = [("mtp1", "MTP 1", ["--mtp", "1"], [52, 64, 96, 128, 160]),
           ("mtp3", "MTP 3", ["--mtp", "3", "--accept", "2.3"], [52, 64, 96, 128, 160]),
           ("mtp4", "MTP 4", ["--mtp", "4", "--accept", "2.8"], [52, 64, 96, 128, 160]),
           ("128k", "128K", ["--context", "131072"], [13, 16, 24, 32, 48, 64]),
           ("128k-no-tbo", "128K, TBO off", ["--context", "131072", "--no-tbo"], [13, 16, 24, 32, 48, 64])]
table = ["| configuration | batch | step ms (previous) | step ms (now) | tok/s/node (previous) | tok/s/node (now) | change |",
         "|---|---:|---:|---:|---:|---:|---:|"]
for key, label, args, batches in configs:
    now = {r["batch"]: r for r in json.loads(run("sim", *args, "--batch", ",".join(map(str, batches)), "--format", "json"))["rows"]}
    for b in batches:
        r = now[b]
        p = prev.get((key, b))
        missing = "refused" if (key, b) in prev else "—"
        old_step = f"{p[0]:.2f}" if p else missing
        old_tput = f"{p[1]:.0f}" if p else missing
        change = f"{100 * (r['throughput_tokens_per_s'] / p[1] - 1):+.1f} %" if p else ""
        table.append(f"| {label} | {b} | {old_step} | {r['step_ms']:.2f} | {old_tput} | {r['throughput_tokens_per_s']:.0f} | {change} |")
out = out.replace("@OLD_NEW_TABLE@", "\n".join(table))
if len(sys.argv) > 4 and sys.argv[3] == "--check":
    # Everything but the benchmark's figures (this machine's timings) is what the commands print now.
    import difflib
    page = open(sys.argv[4]).read()
    before, after = out.split("@BENCH@")
    bench_at = page.find("\n```\n", len(before) - 1)
    end = page.find("\n```", bench_at + 5) + 4 if page.startswith(before) and bench_at >= 0 else -1
    if end < 4 or not page[end:] == after:
        got = page if end < 4 else page[:len(before)] + "@BENCH@" + page[end:]
        diff = list(difflib.unified_diff(got.splitlines(), out.splitlines(), sys.argv[4], "the commands' output",
                                         lineterm="", n=1))
        sys.exit("\n".join(diff[:40]) + f"\n{sys.argv[4]} is not what the commands print (its prose belongs in "
                 f"{sys.argv[2]}): regenerate it with python3 docs/gen_simulator_md.py ESS {sys.argv[2]} SIM_BENCH > "
                 f"{sys.argv[4]}")
    sys.exit(0)
bench = "(not run)"
if len(sys.argv) > 3:
    b = subprocess.run([sys.argv[3], "--benchmark_min_time=0.5"], check=True, capture_output=True, text=True).stdout
    bench = "\n```\n" + "\n".join(l for l in b.splitlines() if l.startswith(("BM_", "Benchmark", "---"))) + "\n```"
out = out.replace("@BENCH@", bench)
sys.stdout.write(out)
