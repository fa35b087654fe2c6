#!/usr/bin/env python3
"""scripts/check_layers.py can fail: on a copy of the tree it passes, and each include planted against the layering
(a lower layer including a higher one, a runtime part including a higher part, the runtime including the test
support outside its test side) makes it fail naming the file and the include."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_layers.py"
PLANTS = [
    ("src/runtime/cache/policy.cc", "analysis/sim/step_scheduler.h", "layer runtime"),
    ("src/runtime/cache/layer_cache.cc", "runtime/offload/offload_impl.h", "higher part offload"),
    ("src/runtime/backend/backend.cc", "ess/cache/sparse_pool.h", "higher part cache"),
    ("src/runtime/offload/offload.cc", "testing/backend.h", "layer runtime"),
    ("include/ess/runtime/offload.h", "ess/sim/deployment.h", "layer runtime"),
    ("src/analysis/sim/planner.cc", "harness/rig/config.h", "layer analysis"),
    ("src/testing/accuracy.cc", "ess/sim/report.h", "layer testing"),
    ("src/capi/plan.cc", "testing/testing.h", "layer capi"),
]


def run(root: Path):
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True)


def main() -> int:
    fails = 0
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "tree"
        for folder in ("include", "src", "tools", "tests", "bench"):
            shutil.copytree(ROOT / folder, copy / folder)
        clean = run(copy)
        if clean.returncode != 0:
            print(f"FAIL: the unchanged copy does not pass:\n{clean.stdout}{clean.stderr}")
            return 1
        for rel, include, says in PLANTS:
            path = copy / rel
            original = path.read_text()
            path.write_text(original + f'\n#include "{include}"\n')
            r = run(copy)
            path.write_text(original)
            if r.returncode != 1 or rel not in r.stdout or include not in r.stdout or says not in r.stdout:
                print(f"FAIL: {rel} including {include}: exit {r.returncode}, output:\n{r.stdout}{r.stderr}")
                fails += 1
    if not fails:
        print(f"check_layers: the clean copy passes and all {len(PLANTS)} planted includes fail it")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
