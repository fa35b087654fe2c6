#!/usr/bin/env python3
"""Runs the table of bad (and good) inputs in cases.tsv against `ess`, as a new or a hostile
user would: each case's exit status, a word its message must contain, and the files that must
come out of it byte for byte unchanged. Any crash (a signal), hang (timeout) or internal error
fails its case whatever the table expects.

    run_cases.py --ess build/release/tools/ess/ess --cases tests/cli/cases.tsv --configs configs

cases.tsv: one case a line, tab-separated: expected exit status, a word of the message ("-" for
none), files that must be unchanged (comma-separated, "-" for none), the command after `ess`.
Lines starting with # are comments. Fixture files in the scratch folder the commands run in:
t.safetensors (a small synthetic trace of 4 layers), existing.safetensors (a copy of it), notes.txt, adir/
(a directory), model.json (the shipped model config), dup.json (it with a key given twice),
misses.json (t's miss profile: 4 layers), ops.csv (a valid op table row), ops_unknown.csv (an op that does
not exist), deploy_ep.json (EP 7 of 32 GPUs), deploy_adp.json (attention DP 8: not modelled).
"""
import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def digest(path):
    p = Path(path)
    if p.is_dir():
        return "dir:" + ",".join(sorted(os.listdir(p)))
    if not p.exists():
        return "missing"
    return hashlib.sha256(p.read_bytes()).hexdigest()


def fixtures(ess, configs, work):
    def run(*args):
        subprocess.run([ess, *args], cwd=work, check=True, capture_output=True, timeout=120)

    run("trace", "gen", "-o", "t.safetensors", "--context", "16384", "--requests", "1", "--steps", "4", "--layers", "4",
        "--seed", "3")
    shutil.copy(work / "t.safetensors", work / "existing.safetensors")
    run("trace", "analyze", "t.safetensors", "--no-recommend", "--miss-profile", "misses.json", "-o", "report.txt")
    (work / "notes.txt").write_text("notes that must survive\n")
    (work / "adir").mkdir()
    model = (Path(configs) / "models" / "deepseek-v3.2-exp.json").read_text()
    (work / "model.json").write_text(model)
    j = json.loads(model)
    text = json.dumps(j, indent=1)
    (work / "dup.json").write_text(text.replace('"num_hidden_layers"', '"num_hidden_layers": 3,\n "num_hidden_layers"', 1))
    (work / "ops.csv").write_text("op,context,tokens,time_us\nattn.sparse_mla,32768,128,100\n")
    (work / "header_only.csv").write_text("op,context,tokens,time_us\n")
    (work / "ops_huge.csv").write_text("op,context,tokens,time_us\nattn.sparse_mla,0,128,1e300\n")
    (work / "p.json").write_text("{}")
    (work / "ops_unknown.csv").write_text("op,context,tokens,time_us\nflux_capacitor,32768,128,100\n")
    profile = json.loads((work / "misses.json").read_text())
    profile["contexts"][0]["layers"][1]["layer"] = 99
    (work / "misses_layer_ids.json").write_text(json.dumps(profile))
    (work / "wl_tokens.json").write_text(json.dumps({"misses": {"reference_tokens": 2**32 + 2}}))
    (work / "wl_threshold.json").write_text(json.dumps({"layerwise_threshold": -5}))
    dep = json.loads((Path(configs) / "deployments" / "paper-table1.json").read_text())
    (work / "deploy_ep.json").write_text(json.dumps(dict(dep, expert_parallel=7)))
    (work / "deploy_adp.json").write_text(json.dumps(dict(dep, attention_data_parallel=8)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ess", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--timeout", type=float, default=60)
    a = ap.parse_args()
    ess = str(Path(a.ess).resolve())
    failures, count = [], 0
    with tempfile.TemporaryDirectory(prefix="ess-cli-") as tmp:
        base = Path(tmp) / "fixtures"
        base.mkdir()
        fixtures(ess, a.configs, base)
        # Without the CUDA target every bench command stops at "needs the CUDA target" first.
        has_cuda = "CUDA target: built" in subprocess.run([ess, "--version"], capture_output=True, text=True).stdout
        skipped = 0
        for line_no, line in enumerate(Path(a.cases).read_text().splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split("\t")
            if len(fields) != 4:
                failures.append(f"line {line_no}: {len(fields)} tab-separated fields, expected 4")
                continue
            expected, word, unchanged, command = fields
            if command.startswith("bench ") and not has_cuda:
                skipped += 1
                continue
            count += 1
            work = Path(tmp) / f"case{line_no}"
            shutil.copytree(base, work)
            files = [] if unchanged == "-" else unchanged.split(",")
            before = {f: digest(work / f) for f in files}
            try:
                r = subprocess.run([ess, *shlex.split(command)], cwd=work, capture_output=True, text=True,
                                   timeout=a.timeout)
                rc, err = r.returncode, (r.stderr + r.stdout)
            except subprocess.TimeoutExpired:
                failures.append(f"line {line_no}: ess {command}: still running after {a.timeout:.0f} s")
                continue
            what = f"line {line_no}: ess {command}"
            if rc < 0:
                failures.append(f"{what}: killed by signal {-rc}")
            elif rc == 4 or "internal error" in err:
                failures.append(f"{what}: internal error: {err.strip()[:300]}")
            elif str(rc) != expected:
                failures.append(f"{what}: exit {rc}, expected {expected}: {err.strip()[:300]}")
            elif word != "-" and word.lower() not in err.lower():
                failures.append(f"{what}: the message lacks '{word}': {err.strip()[:300]}")
            for f in files:
                if digest(work / f) != before[f]:
                    failures.append(f"{what}: {f} changed")
            leftovers = [p.name for p in work.iterdir() if ".tmp." in p.name]
            if leftovers:
                failures.append(f"{what}: temporary files left behind: {leftovers}")
            shutil.rmtree(work)
    for f in failures:
        print("FAIL", f)
    print(f"{count} cases, {len(failures)} failures" + (f", {skipped} bench cases skipped (no CUDA target)" if skipped else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
