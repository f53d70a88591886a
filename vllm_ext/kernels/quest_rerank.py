"""Group attention mass of Quest's candidate tokens (``sfi.quest_rerank``; ours, not in Quest).

Quest ranks pages by an upper bound of ``q.k`` (:mod:`vllm_ext.kernels.quest_pages`), and the bound
can be loose: on the quality models the page holding the key that takes 0.83 of a head's attention
ranks 20th of 262 by its bound (23.1 against the key's logit 17.9), while Quest beside a kept set of
192 holds 16 pages (bench/QUALITY.md, "Exact scores of the Quest candidates"). With ``quest_rerank`` r > 0 a selection row takes the tokens of its best
pages by bound, ``r`` times its budget, as candidates, and this module replaces the row's evidence
by each candidate's exact share of the GQA group's attention over the candidates:

    score(j) = log sum_g exp(s_gj - lse_g),   s_gj = scale * q_g . k_j,   lse_g = log sum_{i in cand} exp(s_gi)

(``-inf`` at every other position). The selector then keeps the candidates with the largest group
mass, token granular: the set that holds the most of the group's attention among the candidates.
Normalising per query head lets a head that spreads its attention keep its tokens beside a head
that concentrates it (on the quality models, ranking by the max logit over the group instead loses
multi-value answers that depend on such a head). It reads K of the candidates only (``r * budget``
keys, the K half of each KV row).

Public function (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
signature):

``quest_candidate_evidence(query, kv_cache, block_table, rows, cand, n_cand, hi, scale, out, *, count=None, workspace=None, k_scale=None)``
    ``query``: ``[R, Hq, D]`` (one decode query per row); ``kv_cache``: vLLM's
    ``[num_blocks, Hkv, block_size, 2*D]`` view (any strides); ``block_table``: int32 ``[>= S, max_blocks]``,
    the block-table row of each entry; ``rows``: int32 ``[S]``, the query row of each entry (``-1`` =
    unused entry); ``cand``: int32 ``[>= S, Hkv, W]`` candidate positions per entry and KV head
    (``-1`` pads); ``n_cand``: int32 ``[>= S]``, how many leading entries of ``cand`` count (the
    selector's ``n_sel``); ``hi``: int32 ``[S]``, the end of each entry's allowed set; ``out``: fp32
    ``[>= S, Hkv, L]``, the selector's 3-dim pooled log evidence. For every live entry ``e`` it writes
    ``-inf`` to ``out[e, h, j]`` for ``j`` in ``[0, min(hi, L))``, then ``score(j)`` at each counted
    candidate. Unused entries (``rows < 0``, or ``e >= count[0]`` with ``count``) touch nothing.
    ``workspace``: :func:`quest_rerank_workspace` (the Triton path's logits and partial sums; allocated
    per call without it). ``k_scale``: the layer's, for fp8 pages (``kernels.kv_quant``), folded into
    the score scale. Fixed grids, no host sync, no allocation with a workspace: a CUDA graph can
    capture it.

Imports neither vLLM nor CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _live(ROWS, COUNT, e, HAS_COUNT: tl.constexpr):
        live = tl.load(ROWS + e) >= 0
        if HAS_COUNT:
            live = live & (e < tl.load(COUNT))
        return live

    @triton.jit
    def _fill_kernel(ROWS, HI, COUNT, OUT, s_o_e, s_o_h, s_o_l, L,
                     BLOCK: tl.constexpr, HAS_COUNT: tl.constexpr):
        e = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        hi = tl.minimum(tl.load(HI + e), L)
        if _live(ROWS, COUNT, e, HAS_COUNT) & (tile * BLOCK < hi):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            tl.store(OUT + e.to(tl.int64) * s_o_e + h.to(tl.int64) * s_o_h + offs.to(tl.int64) * s_o_l,
                     tl.full([BLOCK], float("-inf"), tl.float32), mask=offs < hi)

    @triton.jit
    def _logits_kernel(Q, KV, BT, ROWS, CAND, NCAND, COUNT, LOGITS, PART, KS,
                       s_q_r, s_q_h, s_q_d,
                       s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                       s_bt_r, s_bt_b,
                       s_c_e, s_c_h, s_c_w,
                       s_lg_e, s_lg_h, s_lg_w,
                       s_p_e, s_p_h, s_p_t,
                       scale, L, W,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       PAGE: tl.constexpr, BLOCK_C: tl.constexpr, HAS_COUNT: tl.constexpr,
                       KV_SCALED: tl.constexpr):
        """Per candidate tile: the logits of the group's query heads (to LOGITS) and each head's
        partial (max, sum of exp) over the tile (to PART)."""
        e = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        n = tl.minimum(tl.load(NCAND + e), W)
        if _live(ROWS, COUNT, e, HAS_COUNT) & (tile * BLOCK_C < n):
            if KV_SCALED:
                scale = scale * tl.load(KS)
            row = tl.load(ROWS + e).to(tl.int64)
            i = tile * BLOCK_C + tl.arange(0, BLOCK_C)
            pos = tl.load(CAND + e.to(tl.int64) * s_c_e + h.to(tl.int64) * s_c_h + i * s_c_w,
                          mask=i < n, other=-1)
            valid = (i < n) & (pos >= 0) & (pos < L)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            gm = offs_g < G
            dm = offs_d < D
            qh = h * G + offs_g
            q = tl.load(Q + row * s_q_r + qh[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                        mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)        # [G, D]
            blk = tl.load(BT + e.to(tl.int64) * s_bt_r + (pos // PAGE) * s_bt_b, mask=valid, other=0)
            off = blk.to(tl.int64) * s_kv_b + h.to(tl.int64) * s_kv_h + (pos % PAGE).to(tl.int64) * s_kv_n
            k = tl.load(KV + off[:, None] + offs_d[None, :] * s_kv_c, mask=valid[:, None] & dm[None, :],
                        other=0.0).to(tl.float32)                                        # [C, D]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                    # [G, C]
            s = tl.where(valid[None, :], s, float("-inf"))
            tl.store(LOGITS + e.to(tl.int64) * s_lg_e + qh[:, None].to(tl.int64) * s_lg_h
                     + i[None, :].to(tl.int64) * s_lg_w, s, mask=gm[:, None] & (i < n)[None, :])
            m = tl.max(s, axis=1)                                                        # [G]
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l_sum = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            pbase = PART + e.to(tl.int64) * s_p_e + qh.to(tl.int64) * s_p_h + tile * s_p_t
            tl.store(pbase, m, mask=gm)
            tl.store(pbase + 1, l_sum, mask=gm)

    @triton.jit
    def _mass_kernel(ROWS, CAND, NCAND, COUNT, LOGITS, PART, OUT,
                     s_c_e, s_c_h, s_c_w,
                     s_lg_e, s_lg_h, s_lg_w,
                     s_p_e, s_p_h, s_p_t,
                     s_o_e, s_o_h, s_o_l,
                     L, W,
                     G: tl.constexpr, G_PAD: tl.constexpr, T_PAD: tl.constexpr,
                     BLOCK_C: tl.constexpr, HAS_COUNT: tl.constexpr):
        """Per candidate tile: ``log sum_g exp(s_gj - lse_g)``, each ``lse_g`` merged from the
        partials of every tile of the entry and head, written at the candidate's position."""
        e = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        n = tl.minimum(tl.load(NCAND + e), W)
        if _live(ROWS, COUNT, e, HAS_COUNT) & (tile * BLOCK_C < n):
            offs_g = tl.arange(0, G_PAD)
            gm = offs_g < G
            qh = h * G + offs_g
            offs_t = tl.arange(0, T_PAD)
            n_tiles = (n + BLOCK_C - 1) // BLOCK_C
            tm = offs_t < n_tiles
            pbase = PART + e.to(tl.int64) * s_p_e + qh[:, None].to(tl.int64) * s_p_h + offs_t[None, :] * s_p_t
            pm = gm[:, None] & tm[None, :]
            m_t = tl.load(pbase, mask=pm, other=float("-inf"))                           # [G, T]
            l_t = tl.load(pbase + 1, mask=pm, other=0.0)
            m = tl.max(m_t, axis=1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l_sum = tl.sum(tl.where(m_t == float("-inf"), 0.0, l_t * tl.exp(m_t - m_safe[:, None])), axis=1)
            lse = m_safe + tl.log(tl.where(l_sum > 0, l_sum, 1.0))                         # [G]
            i = tile * BLOCK_C + tl.arange(0, BLOCK_C)
            im = i < n
            s = tl.load(LOGITS + e.to(tl.int64) * s_lg_e + qh[:, None].to(tl.int64) * s_lg_h
                        + i[None, :].to(tl.int64) * s_lg_w, mask=gm[:, None] & im[None, :],
                        other=float("-inf"))                                             # [G, C]
            lp = s - lse[:, None]
            mx = tl.max(lp, axis=0)
            mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
            score = mx_safe + tl.log(tl.sum(tl.exp(lp - mx_safe[None, :]), axis=0))
            score = tl.where(mx == float("-inf"), float("-inf"), score)
            pos = tl.load(CAND + e.to(tl.int64) * s_c_e + h.to(tl.int64) * s_c_h + i * s_c_w,
                          mask=im, other=-1)
            valid = im & (pos >= 0) & (pos < L)
            tl.store(OUT + e.to(tl.int64) * s_o_e + h.to(tl.int64) * s_o_h + pos.to(tl.int64) * s_o_l,
                     score, mask=valid)


def candidate_tile(g: int, d: int) -> int:
    """Candidates per program of the Triton kernels: keeps the ``[G, C, D]`` products near 8K elements."""
    block_c = max(1, min(64, 8192 // (max(1, next_pow2(g)) * max(16, next_pow2(d)))))
    return 1 << (block_c.bit_length() - 1)


@dataclass
class QuestRerankWorkspace:
    """Persistent buffers of the Triton path for at most ``rows`` entries, ``num_heads`` query heads
    and ``width`` candidates: ``logits [rows, Hq, width]`` fp32 and ``partials
    [rows, Hq, ceil(width / C), 2]`` fp32 (per tile: max and sum of exp). Bytes: about
    ``4 * rows * Hq * width * (1 + 2 / C)``."""

    rows: int
    num_heads: int
    width: int
    tile: int
    logits: torch.Tensor
    partials: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * 4 + self.partials.numel() * 4


def quest_rerank_workspace(rows: int, num_heads: int, num_kv_heads: int, head_size: int, width: int,
                           device: torch.device | str) -> QuestRerankWorkspace:
    """Allocate the workspace of :func:`quest_candidate_evidence` (once, outside any CUDA-graph capture)."""
    tile = candidate_tile(num_heads // num_kv_heads, head_size)
    n_tiles = max(1, -(-int(width) // tile))
    f32 = dict(dtype=torch.float32, device=torch.device(device))
    return QuestRerankWorkspace(rows=rows, num_heads=num_heads, width=int(width), tile=tile,
                                logits=torch.empty((rows, num_heads, max(int(width), 1)), **f32),
                                partials=torch.empty((rows, num_heads, n_tiles, 2), **f32))


def _check(query, kv_cache, block_table, rows, cand, n_cand, hi, out) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"kv_cache must be [num_blocks, Hkv, block_size, 2*D], got {tuple(kv_cache.shape)}")
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    if query.dim() != 3 or query.shape[2] != d or query.shape[1] % hkv:
        raise ValueError(f"query must be [R, Hq, {d}] with Hq a multiple of {hkv}, got {tuple(query.shape)}")
    s = rows.shape[0]
    if cand.dim() != 3 or cand.shape[0] < s or cand.shape[1] != hkv:
        raise ValueError(f"cand must be int [>= {s}, {hkv}, W], got {tuple(cand.shape)}")
    if n_cand.shape[0] < s or hi.shape[0] < s or block_table.shape[0] < s:
        raise ValueError("n_cand, hi and block_table need a row per entry")
    if out.dim() != 3 or out.dtype != torch.float32 or out.shape[0] < s or out.shape[1] != hkv:
        raise ValueError(f"out must be fp32 [>= {s}, {hkv}, L], got {out.dtype} {tuple(out.shape)}")


def quest_candidate_evidence_torch(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               rows: torch.Tensor, cand: torch.Tensor, n_cand: torch.Tensor,
                               hi: torch.Tensor, scale: float, out: torch.Tensor, *,
                               count: torch.Tensor | None = None,
                               workspace: QuestRerankWorkspace | None = None,
                               k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`quest_candidate_evidence` (vectorised over the entries, no host sync)."""
    del workspace
    _check(query, kv_cache, block_table, rows, cand, n_cand, hi, out)
    s = rows.shape[0]
    if s == 0 or query.shape[0] == 0:
        return out
    dev = out.device
    if dev.type == "cpu":
        scale = scale * kv_quant.host_scale(kv_cache.dtype, k_scale)
    elif kv_quant.twin_scale(kv_cache.dtype, k_scale) is not None:
        scale = kv_quant.twin_scale(kv_cache.dtype, k_scale) * scale
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    g = query.shape[1] // hkv
    length, w = out.shape[2], cand.shape[2]
    full_length = length
    if dev.type == "cpu":
        # the CPU reads the plan for free: the live prefix of the entries, the positions before the
        # end of their allowed sets (nothing is written past ``hi``), the candidates they count
        if count is not None:
            s = max(0, min(s, int(count.reshape(-1)[0])))
            count = None
        if s == 0:
            return out
        if _per_entry_cpu(query, kv_cache, block_table, rows, cand, n_cand, hi, scale, out, s):
            return out
        length = max(1, min(length, int(hi[:s].max())))
        w = max(1, min(w, int(n_cand[:s].max())))
    live = rows[:s].to(dev).long() >= 0
    if count is not None:
        live = live & (torch.arange(s, device=dev) < count.to(dev).long()[0])
    c = cand[:s, :, :w].to(dev).long()                                             # [S, H, W]
    counted = torch.arange(w, device=dev)[None, None, :] < n_cand[:s].to(dev).long()[:, None, None]
    valid = live[:, None, None] & counted & (c >= 0) & (c < full_length)
    keys = _gather_keys(kv_cache, block_table[:s], c)                             # [S, H, W, D]
    q = query[rows[:s].to(dev).long().clamp(0, query.shape[0] - 1)].float().reshape(s, hkv, g, d)
    lg = torch.einsum("shgd,shwd->shgw", q, keys.float()) * scale                 # [S, H, G, W]
    lg = lg.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(lg, dim=-1, keepdim=True)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    logits = torch.logsumexp(lg - lse, dim=2)                                    # [S, H, W]
    exact = torch.full((s, hkv, length + 1), float("-inf"), dtype=torch.float32, device=dev)
    inside = valid & (c < length)
    exact.scatter_(2, torch.where(inside, c, length), torch.where(inside, logits, float("-inf")))
    pos = torch.arange(length, device=dev)
    write = live[:, None, None] & (pos[None, None, :] < hi[:s].to(dev).long()[:, None, None])
    out[:s, :, :length] = torch.where(write, exact[..., :length], out[:s, :, :length])
    return out


def _per_entry_cpu(query, kv_cache, block_table, rows, cand, n_cand, hi, scale, out, s) -> bool:
    """The twin on the CPU per live entry, when every counted candidate is a position of the cache
    (as the selector gives them): its candidates' K, the group's logits as one batched matmul, the
    mass, ``-inf`` over ``[0, hi)`` and the scores scattered in. False (nothing written) when some
    entry has a counted candidate out of range: the vectorised form handles those."""
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    g = query.shape[1] // hkv
    length, w = out.shape[2], cand.shape[2]
    row_l, n_l, hi_l = rows[:s].tolist(), n_cand[:s].tolist(), hi[:s].tolist()
    work = []
    for e in range(s):
        if row_l[e] < 0:
            continue
        n = min(max(int(n_l[e]), 0), w)
        c = cand[e, :, :n].long()                                                   # [H, n]
        if n and bool(((c < 0) | (c >= length)).any()):
            return False
        work.append((e, n, c))
    for e, n, c in work:
        end = min(max(int(hi_l[e]), 0), length)
        dst = out[e]
        if end:
            dst[:, :end] = float("-inf")
        if n == 0:
            continue
        keys = _gather_keys(kv_cache, block_table[e:e + 1], c[None])[0]             # [H, n, D]
        q = query[min(row_l[e], query.shape[0] - 1)].float().reshape(hkv, g, d)
        lg = torch.matmul(q, keys.float().transpose(1, 2)) * scale                    # [H, G, n]
        lse = torch.logsumexp(lg, dim=-1, keepdim=True)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        score = torch.logsumexp(lg - lse, dim=1)                                     # [H, n]
        inside = c < end
        if bool(inside.all()):
            dst.scatter_(1, c, score)
        else:                          # candidates at or past hi count in the sums, are not written
            pad = torch.full((hkv, end + 1), float("-inf"), dtype=dst.dtype, device=dst.device)
            pad.scatter_(1, torch.where(inside, c, end), torch.where(inside, score, float("-inf")))
            dst[:, :end] = pad[:, :end]
    return True


def _gather_keys(kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """K of every entry and KV head at its own ``positions [S, Hkv, W]`` (out-of-range ones clamped,
    the caller masks them) -> ``[S, Hkv, W, D]``: the K half of each cache entry only."""
    bs, d = kv_cache.shape[2], kv_cache.shape[-1] // 2
    s, h, w = positions.shape
    pos = positions.long().clamp_min(0)
    bidx = (pos // bs).clamp_max(max(block_table.shape[1] - 1, 0))
    blocks = torch.gather(block_table.long(), 1, bidx.reshape(s, h * w)).reshape(s, h, w)
    blocks = blocks.clamp(0, max(kv_cache.shape[0] - 1, 0))
    from vllm_ext.kernels.paged_reference import gather_entries

    heads = torch.arange(h, device=kv_cache.device)[None, :, None]
    return gather_entries(kv_cache, blocks, heads, pos % bs, d)


def quest_candidate_evidence_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                rows: torch.Tensor, cand: torch.Tensor, n_cand: torch.Tensor,
                                hi: torch.Tensor, scale: float, out: torch.Tensor, *,
                                count: torch.Tensor | None = None,
                                workspace: QuestRerankWorkspace | None = None,
                                k_scale: torch.Tensor | None = None) -> torch.Tensor:
    _check(query, kv_cache, block_table, rows, cand, n_cand, hi, out)
    s = rows.shape[0]
    if s == 0 or query.shape[0] == 0:
        return out
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    hq = query.shape[1]
    g = hq // hkv
    length, w = out.shape[2], cand.shape[2]
    if workspace is None:
        workspace = quest_rerank_workspace(s, hq, hkv, d, w, out.device)
    ws = workspace
    if ws.rows < s or ws.num_heads != hq or ws.width < w or ws.tile != candidate_tile(g, d):
        raise ValueError(f"quest_rerank workspace is for {ws.rows} entries, {ws.num_heads} heads, width "
                         f"{ws.width}, tile {ws.tile}; got {s}, {hq}, {w}, {candidate_tile(g, d)}")
    has_count = count is not None
    cnt = count if has_count else rows
    fill_block = 1024
    _fill_kernel[(s, hkv, triton.cdiv(max(length, 1), fill_block))](
        rows, hi, cnt, out, *out.stride(), length,
        BLOCK=fill_block, HAS_COUNT=has_count)
    g_pad, d_pad = max(1, next_pow2(g)), max(16, next_pow2(d))
    block_c = ws.tile
    n_tiles = triton.cdiv(max(w, 1), block_c)
    lg, part = ws.logits, ws.partials
    ks, _, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, k_scale, out)   # no V read
    _logits_kernel[(s, hkv, n_tiles)](
        query, kv_cache, block_table, rows, cand, n_cand, cnt, lg, part, ks,
        *query.stride(), *kv_cache.stride(), *block_table.stride(), *cand.stride(), *lg.stride(),
        *part.stride()[:3],
        float(scale), length, w,
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad, PAGE=kv_cache.shape[2], BLOCK_C=block_c,
        HAS_COUNT=has_count, KV_SCALED=kv_scaled,
    )
    _mass_kernel[(s, hkv, n_tiles)](
        rows, cand, n_cand, cnt, lg, part, out,
        *cand.stride(), *lg.stride(), *part.stride()[:3], *out.stride(),
        length, w,
        G=g, G_PAD=g_pad, T_PAD=max(2, next_pow2(n_tiles)), BLOCK_C=block_c, HAS_COUNT=has_count,
    )
    return out


def quest_candidate_evidence(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         rows: torch.Tensor, cand: torch.Tensor, n_cand: torch.Tensor, hi: torch.Tensor,
                         scale: float, out: torch.Tensor, *,
                         count: torch.Tensor | None = None,
                         workspace: QuestRerankWorkspace | None = None,
                         k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The candidates' group attention mass as the selector's pooled log evidence (module docstring)."""
    if use_triton(query):
        return quest_candidate_evidence_triton(query, kv_cache, block_table, rows, cand, n_cand, hi, scale,
                                           out, count=count, workspace=workspace, k_scale=k_scale)
    return quest_candidate_evidence_torch(query, kv_cache, block_table, rows, cand, n_cand, hi, scale, out,
                                      count=count, k_scale=k_scale)
