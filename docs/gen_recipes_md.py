# Fills docs/recipes.md.in with `ess plan --engine ...` outputs: for each recipe its command, the
# plan with ESS's launch line, and stock HiSparse's line for the same hardware.
#   python3 docs/gen_recipes_md.py BUILD/tools/ess/ess docs/recipes.md.in > docs/recipes.md
#   python3 docs/gen_recipes_md.py BUILD/tools/ess/ess docs/recipes.md.in --check docs/recipes.md
# The second (the ctest `docs.recipes_current`) fails, with the first differing line, when the page is
# not what the commands print.
import difflib
import json
import shlex
import subprocess
import sys

ESS = sys.argv[1]
TEMPLATE = sys.argv[2]

# SGLang 0.5.23's HiSparse defaults (srt/mem_cache/sparsity/factory.py, _parse_sparse_config): top_k 2048,
# device_buffer_size 2 x top_k, host_to_device_ratio 2 (the host pool is twice the device KV pool, in tokens).
STOCK_HISPARSE = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}
ESS_ONLY_FLAGS = {"--dsa-decode-backend"}  # chosen for ESS's DA overlap; stock HiSparse keeps SGLang's default


def run(args, ok=True):
    p = subprocess.run([ESS, *args], capture_output=True, text=True)
    if ok and p.returncode != 0:
        sys.exit(f"ess {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


def stock_vllm(argv, deployment):
    """Stock HiSparse under vLLM 0.33.0: the same `vllm serve` with upstream's HiSparseConnector (no module path),
    HiSparse's default device buffer ((T + 1) x top-k: no --attention-config) and vLLM's budget at the plan's memory
    fraction (no ESS rows beside it)."""
    stock, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--attention-config":
            skip = True
            continue
        if i > 0 and argv[i - 1] == "--kv-transfer-config":
            config = json.loads(a)
            config.pop("kv_connector_module_path")
            a = json.dumps(config)
        if i > 0 and argv[i - 1] == "--gpu-memory-utilization":
            a = str(deployment["mem_fraction_static"])
        stock.append(a)
    return stock


def stock_lines(args):
    """Stock HiSparse's launch line beside each context's ESS line (from the JSON plan): SGLang's own server,
    `--hisparse-config` at upstream's defaults, no ESS settings."""
    plan = json.loads(run([*args, "--format", "json"]).stdout)
    out = []
    for p in plan["plans"]:
        launch = p.get("launch")
        if not launch or not p["chosen"]["offload"]:
            continue
        argv = list(launch["argv"])
        if argv[0] == "vllm":
            stock = stock_vllm(argv, plan["deployment"])
        else:
            argv[2] = "sglang.launch_server"
            stock, skip = [], False
            for i, a in enumerate(argv):
                if skip:
                    skip = False
                    continue
                if a in ESS_ONLY_FLAGS:
                    skip = True
                    continue
                if i > 0 and argv[i - 1] == "--hisparse-config":
                    a = json.dumps(STOCK_HISPARSE)
                stock.append(a)
        lines = [" ".join(shlex.quote(a) for a in stock[:3])]  # python -m sglang.launch_server / vllm serve MODEL
        for a in stock[3:]:
            if a.startswith("--") or not lines[-1].lstrip().startswith("--"):
                lines.append(shlex.quote(a))
            else:
                lines[-1] += " " + shlex.quote(a)  # a flag's value on its line
        out.append(f"Stock HiSparse for context {p['context']} on the same hardware and flags:\n\n```sh\n"
                   + " \\\n    ".join(lines) + "\n```\n")
    return "\n".join(out)


out = open(TEMPLATE).read()
i = 0
while "@RECIPE " in out[i:]:
    start = out.index("@RECIPE ", i)
    end = out.index("@", start + 1)
    args = shlex.split(out[start + len("@RECIPE "):end])
    p = run(args, ok=False)
    if p.returncode not in (0, 1):  # 1: some context has no configuration, said in the table
        body = f"$ ess {' '.join(args)}\n{p.stderr.strip()}"
        text = f"```\n{body}\n```\n"
    else:
        text = f"```\n$ ess {' '.join(args)}\n{p.stdout.rstrip()}\n```\n\n{stock_lines(args)}"
    out = out[:start] + text + out[end + 1:]
    i = start + len(text)
if len(sys.argv) > 4 and sys.argv[3] == "--check":
    page = open(sys.argv[4]).read()
    if page != out:
        diff = list(difflib.unified_diff(page.splitlines(), out.splitlines(), sys.argv[4], "the commands' output",
                                         lineterm="", n=1))
        sys.exit("\n".join(diff[:40]) + f"\n{sys.argv[4]} is not what the commands print: regenerate it with "
                 f"python3 docs/gen_recipes_md.py ESS {TEMPLATE} > {sys.argv[4]}")
else:
    sys.stdout.write(out)
