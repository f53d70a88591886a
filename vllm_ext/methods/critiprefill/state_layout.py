"""Where a request's CritiPrefill state lives in its pages of vLLM's KV cache (``docs/per_request_memory.md``).

The state of one (request, sparse layer) is a run of *entries* in the attention layer's own KV format
(one entry = one token slot of a page: ``[Hkv, 2*D]``, the K half and the V half), read and written
through the request's block-table row of CritiPrefill's KV-cache group: entry ``e`` of KV head ``h``
is ``cache[table[e // page_size], h, e % page_size]``.

- entries ``0 .. C-1``: the query carry, the bytes of the query's dtype whatever the pages' (a max
  or min of queries is exact in the query's dtype; an fp8 page would round it, and the carried part
  of a segment cut by a chunk would then depend on the chunking): query head ``h*G + g``
  (``G = Hq / Hkv``) in entries ``g*m .. g*m + m - 1`` of KV head ``h``, its max then its min (``D``
  values each), ``m = ceil(query itemsize / page itemsize)`` entries of ``2*D`` page elements each
  (:func:`carry_entries`: ``C = G * m``; ``m = 1`` when the pages hold the query's dtype);
- entries ``C + b``: key block ``b``'s representatives (max in the K half, min in the V half), for
  the blocks ``0 .. ceil(n / Bk) - 1`` of the ``n`` tokens computed so far.

A prompt of ``P`` tokens thus takes ``ceil((C + ceil(P / Bk)) / page_size)`` pages at its prefill's
end, grown chunk by chunk. Pure arithmetic (no torch, no vLLM).
"""

from __future__ import annotations

# the state cache layer of attention layer ``name`` is ``name + STATE_SUFFIX`` in vLLM's forward context
STATE_SUFFIX = ".critiprefill_state"


def carry_entries(num_heads: int, num_kv_heads: int, query_itemsize: int, page_itemsize: int) -> int:
    """Entries per KV head of the query carry (``C`` above)."""
    return max(1, num_heads // num_kv_heads) * -(-query_itemsize // page_itemsize)


def state_entries(num_tokens: int, carry_entries: int, cp_block_size: int) -> int:
    """Entries per KV head that hold the state of ``num_tokens`` computed tokens (0 for none)."""
    if num_tokens <= 0:
        return 0
    return carry_entries + -(-num_tokens // cp_block_size)


def state_pages(num_tokens: int, carry_entries: int, cp_block_size: int, page_size: int) -> int:
    """Pages (KV-cache blocks) of the CritiPrefill group that hold that state."""
    return -(-state_entries(num_tokens, carry_entries, cp_block_size) // page_size)
