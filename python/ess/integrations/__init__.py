"""ESS under the HiSparse ports: `ess.integrations.sglang` (SGLang 0.5.23's HiSparseCoordinator replaced) and
`ess.integrations.vllm` / `vllm_connector` (vLLM 0.33.0's HiSparse decode swap, as a KV connector)."""
