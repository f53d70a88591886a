"""SFI, sparse decode (ALGORITHMS.md §1): the sink, a selected set and the recent tokens' KV on fast
steps; dense slow steps at sentence boundaries choose the selection again.

- :mod:`.method`, :mod:`.layer`: what the backend calls (the method and its share of a layer);
- :mod:`.config`: its configuration section;
- :mod:`.slot_tables` and its parts, :mod:`.step_plan`, :mod:`.schedule`, :mod:`.triggers`: the
  per-request tables and the device-side slow/fast schedule of each step;
- :mod:`.path`, :mod:`.runtime`: one layer's decode and prefill-end work over the kernels;
- :mod:`.kv_spec`, :mod:`.caches` and the other ``*_kv_spec`` modules: its pages of vLLM's KV cache;
- :mod:`.scheduling`, :mod:`.warmup`: its scheduler rules and start-up warm-up.
"""
