#!/usr/bin/env python3
"""Every file the official safetensors package refuses, `ess trace info --validate` refuses too
(exit 2 with a message, never a crash), over the structural cases of tests/trace/fuzz/corpus
and a few hundred deterministic mutations of valid traces (header digits changed, bytes added,
removed or flipped, header length moved). `ess trace analyze` is held to the same on the
structural cases. Exits 77 (skipped) when safetensors cannot be imported.

    safetensors_crosscheck.py --ess build/cpu/tools/ess/ess --corpus tests/trace/fuzz/corpus [--mutations 300]
"""
import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from safetensors import safe_open
except ImportError:
    print("safetensors is not installed (pip install safetensors): skipped")
    sys.exit(77)


def safetensors_refuses(path):
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
        return None
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return f"{type(e).__name__}: {e}"


def raw(ch):
    """A control character (but a newline) or a byte that was not UTF-8 (decoded as a surrogate)."""
    o = ord(ch)
    return (o < 0x20 and ch != "\n") or 0x7f <= o < 0xa0 or 0xdc80 <= o <= 0xdcff


def mutate(data, rng):
    b = bytearray(data)
    n = int.from_bytes(b[:8], "little") if len(b) >= 8 else 0
    kind = rng.randrange(6)
    if kind == 0 and n:  # a digit of the header (offsets, shapes, lengths, counts)
        digits = [i for i in range(8, min(8 + n, len(b))) if chr(b[i]).isdigit()]
        if digits:
            b[rng.choice(digits)] = ord(str(rng.randrange(10)))
    elif kind == 1:
        b += bytes(rng.randrange(1, 17))
    elif kind == 2 and len(b) > 8 + n:
        del b[len(b) - rng.randrange(1, min(16, len(b) - 8 - n) + 1):]
    elif kind == 3:
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == 4 and len(b) >= 8:
        b[:8] = max(0, n + rng.choice([-8, -1, 1, 8])).to_bytes(8, "little")
    elif 8 + n < len(b):
        at = rng.randrange(8 + n, len(b))
        b[at:at] = bytes(rng.choice([4, 8]))
    return bytes(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ess", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--mutations", type=int, default=300)
    a = ap.parse_args()
    ess = str(Path(a.ess).resolve())
    failures, refused, checked = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="ess-st-") as tmp:
        work = Path(tmp)
        subprocess.run([ess, "trace", "gen", "-o", str(work / "gen.safetensors"), "-c", "300", "-b", "2", "-s", "2",
                        "-l", "2", "--seed", "3"], check=True, capture_output=True, timeout=120)
        corpus = sorted(p for p in Path(a.corpus).iterdir() if p.is_file())
        seeds = [p.read_bytes() for p in corpus if p.name == "structure-valid"] + [(work / "gen.safetensors").read_bytes()]
        rng = random.Random(25)
        cases = [(p.name, p.read_bytes(), True) for p in corpus]
        cases += [(f"mutation-{i}", mutate(rng.choice(seeds), rng), False) for i in range(a.mutations)]
        for name, data, structural in cases:
            path = work / name
            path.write_bytes(data)
            why = safetensors_refuses(path)
            commands = [["trace", "info", str(path), "--validate"]]
            if structural:
                commands.append(["trace", "analyze", str(path), "--no-recommend", "--policies", "lru"])
            for cmd in commands:
                checked += 1
                r = subprocess.run([ess, *cmd], capture_output=True, text=True, errors="surrogateescape", timeout=60)
                what = f"{name}: ess {' '.join(cmd[:2])}"
                if r.returncode < 0 or r.returncode == 4 or "internal error" in r.stderr:
                    failures.append(f"{what}: crashed or internal error (exit {r.returncode}): {r.stderr.strip()[:300]}")
                elif r.returncode not in (0, 2):
                    failures.append(f"{what}: exit {r.returncode}: {r.stderr.strip()[:300]}")
                elif why is not None and r.returncode != 2:
                    failures.append(f"{what}: accepted a file safetensors refuses ({why})")
                elif r.returncode == 2 and (str(path) not in r.stderr or len(r.stderr.strip()) < 40):
                    failures.append(f"{what}: the refusal does not name the file: {r.stderr.strip()[:300]}")
                elif any(raw(ch) for ch in r.stderr + r.stdout):
                    failures.append(f"{what}: control characters or bytes that are not UTF-8 printed raw: "
                                    f"{ascii(r.stderr)[:300]}")
            refused += why is not None
            path.unlink()
        for f in failures:
            print("FAIL", f)
        print(f"{len(cases)} files ({refused} refused by safetensors), {checked} runs of ess, {len(failures)} failures")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
