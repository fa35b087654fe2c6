"""Adapters with the call shapes of the HiSparse ports: `ess.integrations.sglang` and `ess.integrations.vllm`."""
