import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKOUT_PACKAGE = TESTS.parent  # python/: the package `ess` of this checkout

# The package from this checkout; with ESS_TEST_INSTALLED=1 the installed one (pip install .), which must
# not be this checkout's.
if os.environ.get("ESS_TEST_INSTALLED") == "1":
    import ess

    if Path(ess.__file__).resolve().parent.parent == CHECKOUT_PACKAGE:
        raise RuntimeError(f"ESS_TEST_INSTALLED=1 but ess comes from the checkout ({ess.__file__}): "
                           "run the tests from a directory outside it")
else:
    sys.path.insert(0, str(CHECKOUT_PACKAGE))
sys.path.insert(0, str(TESTS))

# python/tests/engines/<engine>/ import SGLang or vLLM themselves: they run in that engine's venv
# (scripts/engines.sh), with ESS_ENGINE naming it, never in the plain suite (Debian's torch, no engines).
_engine = os.environ.get("ESS_ENGINE")
collect_ignore = ["engines"] if not _engine else [f"engines/{e}" for e in ("sglang", "vllm") if e != _engine]
