"""Shared builders for the CritiPrefill tests: paged caches, batches and an independent dense-mask reference."""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.kernels.paged_reference import attention_over, gather_kv


@dataclasses.dataclass
class Batch:
    query: torch.Tensor          # [T, Hq, D]
    kv_cache: torch.Tensor       # [pages, Hkv, page, 2D] (logical view, layout-dependent strides)
    block_table: torch.Tensor    # int32 [R, max_pages]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: list[int]
    seq_list: list[int]
    keys: list[torch.Tensor]     # per request [seq, Hkv, D] (cache dtype)
    values: list[torch.Tensor]


def make_cache(num_pages: int, hkv: int, page: int, d: int, dtype, layout: str, device="cpu"):
    if layout == "NHD":        # physical [B, N, H, 2D], logical view [B, H, N, 2D]
        return torch.zeros(num_pages, page, hkv, 2 * d, dtype=dtype, device=device).transpose(1, 2)
    if layout == "HND":        # physical [B, H, N, 2D] contiguous
        return torch.zeros(num_pages, hkv, page, 2 * d, dtype=dtype, device=device)
    raise ValueError(layout)


def make_batch(seq_lens: list[int], q_lens: list[int], *, hq: int, hkv: int, d: int, page: int,
               dtype=torch.float32, layout: str = "NHD", seed: int = 0, device="cpu",
               extra_pages: int = 3, pad_tokens: int = 0, key_bias: bool = True) -> Batch:
    """Random requests in a shuffled paged cache; the chunk's queries are the last ``q_len`` positions.

    ``pad_tokens`` extra query rows after the last request (vLLM pads the batch) hold garbage.
    ``key_bias`` adds a per-block offset so that criticality differs between blocks.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-s // page) for s in seq_lens]
    total = sum(pages_per) + extra_pages
    perm = torch.randperm(total, generator=g).tolist()
    max_pages = max(pages_per) + 1
    bt = torch.full((len(seq_lens), max_pages), 10_000, dtype=torch.int32)   # junk beyond the used pages
    kv = make_cache(total, hkv, page, d, dtype, layout)
    kv.copy_(torch.randn(kv.shape, generator=g).to(dtype) * 7.0)   # junk in unused slots
    qs, keys, values = [], [], []
    used = 0
    for i, (s, ql) in enumerate(zip(seq_lens, q_lens)):
        pages = perm[used:used + pages_per[i]]
        used += pages_per[i]
        bt[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(s, hkv, d, generator=g)
        if key_bias:
            k = k + 0.5 * torch.randn(-(-s // 16), hkv, d, generator=g).repeat_interleave(16, 0)[:s]
        v = torch.randn(s, hkv, d, generator=g)
        k, v = k.to(dtype), v.to(dtype)
        for n, pg in enumerate(pages):          # page by page (write_kv's scatter is slow on CPU views)
            a, e = n * page, min(s, (n + 1) * page)
            kv[pg, :, :e - a, :d] = k[a:e].transpose(0, 1)
            kv[pg, :, :e - a, d:] = v[a:e].transpose(0, 1)
        keys.append(k)
        values.append(v)
        qs.append(torch.randn(ql, hq, d, generator=g).to(dtype))
    if pad_tokens:
        qs.append(torch.randn(pad_tokens, hq, d, generator=g).to(dtype))
    query = torch.cat(qs) if qs else torch.empty(0, hq, d, dtype=dtype)
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
    dev = torch.device(device)
    return Batch(query=query.to(dev), kv_cache=kv.to(dev) if dev.type != "cpu" else kv,
                 block_table=bt.to(dev), query_start_loc=qsl.to(dev),
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), q_lens=list(q_lens),
                 seq_list=list(seq_lens), keys=keys, values=values)


def cfg(**kw) -> CritiPrefillConfig:
    base = dict(enabled=True, segment_size=64, block_size=32, budget=64, min_len=0, dense_layers=(0,))
    base.update(kw)
    return CritiPrefillConfig(**base)


def visible_mask_reference(plan, b: Batch, i: int, hq: int) -> torch.Tensor:
    """Independent visible set of request ``i``'s chunk: ``[q_len, Hq, seq_len]`` bool built from python sets."""
    seq, ql = b.seq_list[i], b.q_lens[i]
    ctx = seq - ql
    hkv = b.kv_cache.shape[1]
    g = hq // hkv
    sq, bk = plan.segment_size, plan.block_size
    first = ctx // sq
    sel = plan.sel_blocks[i].cpu().tolist()
    dense = plan.dense[i].cpu().tolist()
    mask = torch.zeros(ql, hq, seq, dtype=torch.bool)
    for qi in range(ql):
        p = ctx + qi
        j = p // sq
        s_local = j - first
        s0 = j * sq
        for h in range(hkv):
            if dense[s_local]:
                vis = set(range(0, s0))
            else:
                blocks = {x for x in sel[s_local][h] if x >= 0}
                assert all(x * bk < s0 for x in blocks)
                vis = {x for x in range(s0) if x // bk in blocks}
            vis |= set(range(s0, p + 1))
            idx = torch.tensor(sorted(vis), dtype=torch.long)
            mask[qi, h * g:(h + 1) * g, idx] = True
    return mask


def reference_output(plan, b: Batch, scale: float) -> torch.Tensor:
    """fp32 attention over the explicit visible sets (``attention_over`` + ``gather_kv``)."""
    hq = b.query.shape[1]
    out = torch.zeros(b.query.shape, dtype=torch.float32)
    qsl = b.query_start_loc.cpu().tolist()
    kv = b.kv_cache.cpu()
    bt = b.block_table.cpu()
    q = b.query.cpu()
    for i, seq in enumerate(b.seq_list):
        if b.q_lens[i] == 0:
            continue
        k, v = gather_kv(kv, bt[i], torch.arange(seq))
        mask = visible_mask_reference(plan, b, i, hq)
        o, _ = attention_over(q[qsl[i]:qsl[i + 1]], k, v, scale, mask)
        out[qsl[i]:qsl[i + 1]] = o
    return out


def fp8_batch(b: Batch, dtype: torch.dtype, k_scale: float, v_scale: float,
              query_dtype: torch.dtype) -> tuple[Batch, Batch]:
    """``b`` on fp8 pages (K stored as ``K / k_scale``, V as ``V / v_scale``, saturated: vLLM's write;
    the strides kept) with its query in ``query_dtype``, and the reference batch: the same stored
    values dequantised to fp32 (the cache every reader of the fp8 pages must behave as)."""
    from vllm_ext.kernels.kv_quant import quantize

    d = b.kv_cache.shape[-1] // 2
    kv8 = torch.empty_like(b.kv_cache, dtype=dtype)
    kv8[..., :d] = quantize(b.kv_cache[..., :d], k_scale, dtype)
    kv8[..., d:] = quantize(b.kv_cache[..., d:], v_scale, dtype)
    deq = torch.empty_like(b.kv_cache, dtype=torch.float32)
    deq[..., :d] = kv8[..., :d].float() * k_scale
    deq[..., d:] = kv8[..., d:].float() * v_scale
    q = b.query.to(query_dtype)
    return (dataclasses.replace(b, query=q, kv_cache=kv8),
            dataclasses.replace(b, query=q, kv_cache=deq))
