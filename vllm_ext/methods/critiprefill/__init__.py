"""CritiPrefill: segment-wise criticality for block-sparse prefill (ALGORITHMS.md §3).

- :mod:`.method`: what the backend calls (the method and its share of a layer);
- :mod:`.config`: its configuration section;
- :mod:`.criticality`, :mod:`.plan`: scores, layer fusion and the per-layer block selection;
- :mod:`.slots`, :mod:`.chunking`, :mod:`.scheduling`: the step's sub-batch, chunk rules and
  scheduler rules;
- :mod:`.path`: one sparse layer of a step; :mod:`.kv_spec`, :mod:`.state_cache`: its per-request
  state in vLLM's KV cache.
"""
