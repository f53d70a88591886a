"""SPEED: prompt tokens' KV only in the lower layers (ALGORITHMS.md §2).

- :mod:`vllm_ext.methods.speed.visibility`: the visibility rule and the per-step plan (torch only);
- :mod:`vllm_ext.methods.speed.kv_spec`: the upper layers' KV-cache spec and block manager (vLLM glue).
"""
