#!/usr/bin/env python3
"""`ess trace analyze` over a trace that another process truncates while the analysis runs: the
run ends with exit status 3 and a message naming the file (never SIGBUS), and writes nothing.

    shrinking_trace.py --ess build/cpu/tools/ess/ess
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ess", required=True)
    a = ap.parse_args()
    ess = str(Path(a.ess).resolve())
    with tempfile.TemporaryDirectory(prefix="ess-shrink-") as tmp:
        work = Path(tmp)
        steps = 48
        for attempt in range(4):
            trace = work / "t.safetensors"
            subprocess.run([ess, "trace", "gen", "-o", str(trace), "-c", "16384", "-b", "2", "-s", str(steps), "-l", "8",
                            "--seed", "7"], check=True, capture_output=True, timeout=300)
            out = work / "report.txt"
            p = subprocess.Popen([ess, "trace", "analyze", str(trace), "--ratio", "0.2", "0.3", "0.5", "-j", "1",
                                  "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)
            if p.poll() is not None:  # done before the file could shrink: a longer run
                p.communicate()
                steps *= 4
                continue
            os.truncate(trace, 4096)
            _, err = p.communicate(timeout=600)
            rc = p.returncode
            if rc < 0:
                print(f"FAIL: ess trace analyze was killed by signal {-rc} when its trace shrank")
                return 1
            if rc != 3 or str(trace) not in err or "shrank" not in err:
                print(f"FAIL: exit {rc}, expected 3 and a message naming {trace}: {err.strip()[:400]}")
                return 1
            if out.exists() or [q.name for q in work.iterdir() if ".tmp." in q.name]:
                print("FAIL: a report or a temporary was written")
                return 1
            print(f"ok: exit 3: {err.strip()}")
            return 0
    print("FAIL: every analysis finished before its trace could be truncated")
    return 1


if __name__ == "__main__":
    sys.exit(main())
