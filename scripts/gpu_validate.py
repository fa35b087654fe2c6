#!/usr/bin/env python3
"""GPU validation on a bare H100 / H200 (docs/gpu-validation.md): what the GPU must show, in four
commands of well under 10 minutes each on 16 cores, with the device bundle (scripts/device_bundle.sh)
carried along as build/device-bundle:

  1. scripts/gpu_validate.py $OUT probe tests      the machine, then every kernel test binary
  2. scripts/gpu_validate.py $OUT sanitize kernels compute-sanitizer; the kernel benchmarks
  3. scripts/gpu_validate.py $OUT profile python   the op profile (kept in build/gpu-validate for
                                                   command 4); the Python package on torch CUDA
                                                   tensors and the engine loop on the CUDA backend
  4. scripts/gpu_validate.py $OUT step             the decode step per schedule, with the
                                                   simulator's prediction from command 3's profile

Every stage writes as it goes into OUT (at most two files per stage, so that a command's files all
come back): STAGE.jsonl, one JSON record per binary / run, appended when it ends, and STAGE.log, the
full output. A command stopped at its time limit keeps what it finished. Every command first checks
that the carried binaries start there; if they do not, it builds them from source against the
bundle's prefix (build/device; kept between warm calls).

Usage: scripts/gpu_validate.py [--dry-run] [--bundle DIR] OUT STAGE...
  stages: probe tests sanitize kernels profile step python
  --dry-run  everything but the device work, on any machine (CI runs it): the probe (every carried
             binary starts), the device test binaries (their device cases skip themselves), the
             planned sanitizer and benchmark command lines (each benchmark's flags are parsed by ess
             itself: it must fail only for want of a device), and the records they would write.
Standard library only; the stages are the table STAGES at the end.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_TIMEOUT = int(os.environ.get("TEST_TIMEOUT", "420"))
SAN_TIMEOUT = int(os.environ.get("SAN_TIMEOUT", "240"))
BENCH_TIMEOUT = int(os.environ.get("BENCH_TIMEOUT", "300"))

# The device test binaries, cheapest and most basic first (if a command is cut off, what it finished is
# what everything else rests on). Their host runs, the emulation tests and the CPU-only tests pass in
# CI's ctest, from the same build; HOST_RUNS=1 runs them here too.
DEVICE_TESTS = ["cuda_flashtrans_test", "cuda_swap_engine_test", "cuda_split_test", "cuda_offload_test",
                "cuda_sparse_mla_test", "cuda_indexer_test", "cuda_executor_test"]

# compute-sanitizer on small filters (it runs kernels 10-100x slower). Memcheck: every device binary;
# racecheck and synccheck: the kernels with shared memory and barriers.
SAN_RUNS = [
    ("memcheck", "cuda_flashtrans_test", "*"),
    # BitForBit/1: a cluster of 2 blocks per request (forced); /5: 8 by the engine's choice (MTP 3, K 2048).
    ("memcheck", "cuda_swap_engine_test", "*WarmupMatches*:*BitForBit/1:*BitForBit/5:*Smaller*"),
    ("memcheck", "cuda_sparse_mla_test", "*K64_bad*:*K41_some*:*RowLengths*:*MergeStates*"),
    ("memcheck", "cuda_indexer_test", "*B3_T2_H64_exact*:*ReportsTheFirstRow*"),
    ("memcheck", "cuda_split_test", "*SplitShapes*/1:*SplitShapes*/3"),
    ("memcheck", "cuda_offload_test", "*OffloadShapes*/1:*OffloadShapes*/2:*WriteBack*:*EngineBuffer*:*Reset*"),
    ("memcheck", "cuda_executor_test", "executor.OffloadedNoneIsBitIdenticalToResident"),
    ("racecheck", "cuda_sparse_mla_test", "*K64_bad*:*K41_some*"),
    ("racecheck", "cuda_swap_engine_test", "*BitForBit/1:*WarmupMatches*"),
    ("racecheck", "cuda_indexer_test", "*B3_T2_H64_exact*:*ReportsTheFirstRow*"),
    ("racecheck", "cuda_split_test", "*SplitShapes*/1"),
    ("racecheck", "cuda_offload_test", "*OffloadShapes*/1:*WriteBack*"),
    ("synccheck", "cuda_sparse_mla_test", "*K64_bad*:*K41_some*"),
    ("synccheck", "cuda_swap_engine_test", "*BitForBit/1"),
    ("synccheck", "cuda_indexer_test", "*B3_T2_H64_exact*:*ReportsTheFirstRow*"),
    ("synccheck", "cuda_split_test", "*SplitShapes*/1"),
    ("synccheck", "cuda_offload_test", "*OffloadShapes*/1:*WriteBack*"),
]

# The kernel benchmarks and the lossless check on the CUDA backend: (record name, ess arguments).
KERNEL_RUNS = [
    ("transfer", "bench transfer --format json --blocks 4,8,16,24,32,48,64,132,264,1056 --concurrent"),
    ("swap", "bench swap --format json"),
    # Batch 1 and 2: a request's step on a cluster of blocks (the engine's choice) against one block.
    ("swap-b1", "bench swap --format json --requests 1"),
    ("swap-b1-one-block", "bench swap --format json --requests 1 --cluster 1"),
    ("swap-b2", "bench swap --format json --requests 2"),
    ("swap-b2-one-block", "bench swap --format json --requests 2 --cluster 1"),
    ("attention", "bench attention --format json --batches 1,2,8,32,64,128"),
    ("indexer-32k", "bench indexer --format json --requests 64 --context 32768"),
    ("indexer-128k", "bench indexer --format json --requests 16 --context 131072"),
    ("verify-cuda", "verify --backend cuda --format json"),
    ("verify-cuda-reserved", "verify --backend cuda --reserve-newest --mtp 3 --format json"),
    ("verify-cuda-groups", "verify --backend cuda --mtp 4 --topk 128 --slots 160 --format json"),
    # Residency: every request whole (no swap, no copy), and adaptive (a demotion, then a promotion).
    ("verify-cuda-whole", "verify --backend cuda --reserve-newest --residency whole --format json"),
    ("verify-cuda-adaptive", "verify --backend cuda --reserve-newest --residency adaptive --requests 3 --format json"),
    # DeepSeek-V4-Flash's C4 cache: rows as C4 pages, each entry's value and scale apart (FlashTrans's
    # 8-byte tail units on the device), sparse and adaptive.
    ("verify-cuda-v4", "verify --backend cuda --model configs/models/deepseek-v4-flash.json --layers 4 --context 8192 "
                       "--reserve-newest --format json"),
    ("verify-cuda-v4-adaptive", "verify --backend cuda --model configs/models/deepseek-v4-flash.json --layers 2 "
                                "--context 4096 --reserve-newest --residency adaptive --requests 3 --format json"),
    # The paper's MTP-4 deployment: top-2048 over 20 % of a 32K context (about 20 s of host work).
    ("verify-cuda-mtp4-k2048", "verify --backend cuda --mtp 4 --topk 2048 --context 32768 --ratio 0.2 --requests 2 "
                               "--layers 2 --steps 3 --reserve-newest --format json"),
]


class Failure(Exception):
    """The kit cannot go on (a binary missing, a build that failed): the message says which."""


def now() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def loads(path: Path) -> bool:
    """Whether a shared library exists and loads (an empty or foreign file does not)."""
    try:
        ctypes.CDLL(str(path))
        return path.exists()
    except OSError:
        return False


def find_cuda_lib(name: str) -> str | None:
    """The folder of a CUDA library wherever this machine keeps it: the toolkit, the loader's cache, or the CUDA
    wheels of its Python (nvidia/cu13/lib in CUDA 13's layout, nvidia/<lib>/lib before)."""
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/targets/x86_64-linux/lib"):
        if loads(Path(d) / name):
            return d
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
    for line in cache.splitlines():
        parts = line.split()
        if parts and parts[0] == name and loads(Path(parts[-1])):
            return str(Path(parts[-1]).parent)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        hits = sorted(glob.glob(os.path.join(root, "*", "lib", name)))
        if hits:
            return os.path.dirname(hits[0])
    return None


def starts(cmd: list[str]) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def timed(cmd: list[str], limit: int, **kw) -> tuple[int, int, subprocess.CompletedProcess]:
    """cmd under coreutils' timeout (exit 124 / 137 when cut off): (exit status, seconds, the process)."""
    start = time.time()
    p = subprocess.run(["timeout", "--kill-after=10", str(limit), *cmd], capture_output=True, text=True, **kw)
    return p.returncode, int(time.time() - start), p


class Kit:
    """Where the results go, where the binaries come from, and the CUDA libraries found."""

    def __init__(self, out: Path, dry: bool, bundle: str):
        self.out, self.dry, self.bundle = out, dry, ROOT / bundle
        self.stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.keep = ROOT / "build" / "gpu-validate"  # what a later command on the same (warm) machine reads
        self.keep.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp())      # outside OUT, whose files all come back (at most 8)
        self.cudart = find_cuda_lib("libcudart.so.13")
        self.cublas = find_cuda_lib("libcublas.so.13")  # for the rig's stand-in GEMMs, loaded when first made
        dirs = [d for d in dict.fromkeys([self.cudart, self.cublas]) if d]
        os.environ["LD_LIBRARY_PATH"] = ":".join([str(self.bundle / "lib"), *dirs] +
                                                 ([os.environ["LD_LIBRARY_PATH"]] if os.environ.get("LD_LIBRARY_PATH") else []))
        self.san = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        self.nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        self.bin, self.carried = self._binaries()
        self.ess = self.bin / "ess"
        self.log(f"binaries: {self.bin} ({'carried' if self.carried else 'built here'}); CUDA runtime: "
                 f"{self.cudart or 'not found'}; cuBLAS: {self.cublas or 'not found (ess bench step / profile need it)'}")

    def log(self, msg: str):
        print(f"[{now()}] {msg}", flush=True)

    def record(self, stage: str, rec: dict):
        with open(self.out / f"{stage}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def append(self, stage: str, text: str):
        with open(self.out / f"{stage}.log", "a") as f:
            f.write(text)

    def _binaries(self) -> tuple[Path, bool]:
        """The carried binaries (the bundle's archive, unpacked beside it) when they start here, else a build
        from source against the bundle's prefix."""
        unpacked = ROOT / "build" / "device-bundle-bin"
        shutil.rmtree(unpacked, ignore_errors=True)
        unpacked.mkdir(parents=True)
        archive = self.bundle / "bin.tar.xz"
        if archive.is_file():
            with tarfile.open(archive) as t:
                t.extractall(unpacked)
        carried = unpacked / "bin"
        if (carried / "ess").is_file() and starts([str(carried / "ess"), "--version"]) and all(
                starts([t, "--gtest_list_tests"]) for t in sorted(glob.glob(str(carried / "cuda_*_test")))):
            return carried, True
        build = ROOT / "build" / "device"
        if not (build / "tools" / "ess" / "ess").is_file():
            self.log(f"carried binaries do not start here: building from source with {self.bundle}/prefix")
            prefix = self.bundle / "prefix" / "usr"
            if not prefix.is_dir():
                raise Failure(f"no {prefix} (scripts/device_bundle.sh without --no-prefix)")
            log = self.out / "build.log"
            for what, cmd in (("configuring", ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
                                               "-DCMAKE_BUILD_TYPE=Release", "-DESS_BUILD_BENCHMARKS=OFF",
                                               f"-DCMAKE_PREFIX_PATH={prefix}"]),
                              ("building", ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)])):
                with open(log, "a") as f:
                    if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                        print(log.read_text()[-4000:], file=sys.stderr)
                        raise Failure(f"{what} the build from source failed (build.log)")
        view = build / "bin-view"
        view.mkdir(parents=True, exist_ok=True)
        links = {"ess": build / "tools" / "ess" / "ess"}
        links.update({p.name: p for p in (build / "src").rglob("cuda_*_test") if p.is_file() and os.access(p, os.X_OK)})
        if (build / "src" / "capi" / "libess.so").exists():
            links["libess.so"] = build / "src" / "capi" / "libess.so"
        for name, target in links.items():
            (view / name).unlink(missing_ok=True)
            (view / name).symlink_to(target)
        return view, False

    def need(self, name: str) -> Path:
        path = self.bin / name
        if not os.access(path, os.X_OK):
            raise Failure(f"{name} missing from {self.bin}")
        return path

    def ess_run(self, stage: str, name: str, args: list[str]):
        """One ess command: its JSON output (or its text) into STAGE.jsonl. In a dry run ess must fail only for
        want of a device (its flags and the configuration it checks first are fine)."""
        command = "ess " + " ".join(args)
        self.append(stage, f"== {command}\n")
        rc, secs, p = timed([str(self.ess), *args], BENCH_TIMEOUT)
        self.append(stage, p.stdout + p.stderr)
        if self.dry:
            if "no CUDA device" in p.stderr or (rc == 0 and name == "verify-cpu"):
                self.record(stage, {"stage": stage, "name": name, "command": command, "run": False,
                                    "why": "dry run: flags and configuration accepted, no device"})
                return
            print(p.stderr, file=sys.stderr)
            raise Failure(f"dry run: '{command}' failed other than for want of a device (exit {rc})")
        try:
            output = json.loads(p.stdout)
        except ValueError:
            output = p.stdout[-4000:]
        self.record(stage, {"stage": stage, "name": name, "command": command, "exit": rc, "seconds": secs,
                            "timed_out": rc in (124, 137), "output": output})
        self.log(f"{stage}: {name} exit {rc} ({secs} s)")


