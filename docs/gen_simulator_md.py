# Fills docs/simulator.md.in with the outputs of `ess sim` / `ess plan` (and the sweep benchmark):
#   python3 docs/gen_simulator_md.py BUILD/tools/ess/ess docs/simulator.md.in [BUILD/bench/sim/sim_bench] > docs/simulator.md
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
    "@OUT_128K@": ["sim", "--context", "131072", "--batch", "13,16,24,32,48,64"],
    "@OUT_128K_NO_TBO@": ["sim", "--context", "131072", "--batch", "13,16,24,32,48,64", "--no-tbo"],
    "@OUT_PLAN@": ["plan", "--min-otps", "15", "--context", "32768,131072"],
}.items():
    out = out.replace(key, run(*args))
bench = "(not run)"
if len(sys.argv) > 3:
    b = subprocess.run([sys.argv[3], "--benchmark_min_time=0.5"], check=True, capture_output=True, text=True).stdout
    bench = "\n```\n" + "\n".join(l for l in b.splitlines() if l.startswith(("BM_", "Benchmark", "---"))) + "\n```"
out = out.replace("@BENCH@", bench)
sys.stdout.write(out)
