import sys
from pathlib import Path

# The package from this checkout (an installed one is tested by pointing PYTHONPATH elsewhere).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