def version_line(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = (p.stdout + p.stderr).strip().splitlines()
        return lines[-1] if lines else "none"
    except OSError:
        return "none"


def missing_libraries(path: Path) -> str:
    p = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    return " ".join(line.split()[0] for line in p.stdout.splitlines() if "not found" in line)


def stage_probe(kit: Kit):
    smi = ""
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,pcie.link.gen.max,"
                              "pcie.link.width.max,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    binaries = []
    for b in sorted(kit.bin.iterdir()):
        missing = missing_libraries(b)
        if b.name.endswith(".so") or ".so." in b.name:
            kind, ok = "library", not missing  # a library loads; it is not run
        else:
            kind, ok = "program", starts([str(b), "--version" if b.name == "ess" else "--gtest_list_tests"])
        binaries.append({"binary": b.name, "kind": kind, "starts": ok, "missing_libraries": missing})
    os_name = "none"
    if Path("/etc/os-release").is_file():
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    kit.record("probe", {"stage": "probe", "date": kit.stamp, "dry_run": kit.dry, "gpu": smi or "none",
                         "nvcc": version_line([kit.nvcc, "--version"]), "compute_sanitizer": version_line([kit.san, "--version"]),
                         "cudart": kit.cudart or "not found", "cublas": kit.cublas or "not found",
                         "glibc": subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
                         "os": os_name, "cores": os.cpu_count(), "binaries_from": "bundle" if kit.carried else "source",
                         "binaries": binaries})
    ldd = subprocess.run(["ldd", str(kit.ess)], capture_output=True, text=True)
    kit.append("probe", f"== probe\n{smi}\n{ldd.stdout}{ldd.stderr}")
    kit.log(f"probe: {smi or 'no GPU'}")


def gtest_record(report: Path, name: str, rc: int, secs: int) -> dict:
    rec = {"stage": "tests", "binary": name, "exit": rc, "seconds": secs, "timed_out": rc in (124, 137)}
    try:
        g = json.loads(report.read_text())
        cases = [(s["name"] + "." + t["name"], t) for s in g.get("testsuites", []) for t in s.get("testsuite", [])]
        # What a test recorded (RecordProperty: worst error over its bound, ...), beside gtest's own fields.
        own = {"name", "file", "line", "status", "result", "timestamp", "time", "classname", "failures", "value_param",
               "type_param"}
        rec.update(tests=g.get("tests"), failures=g.get("failures"), errors=g.get("errors"),
                   skipped=sum(1 for _, t in cases if t.get("result") == "SKIPPED"),
                   failed=[n for n, t in cases if t.get("failures")],
                   recorded={n: {k: v for k, v in t.items() if k not in own} for n, t in cases if set(t) - own})
    except (OSError, ValueError) as e:
        rec["report"] = f"no gtest report ({e.__class__.__name__}): crashed or killed"
    return rec


def stage_tests(kit: Kit):
    names = list(DEVICE_TESTS)
    if os.environ.get("HOST_RUNS") == "1":
        names += [p.name for p in sorted(kit.bin.glob("cuda_*_test")) if p.name not in DEVICE_TESTS]
    records = []
    for name in names:
        binary = kit.need(name)
        report = kit.scratch / f"{name}.json"
        rc, secs, p = timed([str(binary), f"--gtest_output=json:{report}"], TEST_TIMEOUT)
        kit.append("tests", p.stdout + p.stderr)
        rec = gtest_record(report, name, rc, secs)
        kit.record("tests", rec)
        records.append(rec)
        kit.log(f"tests: {name} exit {rc} ({secs} s)")
    # The stage's verdict. With a device, a device binary's case that skips did not see it.
    device = [r for r in records if not r["binary"].endswith("_host_test") and r["binary"].startswith("cuda_")]
    summary = {"binaries": len(records), "not_run": [], "failed_binaries": [r["binary"] for r in records if r["exit"] != 0],
               "failures": sum(r.get("failures") or 0 for r in records),
               "skipped_in_device_binaries": sum(r.get("skipped") or 0 for r in device)}
    summary["ok"] = not summary["failed_binaries"] and (kit.dry or summary["skipped_in_device_binaries"] == 0)
    kit.record("tests", {"stage": "tests", "summary": summary})
    kit.log(f"tests: {json.dumps({'summary': summary})}")


def stage_sanitize(kit: Kit):
    for tool, name, flt in SAN_RUNS:
        binary = kit.need(name)
        cmd = [kit.san, "--tool", tool, "--error-exitcode", "99", "--print-limit", "50", str(binary),
               f"--gtest_filter={flt}", "--gtest_brief=1"]
        kit.append("sanitize", "== " + " ".join(cmd) + "\n")
        base = {"stage": "sanitize", "tool": tool, "binary": name, "filter": flt}
        if kit.dry or not os.access(kit.san, os.X_OK):
            kit.record("sanitize", {**base, "run": False,
                                    "why": "dry run" if kit.dry else f"no compute-sanitizer at {kit.san}"})
            continue
        rc, secs, p = timed(cmd, SAN_TIMEOUT)
        kit.append("sanitize", p.stdout + p.stderr)
        summary = [line[line.index("ERROR SUMMARY"):] for line in (p.stdout + p.stderr).splitlines() if "ERROR SUMMARY" in line]
        kit.record("sanitize", {**base, "run": True, "exit": rc, "seconds": secs, "summary": summary[-1] if summary else ""})
        kit.log(f"sanitize: {tool} {name} exit {rc} {summary[-1] if summary else ''}")


def stage_kernels(kit: Kit):
    for name, args in KERNEL_RUNS:
        kit.ess_run("kernels", name, args.split())


def stage_profile(kit: Kit):
    """The op table `ess sim --rig-layers` reads; a copy stays on this machine for the step stage of a later command."""
    kit.ess_run("profile", "profile", ["bench", "profile", "--out", str(kit.out / "profile")])
    for f in [*kit.out.glob("profile-*.csv"), *kit.out.glob("profile-*.json"), kit.out / "profile.json"]:
        if f.is_file():
            shutil.copy(f, kit.keep)


def stage_step(kit: Kit):
    hw, table = kit.keep / "profile-hardware.json", kit.keep / "profile-ops.csv"
    pred = []
    if hw.is_file() and table.is_file():
        pred = ["--profile-hardware", str(hw), "--profile-table", str(table)]
    else:
        kit.record("step", {"stage": "step", "note": f"no op profile in {kit.keep} (run the profile stage first on this "
                                                     "machine): no predictions"})
    # Each point is appended to step.jsonl as soon as it is measured (--points).
    kit.ess_run("step", "step", ["bench", "step", "--format", "json", "--batch", "1,2,16,64,128",
                                 "--points", str(kit.out / "step.jsonl"), *pred])
    # DA and DBA as ESS runs them inside SGLang 0.5.23 (PreAttn before the indexer, outside the copy window).
    kit.ess_run("step", "step-sglang", ["bench", "step", "--format", "json", "--batch", "16,64,128", "--overlap",
                                        "da,dba", "--preattn-before-indexer", "--no-resident", "--no-gain",
                                        "--points", str(kit.out / "step-sglang.jsonl"), *pred])


def stage_python(kit: Kit):
    """The Python package (python/, in the work tree) on this libess: its pytest suite, whose CUDA cases (torch CUDA
    tensors, the CUDA backend, a CUDA graph) run where torch sees the GPU, and the engine-loop example."""
    lib = kit.bin / "libess.so"
    py = next((c for c in ("python3", "/usr/bin/python3") if shutil.which(c) and
               starts([c, "-c", "import numpy, pytest"])), None)
    if py is None or not lib.exists():
        kit.record("python", {"stage": "python", "run": False,
                              "why": "no python3 with numpy and pytest" if py is None else f"no {lib}"})
        return
    env = dict(os.environ, ESS_LIBRARY=str(lib))
    example = str(ROOT / "examples" / "engine_loop.py")
    # A dry run collects the suite on this libess (every module imports it) and leaves the running to CI's ctest.
    runs = {"pytest": [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *(["--collect-only"] if kit.dry else []),
                       str(ROOT / "python" / "tests")],
            "example": [py, example, "--format", "json"],
            # The CUDA backend, torch CUDA tensors: bit-identical to attention over the full cache.
            "example-cuda": [py, example, "--backend", "cuda", "--format", "json"]}
    for name, cmd in runs.items():
        if name == "example-cuda" and kit.dry:
            kit.record("python", {"stage": "python", "name": name, "run": False, "why": "dry run: no device"})
            continue
        rc, secs, p = timed(cmd, TEST_TIMEOUT, env=env)
        out = p.stdout + p.stderr
        kit.append("python", out)
        kit.record("python", {"stage": "python", "name": name, "exit": rc, "seconds": secs,
                              "python": version_line([py, "--version"]), "tail": "\n".join(out.splitlines()[-15:])})
        kit.log(f"python: {name} exit {rc}")


STAGES = {"probe": stage_probe, "tests": stage_tests, "sanitize": stage_sanitize, "kernels": stage_kernels,
          "profile": stage_profile, "step": stage_step, "python": stage_python}


def main() -> int:
    ap = argparse.ArgumentParser(usage=__doc__, add_help=True, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--bundle", default="build/device-bundle")
    ap.add_argument("out")
    ap.add_argument("stages", nargs="+")
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    a = ap.parse_args()
    unknown = [s for s in a.stages if s not in STAGES]
    if unknown:
        print(f"gpu_validate: unknown stage '{unknown[0]}' (stages: {' '.join(STAGES)})", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        kit = Kit(out.resolve(), a.dry_run, a.bundle)
        try:
            for s in a.stages:
                kit.log(f"stage {s}")
                for f in (kit.out / f"{s}.jsonl", kit.out / f"{s}.log"):  # a stage's files hold one run
                    f.unlink(missing_ok=True)
                STAGES[s](kit)
        finally:
            shutil.rmtree(kit.scratch, ignore_errors=True)
    except Failure as e:
        print(f"gpu_validate: {e}", file=sys.stderr)
        return 1
    kit.log(f"done: results in {kit.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
