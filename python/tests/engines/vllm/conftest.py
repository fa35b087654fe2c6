"""vLLM chooses its platform once, at its first use, and on a machine without a GPU it recognises none ("Failed to
infer device type" when a VllmConfig is built): its CPU platform is named before anything imports vLLM. The tests
that need CUDA's configuration rather than the CPU backend's say so themselves (test_vllm_scheduler.py)."""
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
