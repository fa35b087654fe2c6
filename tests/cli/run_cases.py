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
not exist), deploy_ep.json (EP 7 of 32 GPUs), deploy_adp.json (attention DP 8: not modelled),
escapes.safetensors (a trace whose ess.synthetic holds terminal escapes).
Nothing a case prints may hold a control character (but newline and tab) or a byte that is not UTF-8.

With --flags flags.tsv it also runs every option of every subcommand against the values that are
not meaningful for it (flags.tsv says how), and holds `ess --list-options` to that table.
"""
import argparse
import hashlib
import json
import os
import shlex
import shutil
import struct
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
    # A trace whose ess.synthetic holds terminal escapes (clear screen, bell, the C1 CSI): refused,
    # the value printed escaped.
    md = {"ess.format": "ess-topk-trace", "ess.version": "1", "ess.requests": "1", "ess.layers": "1", "ess.mtp": "1",
          "ess.topk": "2", "ess.synthetic": "\x1b[2J\x07\x9b"}
    head = json.dumps({"__metadata__": md,
                       "requests.0.topk": {"dtype": "I32", "shape": [1, 1, 1, 2], "data_offsets": [0, 8]},
                       "requests.0.lengths": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}).encode()
    data = struct.pack("<2iq", 0, 1, 4)
    (work / "escapes.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    dep = json.loads((Path(configs) / "deployments" / "paper-table1.json").read_text())
    (work / "deploy_ep.json").write_text(json.dumps(dict(dep, expert_parallel=7)))
    (work / "deploy_adp.json").write_text(json.dumps(dict(dep, attention_data_parallel=8)))


# ---- flags.tsv: every option of every subcommand, by value class ------------------------------

CLASSES = ["zero", "negative", "empty", "nan", "inf", "huge", "overflow", "word"]
# The classes each value type must have a cell for (FLAG: an option without a value).
REQUIRED = {"INT": CLASSES, "UINT": CLASSES, "FLOAT": CLASSES, "TEXT": ["empty"], "FLAG": ["word"]}


def probe(cls, typ):
    if cls == "huge":
        return "1e300" if typ == "FLOAT" else "9223372036854775807"
    if cls == "overflow":
        return "1e999" if typ == "FLOAT" else "99999999999999999999"
    return {"zero": "0", "negative": "-1", "empty": "", "nan": "nan", "inf": "inf", "word": "abc"}[cls]


def read_flags(path):
    """The table: '@base PATH<TAB>COMMAND' lines and rows PATH<TAB>FLAG<TAB>cell x 8[<TAB>EXTRA ARGS]."""
    bases, rows, errors = {}, {}, []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split("\t")
        if f[0] == "@base":
            bases[f[1]] = f[2]
            continue
        if len(f) not in (10, 11):
            errors.append(f"flags.tsv line {line_no}: {len(f)} tab-separated fields, expected 10 or 11")
            continue
        if (f[0], f[1]) in rows:
            errors.append(f"flags.tsv line {line_no}: {f[0]} {f[1]} has a row already")
        rows[(f[0], f[1])] = (line_no, dict(zip(CLASSES, f[2:10])), f[10] if len(f) == 11 else "")
    return bases, rows, errors


def without(words, flag):
    """`words` less `flag` and its value (the probe gives its own)."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w == flag:
            skip = True
        elif not w.startswith(flag + "="):
            out.append(w)
    return out


