"""Launches an SGLang server with ESS in HiSparse's place:

    python -m ess.integrations.sglang_launch --model-path deepseek-ai/DeepSeek-V3.2-Exp --enable-hisparse ...

takes exactly sglang.launch_server's arguments. Every process of the server (the scheduler and model
runner processes SGLang spawns included) installs ESS's coordinator at start-up: this module puts
ess/integrations/sglang_site on PYTHONPATH with ESS_SGLANG=1, so each process's sitecustomize calls
ess.integrations.sglang.install(). No line of SGLang changes."""
import os
import runpy
import sys


def prepare_environment(env=os.environ):
    """PYTHONPATH and ESS_SGLANG for this process's children (and for this process's own install())."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_site")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    env["PYTHONPATH"] = os.pathsep.join([site] + paths)
    env["ESS_SGLANG"] = "1"


def main(argv=None):
    prepare_environment()
    from ess.integrations.sglang import install
    install()
    sys.argv = ["sglang.launch_server"] + list(sys.argv[1:] if argv is None else argv)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
