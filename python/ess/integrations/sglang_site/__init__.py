"""sitecustomize for `python -m ess.integrations.sglang_launch` (see sitecustomize.py)."""
