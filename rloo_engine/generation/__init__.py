"""Every way of producing completions: the interface and backend factory (`base`), HF `generate` and the fused
decoding loop with its cache and sampler (`hf`, `fused_decode`, `kv_cache`, `sampling`), vLLM colocate
(`vllm_colocate`), the vLLM server client and weight transfer (`vllm_server`, `vllm_client`, `vllm_gloo_transfer`)
and `rloo-engine vllm-serve` (`vllm_serve`).

Nothing is imported here: vLLM's worker processes import `vllm_gloo_transfer` alone (the plugin entry point), and
the HF backend must not pull vLLM in, nor vLLM's modules torch's generation stack.
"""
