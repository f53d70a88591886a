"""Shared helpers of the kernel tests: random paged caches in vLLM's layouts, SFI row layouts,
tolerances and dense-mask references built on ``vllm_ext.kernels.paged_reference``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_ext.kernels.paged_reference import attention_over, gather_kv

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
SENTINEL = 123.0

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (atol, rtol) of a kernel's output vs the fp32 reference computed from the same (rounded) inputs.
# On CUDA half-precision kernels use tensor-core dots with P rounded to the KV dtype, and the output
# itself is rounded to the dtype.
OUT_TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2e-2)}
# log-evidence is computed from fp32 scores (exact products of the rounded inputs): tight everywhere.
EVIDENCE_ATOL = 2e-3

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def make_kv_cache(layout: str, num_blocks: int, hkv: int, bs: int, d: int, dtype: torch.dtype,
                  device=DEVICE, gen: torch.Generator | None = None) -> torch.Tensor:
    """vLLM's logical view ``[num_blocks, Hkv, block_size, 2D]`` with the layout's strides.

    ``LBNHC``: physical ``[B, N, H, C]`` (vLLM's default "NHD"), viewed transposed;
    ``LBHNC``: physical ``[B, H, N, C]`` (contiguous "HND")."""
    if layout == "LBNHC":
        phys = torch.randn(num_blocks, bs, hkv, 2 * d, generator=gen)
        kv = phys.to(dtype).to(device).transpose(1, 2)
        assert not kv.is_contiguous()
    elif layout == "LBHNC":
        kv = torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype).to(device)
    else:
        raise ValueError(layout)
    return kv


def make_block_table(seq_lens: list[int], bs: int, max_blocks: int, num_blocks: int,
                     gen: torch.Generator) -> torch.Tensor:
    """Distinct random blocks for every row's used blocks; unused columns hold random ids too."""
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // bs)
        bt[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    assert used <= num_blocks
    return bt


def blocks_needed(seq_lens: list[int], bs: int) -> int:
    return sum(-(-n // bs) for n in seq_lens)


@dataclass
class SfiRows:
    """A batch of rows in the SFI fast-step layout plus its explicit index sets."""
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    recent_start: torch.Tensor
    compact_kv: torch.Tensor
    compact_len: torch.Tensor
    slot_idx: torch.Tensor
    row_mask: torch.Tensor
    selected: torch.Tensor          # [R, Hkv, K] int32, -1 padded
    n_sel: torch.Tensor             # [R] int32
    n_sink: int
    index_sets: list                # per row: list over KV heads of sorted position lists (or None)
    scale: float


def make_sfi_rows(*, seq_lens: list[int], active: list[bool], g: int, hkv: int, d: int, bs: int,
                  dtype: torch.dtype, layout: str, n_sink: int = 4, n_recent: int = 20, k: int = 12,
                  seed: int = 0, build_compact: bool = True, extra_slots: int = 2) -> SfiRows:
    """Random rows: sink ``[0, ns)``, recent ``[max(ns, L - n_recent), L)``, per-head selection of
    ``min(k, |A|)`` distinct positions of ``A = [ns, recent_start)`` (different per head).
    When ``build_compact``, the compact segment is filled by direct indexing (the reference), with
    garbage (large values) past ``compact_len`` so over-reads show."""
    gen = torch.Generator().manual_seed(seed)
    r = len(seq_lens)
    hq = g * hkv
    max_blocks = max(1, max(-(-n // bs) for n in seq_lens) + 1)
    num_blocks = blocks_needed(seq_lens, bs) + 3
    kv = make_kv_cache(layout, num_blocks, hkv, bs, d, dtype, gen=gen)
    bt = make_block_table(seq_lens, bs, max_blocks, num_blocks, gen).to(DEVICE)
    q = torch.randn(r, hq, d, generator=gen).to(dtype).to(DEVICE)
    cap = n_sink + k + 3
    num_slots = r + extra_slots
    ckv = torch.full((num_slots, hkv, cap, 2 * d), 50.0).to(dtype).to(DEVICE)
    clen = torch.randint(0, cap + 1, (num_slots,), generator=gen, dtype=torch.int32)
    slot_perm = torch.randperm(num_slots, generator=gen)[:r].to(torch.int32)
    sel = torch.full((r, hkv, k), -1, dtype=torch.int32)
    n_sel = torch.zeros(r, dtype=torch.int32)
    rstart = torch.zeros(r, dtype=torch.int32)
    index_sets = []
    for i, L in enumerate(seq_lens):
        ns = min(n_sink, L)
        rs = max(ns, L - n_recent)
        rstart[i] = rs
        allowed = list(range(ns, rs))
        m = min(k, len(allowed))
        n_sel[i] = m
        sets = []
        for h in range(hkv):
            if m:
                pick = torch.randperm(len(allowed), generator=gen)[:m]
                chosen = [allowed[j] for j in pick.tolist()]
            else:
                chosen = []
            sel[i, h, :m] = torch.tensor(chosen, dtype=torch.int32)
            sets.append(sorted(set(range(ns)) | set(chosen) | set(range(rs, L))))
            if build_compact and L > 0:
                s = int(slot_perm[i])
                pos = torch.tensor(list(range(ns)) + chosen, dtype=torch.long, device=DEVICE)
                if len(pos):
                    kk, vv = gather_kv(kv, bt[i], pos)
                    ckv[s, h, :len(pos)] = torch.cat([kk[h], vv[h]], dim=-1)
        if build_compact and L > 0:
            clen[slot_perm[i]] = ns + m
        index_sets.append(sets if active[i] and L > 0 else None)
    return SfiRows(q, kv, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                   rstart.to(DEVICE), ckv, clen.to(DEVICE), slot_perm.to(DEVICE),
                   torch.tensor(active, dtype=torch.bool, device=DEVICE), sel.to(DEVICE),
                   n_sel.to(DEVICE), n_sink, index_sets, 1.0 / math.sqrt(d))


def page_compact(compact_kv: torch.Tensor, block_size: int, seed: int = 0,
                 garbage: float = 50.0, state_columns: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous compact segments ``[S, Hkv, C, 2D]`` in the paged layout SFI's KV-cache group
    gives them (``kernels.two_segment_decode``, module doc): ``(pages [B, Hkv, block_size, 2D],
    table [S, ceil(C / block_size)] int32)``, the slots' blocks scattered over the pool in random
    order, block 0 (vLLM's null block) and spare blocks left with garbage. As inside vLLM, the table
    is the leading columns of a wider per-slot row whose other ``state_columns`` blocks hold SFI's
    other per-request state (``vllm_ext.methods.sfi.state_pages``: kept positions, prompt-tail queries),
    here garbage: a view whose row stride is not its width."""
    gen = torch.Generator().manual_seed(seed)
    s, hkv, cap, c2 = compact_kv.shape
    n_c = -(-cap // block_size)
    width = n_c + state_columns
    num_blocks = s * width + 3
    pages = torch.full((num_blocks, hkv, block_size, c2), garbage).to(compact_kv.dtype).to(compact_kv.device)
    ids = (torch.randperm(num_blocks - 1, generator=gen)[:s * width] + 1).to(torch.int32)
    table = ids.view(s, width).to(compact_kv.device)[:, :n_c]
    padded = torch.full((s, hkv, n_c * block_size, c2), garbage).to(compact_kv.dtype).to(compact_kv.device)
    padded[:, :, :cap] = compact_kv
    pages[table.long()] = padded.view(s, hkv, n_c, block_size, c2).transpose(1, 2)
    return pages, table


def unpage_compact(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`page_compact`: ``[S, Hkv, n_c * block_size, 2D]``."""
    s, n_c = table.shape
    blocks = pages[table.long()]                                   # [S, n_c, Hkv, bs, 2D]
    return blocks.transpose(1, 2).reshape(s, pages.shape[1], n_c * pages.shape[2], pages.shape[3])


def reference_sparse_attention(rows: SfiRows) -> list:
    """Per active row: fp32 attention of every query head over ``S ∪ M_h ∪ R`` of its KV head,
    via a dense ``[1, Hq, L]`` visibility mask over all positions (paged_reference)."""
    out = []
    hkv = rows.kv_cache.shape[1]
    hq = rows.query.shape[1]
    g = hq // hkv
    for i, sets in enumerate(rows.index_sets):
        if sets is None:
            out.append(None)
            continue
        L = int(rows.seq_lens[i])
        k, v = gather_kv(rows.kv_cache, rows.block_table[i], torch.arange(L, device=DEVICE))
        mask = torch.zeros(1, hq, L, dtype=torch.bool, device=DEVICE)
        for h in range(hkv):
            idx = torch.tensor(sets[h], dtype=torch.long, device=DEVICE)
            mask[0, h * g:(h + 1) * g, idx] = True
        o, _ = attention_over(rows.query[i:i + 1], k, v, rows.scale, mask)
        out.append(o[0])
    return out


def reference_dense_attention(query, kv_cache, block_table, seq_lens, scale) -> list:
    out = []
    for i in range(query.shape[0]):
        L = int(seq_lens[i])
        if L <= 0:
            out.append(None)
            continue
        k, v = gather_kv(kv_cache, block_table[i], torch.arange(L, device=query.device))
        o, _ = attention_over(query[i:i + 1], k, v, scale)
        out.append(o[0])
    return out


def reference_evidence(query_rows: torch.Tensor, kv_cache, block_table_row, lo: int, hi: int,
                       max_len: int, scale: float, alpha: float,
                       query_positions: list[int] | None = None) -> torch.Tensor:
    """float64 evidence of one request: ``query_rows [W, Hq, D]`` -> ``[Hkv, max_len]``.

    ``A = [lo, hi)`` (already clamped by the caller); query ``w`` sees ``j <= query_positions[w]``
    (all of A when None); queries with position < 0 are not pooled."""
    w, hq, d = query_rows.shape
    hkv = kv_cache.shape[1]
    g = hq // hkv
    ev = torch.full((hkv, max_len), float("-inf"), dtype=torch.float64)
    if hi <= lo:
        return ev
    pos = torch.arange(lo, hi, device=kv_cache.device)
    k, _ = gather_kv(kv_cache, block_table_row, pos)
    k = k.double().cpu()
    qs = query_rows.double().cpu().reshape(w, hkv, g, d)
    qpos = query_positions if query_positions is not None else [hi] * w
    for h in range(hkv):
        logps = []
        for wi in range(w):
            if qpos[wi] < 0:
                continue
            vis = pos.cpu() <= qpos[wi]
            for gi in range(g):
                s = (k[h] @ qs[wi, h, gi]) * scale
                s = s.masked_fill(~vis, float("-inf"))
                logps.append(s - torch.logsumexp(s, 0))
        lp = torch.stack(logps)                                   # [n, |A|]
        n = lp.shape[0]
        if alpha == 0.0:
            lf = lp.mean(0)
        else:
            lf = (torch.logsumexp(alpha * lp, 0) - math.log(n)) / alpha
        ev[h, lo:hi] = lf
    return ev


def assert_close_out(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what=""):
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def assert_evidence_close(actual: torch.Tensor, expected: torch.Tensor, atol=EVIDENCE_ATOL, what=""):
    a = actual.double().cpu()
    e = expected.double().cpu()
    ainf = torch.isinf(a) & (a < 0)
    einf = torch.isinf(e) & (e < 0)
    assert torch.equal(ainf, einf), f"{what}: -inf pattern differs at {(ainf != einf).nonzero()[:8].tolist()}"
    assert not torch.isnan(a).any(), f"{what}: NaN in evidence"
    fin = ~einf
    if fin.any():
        torch.testing.assert_close(a[fin], e[fin], atol=atol, rtol=1e-3, msg=lambda m: f"{what}: {m}")


# The default (fast) grid: every value of each parameter appears at least once; ``FULL_GRID`` is the
# Cartesian product, run on CUDA only. Fields: (G, head_size, block_size, layout, dtype name).
FAST_CASES = [
    (1, 64, 16, "LBNHC", "fp32"),
    (4, 128, 32, "LBHNC", "bf16"),
    (8, 64, 32, "LBNHC", "fp16"),
    (4, 64, 16, "LBHNC", "fp32"),
    (8, 128, 16, "LBHNC", "bf16"),
    (1, 128, 32, "LBNHC", "fp16"),
    (4, 64, 16, "LBNHC", "bf16"),
]
FULL_GRID = [(g, d, bs, lay, dt) for g in (1, 4, 8) for d in (64, 128) for bs in (16, 32)
             for lay in ("LBNHC", "LBHNC") for dt in ("fp32", "fp16", "bf16")]


# fp8 pages (``vllm_ext.kernels.kv_quant``): both formats, scales below and above 1, queries in a
# half type and in fp32. Fields: (fp8 format, k_scale, v_scale, query dtype name).
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_CASES = [("e4m3", 0.5, 3.0, "bf16"), ("e5m2", 3.0, 0.5, "fp32")]


def fp8_case_id(case) -> str:
    fmt, ks, vs, qdt = case
    return f"{fmt}-k{ks}-v{vs}-q{qdt}"


def fp8_scales(k_scale: float, v_scale: float, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's scales as vLLM keeps them: fp32 device tensors, here one of shape ``[1]`` and one
    of shape ``[]`` (both occur)."""
    return (torch.tensor([k_scale], dtype=torch.float32, device=device),
            torch.tensor(v_scale, dtype=torch.float32, device=device))


def quantize_pages(pages: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """``[..., 2D]`` K|V entries stored as fp8 (``value / scale``, saturated), the strides kept."""
    d = pages.shape[-1] // 2
    fmax = torch.finfo(dtype).max
    out = torch.empty_like(pages, dtype=dtype)
    out[..., :d] = (pages[..., :d].float() / k_scale).clamp(-fmax, fmax).to(dtype)
    out[..., d:] = (pages[..., d:].float() / v_scale).clamp(-fmax, fmax).to(dtype)
    return out


def dequantize_pages(pages: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """The explicit dequantisation of :func:`quantize_pages`' result: fp32, the strides kept."""
    d = pages.shape[-1] // 2
    out = torch.empty_like(pages, dtype=torch.float32)
    out[..., :d] = pages[..., :d].float() * k_scale
    out[..., d:] = pages[..., d:].float() * v_scale
    return out


def fp8_rows(rows: "SfiRows", dtype: torch.dtype, k_scale: float, v_scale: float,
             query_dtype: torch.dtype) -> tuple["SfiRows", "SfiRows"]:
    """``rows`` on fp8 pages (the cache and the compact segment quantised with the same scales, as
    the gather copies stored bytes) and the reference rows: those pages dequantised to fp32."""
    import dataclasses

    q = rows.query.to(query_dtype)
    kv8 = quantize_pages(rows.kv_cache, dtype, k_scale, v_scale)
    ckv8 = quantize_pages(rows.compact_kv, dtype, k_scale, v_scale)
    r8 = dataclasses.replace(rows, query=q, kv_cache=kv8, compact_kv=ckv8)
    ref = dataclasses.replace(rows, query=q, kv_cache=dequantize_pages(kv8, k_scale, v_scale),
                              compact_kv=dequantize_pages(ckv8, k_scale, v_scale))
    return r8, ref


def case_id(case) -> str:
    g, d, bs, lay, dt = case
    return f"G{g}-D{d}-bs{bs}-{lay}-{dt}"


def row_lengths(bs: int) -> tuple[list[int], list[bool]]:
    """Lengths 1, block boundary -1/0/+1, a few blocks, longer; then two padded rows: one masked
    out (row_mask 0, real data) and one with seq_len 0."""
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 101, 2 * bs, 0]
    act = [True, True, True, True, True, True, False, True]
    return lens, act
