"""The MTP working set the built-in locality profile stores (configs/trace-profiles/default.json,
mtp_working_set.measured: the simulator's default pool floor) against a fresh measurement, as its `how`
says: `ess trace gen` with that profile's defaults, then `ess trace analyze --format json`'s
working_set.groups[0] p99 and max. Fails naming the stored and the measured values when the profile
(or the generator, or the analyzer) changed and the stored figures were not remeasured."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "..", "configs", "trace-profiles", "default.json")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ess", required=True)
    args = ap.parse_args()
    profile = json.load(open(PROFILE))
    stored = profile["mtp_working_set"]["measured"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in stored:
            if row["mtp"] != profile["mtp"]:   # the generator draws the profile's MTP
                failures.append(f"context {row['context']}: stored for MTP {row['mtp']}, the profile's is "
                                f"{profile['mtp']}")
                continue
            trace = os.path.join(tmp, f"ws-{row['context']}.safetensors")
            subprocess.run([args.ess, "trace", "gen", "-o", trace, "--context", str(row["context"]), "--requests", "4",
                            "--steps", "256"], check=True, stdout=subprocess.DEVNULL)
            out = subprocess.run([args.ess, "trace", "analyze", trace, "--policies", "lru", "--no-recommend",
                                  "--no-prefetch", "--no-similarity", "--format", "json"], check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            group = json.loads(out)["working_set"]["groups"][0]
            measured = {"p99": int(group["p99"]), "max": int(group["max"])}
            print(f"context {row['context']}, MTP {row['mtp']}: stored p99 {row['p99']} max {row['max']}, "
                  f"measured p99 {measured['p99']} max {measured['max']}")
            if (row["p99"], row["max"]) != (measured["p99"], measured["max"]):
                failures.append(f"context {row['context']}: stored p99 {row['p99']} / max {row['max']}, measured "
                                f"{measured['p99']} / {measured['max']}")
            os.remove(trace)
    if failures:
        print(f"{PROFILE}: mtp_working_set.measured is stale; remeasure it (its `how`):\n  " + "\n  ".join(failures),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
