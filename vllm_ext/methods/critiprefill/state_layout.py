"""Where a request's CritiPrefill state lives in its pages of vLLM's KV cache (``docs/per_request_memory.md``).

The state of one (request, sparse layer) is a run of *entries* in the attention layer's own KV format
(one entry = one token slot of a page: ``[Hkv, 2*D]``, the K half and the V half), read and written
through the request's block-table row of CritiPrefill's KV-cache group: entry ``e`` of KV head ``h``
is ``cache[table[e // page_size], h, e % page_size]``.

- entries ``0 .. G-1`` (``G = Hq / Hkv``): the query carry, query head ``h*G + g`` in entry ``g`` of
  KV head ``h`` (max in the K half, min in the V half; a max or min of queries is exact in the query
  dtype, which is the KV dtype unless ``--kv-cache-dtype`` names another);
- entries ``G + b``: key block ``b``'s representatives (max in the K half, min in the V half), for
  the blocks ``0 .. ceil(n / Bk) - 1`` of the ``n`` tokens computed so far.

A prompt of ``P`` tokens thus takes ``ceil((G + ceil(P / Bk)) / page_size)`` pages at its prefill's
end, grown chunk by chunk. Pure arithmetic (no torch, no vLLM).
"""

from __future__ import annotations

# the state cache layer of attention layer ``name`` is ``name + STATE_SUFFIX`` in vLLM's forward context
STATE_SUFFIX = ".critiprefill_state"


def state_entries(num_tokens: int, carry_entries: int, cp_block_size: int) -> int:
    """Entries per KV head that hold the state of ``num_tokens`` computed tokens (0 for none)."""
    if num_tokens <= 0:
        return 0
    return carry_entries + -(-num_tokens // cp_block_size)


def state_pages(num_tokens: int, carry_entries: int, cp_block_size: int, page_size: int) -> int:
    """Pages (KV-cache blocks) of the CritiPrefill group that hold that state."""
    return -(-state_entries(num_tokens, carry_entries, cp_block_size) // page_size)
