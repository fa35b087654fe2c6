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