def run_flags(ess, table, base, tmp, has_cuda, timeout, record):
    listed = subprocess.run([ess, "--list-options"], capture_output=True, text=True, check=True).stdout
    options = [tuple(line.split("\t")) for line in listed.splitlines() if line]
    bases, rows, failures = read_flags(table)
    count = skipped = 0
    known = {(p, f) for p, f, _ in options}
    for key in rows:
        if key not in known:
            failures.append(f"flags.tsv line {rows[key][0]}: ess {key[0]} has no option {key[1]}")
    for path, flag, typ in options:
        if (path, flag) not in rows and not record:
            failures.append(f"ess {path} {flag} ({typ}) has no row in flags.tsv: add its bad-value cases")
            continue
        line_no, cells, extra = rows.get((path, flag), (0, {c: "?" if c in REQUIRED.get(typ, []) else "-" for c in CLASSES}, ""))
        for cls in REQUIRED.get(typ, []):
            if cells[cls] == "-":
                failures.append(f"flags.tsv line {line_no}: ess {path} {flag} ({typ}) needs a '{cls}' cell")
        if path.startswith("bench ") and not has_cuda:
            skipped += 1
            continue
        if path not in bases:
            failures.append(f"flags.tsv: no @base line for 'ess {path}'")
            continue
        observed = []
        for cls in CLASSES:
            want = cells[cls]
            # A bench run with a meaningful value needs a device and minutes: only refusals are tried.
            if want == "-" or (path.startswith("bench ") and want == "0" and not record):
                observed.append("-")
                continue
            count += 1
            work = Path(tmp) / "flag"
            shutil.copytree(base, work)
            value = probe(cls, typ)
            words = without(shlex.split(bases[path]), flag) + shlex.split(extra)
            args = words + ([f"{flag}={value}"] if typ == "FLAG" else [flag, value])
            what = f"flags.tsv line {line_no}: ess {shlex.join(args)} ({cls})"
            try:
                r = subprocess.run([ess, *args], cwd=work, capture_output=True, text=True, timeout=timeout)
                rc, err = r.returncode, r.stderr + r.stdout
            except subprocess.TimeoutExpired:
                failures.append(f"{what}: still running after {timeout:.0f} s")
                observed.append("T")
                shutil.rmtree(work)
                continue
            shutil.rmtree(work)
            observed.append(str(rc))
            if record:
                continue
            expected, _, word = want.partition(":")
            word = word or flag
            exit_problem = exit_failure(what, rc, expected, err)
            if exit_problem:
                failures.append(exit_problem)
            elif rc == 2 and word.lower() not in err.lower():
                failures.append(f"{what}: the message does not name {word}: {err.strip()[:300]}")
        if record:
            print("\t".join([path, flag, *observed]) + (f"\t{extra}" if extra else ""))
    return count, skipped, failures


def exit_failure(what, rc, expected, err):
    """What is wrong with how a run ended (killed, an internal error, another exit status than `expected`), or
    None when it ended as expected."""
    if rc < 0:
        return f"{what}: killed by signal {-rc}"
    if rc == 4 or "internal error" in err:
        return f"{what}: internal error: {err.strip()[:300]}"
    if str(rc) != expected:
        return f"{what}: exit {rc}, expected {expected}: {err.strip()[:300]}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ess", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--flags", help="flags.tsv: every option's bad values, held to `ess --list-options`")
    ap.add_argument("--record", action="store_true", help="print the flag outcomes observed (to write flags.tsv)")
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
        if a.flags:
            n, s, f = run_flags(ess, a.flags, base, tmp, has_cuda, a.timeout, a.record)
            print(f"flags.tsv: {n} values tried, {len(f)} failures" + (f", {s} bench options not run (no CUDA target)" if s else ""))
            failures += f
            if a.record:
                return 0
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
                                   errors="surrogateescape", timeout=a.timeout)
                rc, err = r.returncode, (r.stderr + r.stdout)
            except subprocess.TimeoutExpired:
                failures.append(f"line {line_no}: ess {command}: still running after {a.timeout:.0f} s")
                continue
            what = f"line {line_no}: ess {command}"
            exit_problem = exit_failure(what, rc, expected, err)
            if exit_problem:
                failures.append(exit_problem)
            elif word != "-" and word.lower() not in err.lower():
                failures.append(f"{what}: the message lacks '{word}': {err.strip()[:300]}")
            elif any((ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) < 0xa0 or 0xdc80 <= ord(c) <= 0xdcff for c in err):
                failures.append(f"{what}: control characters or bytes that are not UTF-8 printed raw: {ascii(err)[:300]}")
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
