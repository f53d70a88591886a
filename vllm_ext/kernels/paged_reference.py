"""PyTorch reference for vLLM's paged KV cache: views, writes and dense causal attention.

The cache of one layer is vLLM 0.32's logical view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(K in ``[..., :D]``, V in ``[..., D:]``) with whatever physical strides the resolved ``KVCacheLayout``
gives. Everything here indexes through that view, so every layout works.

On the CPU build the cache can also be a :class:`~vllm_ext.kernels.packed_pages.PackedPages`
(vLLM's ``CPU_ATTN`` page packing, K transposed per page): every function here reads it through its
K and V views, so the twins above them read either format.

This is the CPU build's dense path where ``CPU_ATTN``'s kernel cannot run (the dense rows of a
method-on step run ``CPU_ATTN`` on packed pages: ``vllm_ext.backend.dense_path``) and the
reference every kernel test compares with. It runs a Python loop over requests (CPU only; the CUDA
path never runs it on a hot path).

fp8 pages (``kernels.kv_quant``): :func:`write_kv` quantises with the layer's scales as vLLM's
write does, :func:`dense_paged_attention` applies them; the gathers return stored values.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.packed_pages import PackedPages, PageView, index_blocks


def split_kv(kv_cache: torch.Tensor | PackedPages) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, 2D]`` -> K and V views ``[B, H, N, D]`` each (no copy)."""
    if isinstance(kv_cache, PackedPages):
        return kv_cache.k, kv_cache.v
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d], kv_cache[..., d:]


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | float | None = None,
             v_scale: torch.Tensor | float | None = None) -> None:
    """Store ``key``/``value`` ``[T, H, D]`` at ``slot_mapping`` (``block * block_size + offset``).

    Slots ``< 0`` (vLLM's ``PAD_SLOT_ID``) are skipped; only the first ``len(slot_mapping)`` tokens
    are written (vLLM pads ``key``/``value`` beyond the actual tokens). When the cache's entries
    (``2D`` elements each) tile its storage densely (every vLLM layout), one ``index_copy_`` of whole
    entries over a flat ``[entries, 2D]`` view; otherwise two advanced-index writes. An fp8 cache
    stores ``value / scale`` saturated (vLLM's write); the scales are ignored otherwise."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    nb, h, block_size, c = kv_cache.shape
    d = c // 2
    slots = slot_mapping.long()
    k, v = key[:n], value[:n]
    if slots.min() < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
        if slots.numel() == 0:
            return
    blk, off = slots // block_size, slots % block_size
    k = kv_quant.quantize(k, k_scale, kv_cache.dtype)
    v = kv_quant.quantize(v, v_scale, kv_cache.dtype)
    if isinstance(kv_cache, PackedPages):
        kv_cache.k[blk, :, off] = k
        kv_cache.v[blk, :, off] = v
        return
    flat = _entries_view(kv_cache)
    if flat is None:
        kv_cache[blk, :, off, :d] = k
        kv_cache[blk, :, off, d:] = v
        return
    s0, s1, s2 = (kv_cache.stride(i) // c for i in range(3))
    idx = (blk * s0 + off * s2)[:, None] + torch.arange(0, h * s1, s1, device=slots.device)   # [n, H]
    # fp8 as bytes: the CPU has no fp8 index_copy_
    kv_quant.as_bytes(flat).index_copy_(0, idx.reshape(-1), kv_quant.as_bytes(torch.cat([k, v], dim=-1)).reshape(-1, c))


def _entries_view(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """``[entries, 2D]`` view of the cache's storage when its entries tile it densely (a permutation
    of a contiguous ``[blocks, heads, tokens]`` of entries, unit last stride: every vLLM layout),
    else ``None``."""
    c = kv_cache.shape[-1]
    if kv_cache.stride(-1) != 1 or kv_cache.numel() == 0:
        return None
    expect = c
    dims = sorted(((kv_cache.stride(i), kv_cache.shape[i]) for i in range(3) if kv_cache.shape[i] > 1))
    for stride, size in dims:
        if stride != expect:
            return None
        expect *= size
    return kv_cache.as_strided((kv_cache.numel() // c, c), (c, 1), kv_cache.storage_offset())


def gather_entries(kv_cache: torch.Tensor, blocks: torch.Tensor, heads: torch.Tensor,
                   offsets: torch.Tensor, width: int | None = None, start: int = 0) -> torch.Tensor:
    """``kv_cache[blocks, heads, offsets, start:start + width]`` (the index tensors broadcast) as one
    row gather: the cache is read as overlapping rows of ``width`` elements, one starting at every
    element (``as_strided``, no copy), and the entries' element offsets select rows
    (``index_select``), several times faster on the CPU than advanced indexing over three dims.
    Needs a unit last stride. ``width`` defaults to the whole entry (``2 * head_size``)."""
    c = kv_cache.shape[-1]
    width = c - start if width is None else width
    if isinstance(kv_cache, PackedPages):
        d = c // 2
        if start + width <= d:
            return kv_cache.k[blocks, heads, offsets][..., start:start + width]
        if start >= d:
            return kv_cache.v[blocks, heads, offsets][..., start - d:start - d + width]
        return kv_cache[blocks, heads, offsets][..., start:start + width]
    if kv_cache.stride(-1) != 1 or kv_cache.numel() == 0:
        return kv_cache[blocks, heads, offsets, start:start + width]
    s0, s1, s2 = kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)
    span = sum((n - 1) * s for n, s in zip(kv_cache.shape[:3], (s0, s1, s2))) + 1
    rows = kv_cache.as_strided((span, width), (1, 1), kv_cache.storage_offset() + start)
    off = blocks.long() * s0 + heads.long() * s1 + offsets.long() * s2
    return rows.index_select(0, off.reshape(-1)).view(*off.shape, width)


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request at token ``positions`` -> ``[H, len(positions), D]`` each."""
    block_size = kv_cache.shape[2]
    pos = positions.long()
    blocks = block_table_row.long()[pos // block_size]
    k_cache, v_cache = split_kv(kv_cache)
    k = k_cache[blocks, :, pos % block_size]          # [n, H, D]
    v = v_cache[blocks, :, pos % block_size]
    return k.transpose(0, 1), v.transpose(0, 1)


def attention_over(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32, GQA by head grouping.

    query ``[n_q, Hq, D]``, k/v ``[Hkv, n_k, D]``, mask ``[n_q, n_k]`` (True = visible) or ``[n_q, Hq, n_k]``.
    Returns (out ``[n_q, Hq, D]`` fp32, lse ``[n_q, Hq]`` fp32; ``-inf`` lse where nothing is visible,
    with a zero output there).
    """
    n_q, hq, d = query.shape
    hkv = k.shape[0]
    g = hq // hkv
    q = query.float().reshape(n_q, hkv, g, d).permute(1, 2, 0, 3)          # [Hkv, G, n_q, D]
    s = torch.einsum("hgqd,hkd->hgqk", q, k.float()) * scale               # [Hkv, G, n_q, n_k]
    if mask is not None:
        if mask.dim() == 2:
            m = mask[None, None]
        else:
            m = mask.reshape(n_q, hkv, g, -1).permute(1, 2, 0, 3)
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                        # [Hkv, G, n_q]
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("hgqk,hkd->hgqd", p, v.float())
    return (out.permute(2, 0, 1, 3).reshape(n_q, hq, -1),
            lse.permute(2, 0, 1).reshape(n_q, hq))


def gather_prefix(kv_cache: torch.Tensor, block_table_row: torch.Tensor,
                  length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's positions ``[0, length)`` -> ``[H, length, D]`` each: one gather of
    whole blocks (not of tokens), then a view."""
    block_size = kv_cache.shape[2]
    d = kv_cache.shape[-1] // 2
    n_blocks = -(-length // block_size)
    kv = kv_cache.index_select(0, block_table_row[:n_blocks].long())        # [nb, H, N, 2D]
    kv = kv.transpose(0, 1).reshape(kv.shape[1], n_blocks * block_size, 2 * d)[:, :length]
    return kv[..., :d], kv[..., d:]


_MAX_RUNS = 16                 # more runs of consecutive blocks than this: one index_select instead
_scratch: dict[tuple, torch.Tensor] = {}


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device, tag: str = "") -> torch.Tensor:
    """A persistent buffer of at least ``numel`` elements (one per dtype, device and ``tag``: users
    whose results can be alive at once take different tags): a fresh large allocation per layer and
    step would fault its pages in again."""
    key = (dtype, device, tag)
    buf = _scratch.get(key)
    # a buffer made under inference mode cannot be written outside it (and the reverse is wasteful)
    if buf is None or buf.numel() < numel or buf.is_inference() != torch.is_inference_mode_enabled():
        buf = torch.empty(max(numel, 1 << 16), dtype=dtype, device=device)
        _scratch[key] = buf
    return buf[:numel]


def _block_runs(block_table_row: torch.Tensor, n_blocks: int) -> list[tuple[int, int, int]] | None:
    """The first ``n_blocks`` of a block-table row as runs of consecutive block ids ``(start, end,
    first id)``, or ``None`` past ``_MAX_RUNS`` runs (a fragmented cache: one gather is cheaper)."""
    ids = block_table_row[:n_blocks].tolist()
    runs, start = [], 0
    for j in range(1, n_blocks + 1):
        if j == n_blocks or ids[j] != ids[j - 1] + 1:
            runs.append((start, j, ids[start]))
            start = j
            if len(runs) > _MAX_RUNS:
                return None
    return runs


def _copy_blocks(dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor, runs, perm: tuple,
                 block_dim: int) -> None:
    """``dst`` (block axis ``block_dim``) <- the blocks ``table`` of ``src`` ``[B, ...]`` permuted by
    ``perm``: one copy per run of consecutive ids, or one gather then one copy (``runs`` None)."""
    if isinstance(src, PageView):                  # CPU_ATTN's amx pages: one copy per run, as 6-d views
        if runs is None:
            src.copy_blocks_to(dst, table.long(), perm)
            return
        for a, b, first in runs:
            src.copy_blocks_to(dst.narrow(block_dim, a, b - a), slice(first, first + (b - a)), perm)
        return
    if runs is None:
        dst.copy_(index_blocks(src, table.long()).permute(perm))
        return
    for a, b, first in runs:
        dst.narrow(block_dim, a, b - a).copy_(src[first:first + (b - a)].permute(perm))


def gather_prefix_into(kv_cache: torch.Tensor, block_table_row: torch.Tensor, length: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_prefix` converted to ``dtype`` in one pass on the CPU: the request's blocks are
    read as runs of consecutive block ids (vLLM hands a request's blocks out mostly in order), each
    run copied (transposed to head-major, converted) straight into a persistent scratch buffer
    ``[H, length, 2D]``. The same values as ``gather_prefix(...)`` followed by ``.to(dtype)``; the views
    returned alias the scratch buffer (valid until the next call). With many runs (a fragmented
    cache, or blocks handed out in descending order after frees) one ``index_select`` gathers the
    blocks first and one copy transposes and converts them. Off the CPU: ``gather_prefix`` and a
    conversion."""
    block_size, h = kv_cache.shape[2], kv_cache.shape[1]
    c = kv_cache.shape[-1]
    d = c // 2
    n_blocks = -(-length // block_size)
    if kv_cache.device.type != "cpu" or n_blocks == 0:
        k, v = gather_prefix(kv_cache, block_table_row, length)
        return k.to(dtype), v.to(dtype)
    runs = _block_runs(block_table_row, n_blocks)
    buf = _scratch_buffer(h * n_blocks * block_size * c, dtype, kv_cache.device)
    buf = buf.view(h, n_blocks, block_size, c)
    table = block_table_row[:n_blocks]
    if isinstance(kv_cache, PackedPages):
        # K and V from their own views (K transposed per page): two transposing, converting copies
        _copy_blocks(buf[..., :d], kv_cache.k, table, runs, (1, 0, 2, 3), 1)
        _copy_blocks(buf[..., d:], kv_cache.v, table, runs, (1, 0, 2, 3), 1)
    else:
        _copy_blocks(buf, kv_cache, table, runs, (1, 0, 2, 3), 1)
    kv = buf.view(h, n_blocks * block_size, c)[:, :length]
    return kv[..., :d], kv[..., d:]


def gather_prefix_kt_into(kv_cache, block_table_row: torch.Tensor, length: int,
                          dtype: torch.dtype, *, values: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One request's positions ``[0, length)`` converted to ``dtype`` into persistent scratch
    buffers (valid until the next call), laid out for two contiguous matmuls: K transposed
    ``[H, D, length]`` (``q @ K^T`` per head) and V ``[H, length, D]`` (None unless ``values``). Whole blocks are copied, as
    runs of consecutive block ids (one gather when fragmented); on ``CPU_ATTN``'s packed pages (K already transposed per page)
    every copy moves rows of ``block_size`` contiguous elements. CPU only."""
    block_size, h = kv_cache.shape[2], kv_cache.shape[1]
    d = kv_cache.shape[-1] // 2
    n_blocks = -(-length // block_size)
    k_all, v_all = split_kv(kv_cache)                                   # [B, H, N, D] views
    span = n_blocks * block_size
    kt = _scratch_buffer(h * d * span, dtype, kv_cache.device, tag="kt").view(h, d, n_blocks, block_size)
    v = _scratch_buffer(h * span * d, dtype, kv_cache.device, tag="v").view(h, n_blocks, block_size, d)
    runs, table = _block_runs(block_table_row, n_blocks), block_table_row[:n_blocks]
    _copy_blocks(kt, k_all, table, runs, (1, 3, 0, 2), 2)
    if not values:
        return kt.view(h, d, span)[:, :, :length], None
    _copy_blocks(v, v_all, table, runs, (1, 0, 2, 3), 1)
    return kt.view(h, d, span)[:, :, :length], v.view(h, span, d)[:, :length]


def dense_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          query_start_loc: list[int], seq_lens: list[int], scale: float,
                          output: torch.Tensor, *, sliding_window: int | None = None,
                          k_scale: torch.Tensor | float | None = None,
                          v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Causal attention of each request's queries over its whole paged history.

    ``query_start_loc`` (``num_reqs + 1``) and ``seq_lens`` (``num_reqs``, the current queries
    included) are host lists. Request ``i``'s queries sit at positions
    ``seq_lens[i] - q_len .. seq_lens[i] - 1``. Rows with no query (padding) are skipped; the output
    rows of padded tokens beyond ``query_start_loc[-1]`` are left as they are.

    Computed by PyTorch's fused CPU attention (``scaled_dot_product_attention``; 6-7x faster than
    the einsum form of :func:`attention_over` at 2K-8K prefill on a 2-core CPU) in fp32:

    - a decode row (one query): the GQA group's query heads as query rows of their KV head, no mask;
    - a request whose queries are its whole sequence: the kernel's own causal mask;
    - a chunk after a cached prefix: the prefix (no mask, group heads as query rows) and the chunk's
      own keys (causal) as two flash passes merged by their log-sum-exp, which skips the masked
      half of the chunk's square and the mask reads (1.3x faster than one pass with an explicit
      bottom-right mask for a 2K chunk at 8K); the explicit mask where that kernel is missing.

    fp8 pages: ``k_scale`` folded into ``scale``, ``v_scale`` into the output (CPU scales, read on
    the host).
    """
    import torch.nn.functional as F

    hq, d = query.shape[1], query.shape[2]
    vs = kv_quant.host_scale(kv_cache.dtype, v_scale)
    scale = scale * kv_quant.host_scale(kv_cache.dtype, k_scale)
    for i, seq_len in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        if qe <= qs or seq_len <= 0:
            continue
        n_q = qe - qs
        k, v = gather_prefix_into(kv_cache, block_table[i], seq_len, torch.float32)
        hkv = k.shape[0]
        g = hq // hkv
        if sliding_window is None and n_q == 1:
            q = query[qs].float().view(1, hkv, g, d)                               # [1, Hkv, G, D]
            out = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0), scale=scale)
            output[qs] = _times(out[0], vs).reshape(hq, d).to(output.dtype)
            continue
        q = query[qs:qe].float().transpose(0, 1).unsqueeze(0)               # [1, Hq, n_q, D]
        mask, causal = None, False
        if sliding_window is not None:
            kpos = torch.arange(seq_len, device=query.device)
            qpos = kpos[seq_len - n_q:]
            mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - sliding_window)
        elif n_q == seq_len:
            causal = True
        else:
            out = _prefix_chunk_attention(q, k, v, seq_len - n_q, scale)
            if out is not None:
                output[qs:qe] = _times(out, vs).to(output.dtype)
                continue
            kpos = torch.arange(seq_len, device=query.device)
            mask = kpos[None, :] <= kpos[seq_len - n_q:, None]
        out = F.scaled_dot_product_attention(q, k.unsqueeze(0), v.unsqueeze(0),
                                             attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=True)
        output[qs:qe] = _times(out[0].transpose(0, 1), vs).to(output.dtype)
    return output


def _times(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


def _prefix_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int,
                            scale: float) -> torch.Tensor | None:
    """Queries ``q`` ``[1, Hq, n, D]`` fp32 at positions ``ctx .. ctx + n - 1`` over keys ``k``/``v``
    ``[Hkv, ctx + n, D]`` fp32, causal -> ``[n, Hq, D]`` fp32: the prefix ``[0, ctx)`` in one flash pass
    without a mask (the GQA group's query heads stacked as query rows of their KV head), the chunk's
    own keys in one causal flash pass, merged by their log-sum-exp. ``None`` where PyTorch lacks
    the CPU flash kernel (the caller then masks)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.device.type != "cpu":
        return None
    _, hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    # prefix: [1, Hkv, G * n, D] query rows (head h's group, query-major within each head)
    qp = q.reshape(1, hkv, g * n, d)
    o1, l1 = flash(qp, k[None, :, :ctx], v[None, :, :ctx], 0.0, False, scale=scale)
    o1, l1 = o1.reshape(1, hq, n, d), l1.reshape(1, hq, n)
    kc, vc = k[None, :, ctx:], v[None, :, ctx:]
    if g > 1:
        kc = kc[:, :, None].expand(1, hkv, g, n, d).reshape(1, hq, n, d)
        vc = vc[:, :, None].expand(1, hkv, g, n, d).reshape(1, hq, n, d)
    o2, l2 = flash(q, kc, vc, 0.0, True, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    return out[0].transpose(0, 1)
