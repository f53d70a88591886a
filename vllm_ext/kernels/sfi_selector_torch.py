"""The SFI Selector in PyTorch (ALGORITHMS.md §1 "Selector", steps 1-5), batched and device-resident.

This is the reference twin of the Triton selector in :mod:`vllm_ext.kernels.sfi_selector` (same
signature for :func:`select`) and the CPU path. Everything runs on whatever device the inputs are on,
with fixed shapes, masks instead of data-dependent slicing and no host sync, so it can run inside a
CUDA-graph replay.

Layout. ``rows`` are requests (one slow step each), ``Hkv`` the layer's local KV heads, ``L`` the
padded number of key positions; index ``j`` of the last axis *is* absolute position ``j``. Each row
has its own allowed set ``A = [lo, hi)`` (clamped to ``[0, L)``; empty when ``hi <= lo``). Rows that
make no selection this step simply pass an empty set.

Stages (each a small function, all in fp32 log space, ``-inf`` outside ``A``):

1. :func:`pool_evidence`: per-row softmax over ``A`` of the ``R = G*W`` evidence rows, power mean with
   ``alpha``, renormalised over ``A`` -> ``log f``.
2. :func:`log_prior`: ``log r = w_k * (-gamma_k log||k_j||) + w_pos * (-beta u^p + eta log max(1-u, eps))``
   with ``u = (j - lo) / (hi - lo - 1)`` (``u = 0`` when ``|A| = 1``), renormalised over ``A``.
3. :func:`fuse`: ``s = (1 - lam) f + lam r`` in log space with the closed-form clipped ``lam``.
4. :func:`soft_nms` (window max over ``|i - j| <= nms_radius`` inside ``A``) and
   :func:`cross_head_exclusivity` (skipped when ``Hkv <= 2`` or ``lam_x == 0``).
   Not in the paper, off by default: :func:`span_dilate` (``sfi.select_span``) lets each position take
   the best score of the ``select_span`` positions before it inside ``A``.
5. :func:`topk_positions`: the ``min(k_eff, |A|)`` best positions per (row, head), sorted ascending,
   padded with -1. Ties are broken deterministically: the lower position wins (scores are compared
   through an order-preserving integer key, so ``-0.0`` ranks just below ``+0.0``; NaN counts as
   ``-inf``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_ext.kernels.selector_params import SelectorParams, output_width

NEG_INF = float("-inf")
_INT32_MIN = -(2 ** 31)


# ----------------------------------------------------------------------------------------- helpers
def clamp_bounds(lo: torch.Tensor, hi: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = [lo, hi)`` clamped to ``[0, length)`` with ``hi >= lo`` (int64 tensors ``[rows]``)."""
    lo = lo.long().clamp(0, length)
    hi = torch.maximum(hi.long().clamp(0, length), lo)
    return lo, hi


def allowed_mask(lo: torch.Tensor, hi: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean ``[rows, 1, length]``: position ``j`` is in ``A`` of the row."""
    lo, hi = clamp_bounds(lo, hi, length)
    pos = torch.arange(length, device=lo.device)
    return ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :]


def normalize_log(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x - logsumexp_A(x)`` inside ``A``, ``-inf`` elsewhere (and everywhere if ``x`` is ``-inf`` on all of ``A``)."""
    x = torch.where(mask, x, NEG_INF)
    z = torch.logsumexp(x, dim=-1, keepdim=True)
    return torch.where(mask & (z > NEG_INF), x - z, NEG_INF)


# ------------------------------------------------------------------------------ 1. evidence
def pool_evidence(evidence: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Evidence ``log f [rows, Hkv, L]`` (normalised over ``A``).

    ``evidence`` is either ``[rows, Hkv, R, L]``: per evidence row ``r`` (query head of the group x
    window query) the attention logits ``q_r . k_j / sqrt(d)`` or any per-row shift of them (e.g.
    log-probabilities normalised over the whole history); ``-inf`` where the row cannot see ``j``.
    Each row is softmaxed over ``A``, then pooled with the power mean
    ``log f = (logsumexp_r(alpha log p_r) - log R) / alpha``; a row that sees nothing of ``A`` adds
    ``p = 0``. Or ``[rows, Hkv, L]``: an already pooled log-evidence (any per-(row, head) shift).
    """
    if evidence.dim() == 3:
        return normalize_log(evidence.float(), mask)
    if evidence.dim() != 4:
        raise ValueError(f"evidence must be [rows, Hkv, R, L] or [rows, Hkv, L], got {tuple(evidence.shape)}")
    n_rows = evidence.shape[2]
    m4 = mask[:, :, None, :]
    x = torch.where(m4, evidence.float(), NEG_INF)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)                     # [rows, H, R, 1]
    logp = torch.where(m4 & (lse > NEG_INF), x - lse, NEG_INF)
    pooled = torch.logsumexp(alpha * logp, dim=2)                      # [rows, H, L]
    log_f = (pooled - math.log(max(n_rows, 1))) / alpha
    return normalize_log(log_f, mask)


# ---------------------------------------------------------------------------------- 2. prior
def position_u(lo: torch.Tensor, hi: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``u(j) = (j - lo) / (hi - lo - 1)`` clamped to ``[0, 1]`` (denominator at least 1, so ``u = 0``
    when ``|A| = 1``) and ``1 - u``, both ``[rows, 1, L]`` fp32. ``1 - u`` is computed from integers, so it
    is exactly 0 at the last position of ``A`` (the tail brake's ``eps`` clamp applies there)."""
    lo, hi = clamp_bounds(lo, hi, length)
    den = (hi - lo - 1).clamp_min(1)[:, None]
    pos = torch.arange(length, device=lo.device)
    rel = torch.minimum((pos - lo[:, None]).clamp_min(0), den)
    denf = den.float()
    return (rel.float() / denf)[:, None, :], ((den - rel).float() / denf)[:, None, :]


def log_prior(key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, mask: torch.Tensor,
              params: SelectorParams) -> torch.Tensor:
    """Prior ``log r [rows, Hkv, L]`` (normalised over ``A``) from key norms ``[rows, Hkv, L]`` and position."""
    eps = params.eps
    u, one_minus_u = position_u(lo, hi, key_norms.shape[-1])
    log_pi = -params.gamma_k * torch.log(key_norms.float().clamp_min(eps))
    log_delta = -params.pos_beta * u.pow(params.pos_power) + params.pos_eta * torch.log(one_minus_u.clamp_min(eps))
    return normalize_log(params.w_k * log_pi + params.w_pos * log_delta, mask)


# --------------------------------------------------------------------------------- 3. fusion
def fusion_lambda(log_f: torch.Tensor, log_r: torch.Tensor, lambda_max: float, eps: float) -> torch.Tensor:
    """``clamp((|f|^2 - <f,r>) / max(|f - r|^2, eps), 0, lambda_max)`` per (row, head), ``[rows, Hkv]``.

    ``|f - r|^2`` is expanded as ``|f|^2 - 2<f,r> + |r|^2`` (the Triton twin accumulates the three
    sums in one pass)."""
    f, r = torch.exp(log_f), torch.exp(log_r)
    ff, rr, fr = (f * f).sum(-1), (r * r).sum(-1), (f * r).sum(-1)
    lam = (ff - fr) / (ff - 2.0 * fr + rr).clamp_min(eps)
    return lam.clamp(0.0, lambda_max)


def fuse(log_f: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, lambda_max: float,
         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``log s = logaddexp(log(1 - lam) + log f, log(lam) + log r)`` (``-inf`` outside ``A``) and ``lam``.
    With ``lam = 0`` this is exactly ``log f``."""
    lam = fusion_lambda(log_f, log_r, lambda_max, eps)
    a = torch.log1p(-lam)[..., None]
    b = torch.log(lam)[..., None]                                      # -inf when lam == 0
    log_s = torch.logaddexp(a + log_f, b + log_r)
    return torch.where(mask, log_s, NEG_INF), lam


# ----------------------------------------------------------------------------- 4. refinement
def soft_nms(log_s: torch.Tensor, mask: torch.Tensor, radius: int, mu: float) -> torch.Tensor:
    """``l' = l - mu * max(m - l, 0)`` with ``m(j) = max_{|i-j| <= radius, i in A} l(i)``."""
    if radius <= 0 or mu == 0.0:
        return log_s
    rows, heads, length = log_s.shape
    x = torch.where(mask, log_s, NEG_INF)
    m = F.max_pool1d(x.reshape(rows * heads, 1, length), kernel_size=2 * radius + 1, stride=1,
                     padding=radius).reshape(rows, heads, length)
    keep = mask & (x > NEG_INF)
    gap = torch.where(keep, (m - x).clamp_min(0.0), 0.0)
    return torch.where(keep, x - mu * gap, NEG_INF)


def cross_head_exclusivity(log_s: torch.Tensor, mask: torch.Tensor, temperature: float, lam_x: float,
                           eps: float) -> torch.Tensor:
    """``l'' = l' + lam_x * log max(softmax_h(l'/T), eps)``; identity when ``Hkv <= 2`` or ``lam_x == 0``."""
    heads = log_s.shape[1]
    if heads <= 2 or lam_x == 0.0:
        return log_s
    x = torch.where(mask, log_s, NEG_INF)
    z = x / temperature
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    keep = mask & (x > NEG_INF)
    log_rho = torch.where(keep, z - lse, 0.0)
    return torch.where(keep, x + lam_x * log_rho.clamp_min(math.log(eps)), NEG_INF)


def selector_scores(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    params: SelectorParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4: the refined score ``l'' [rows, Hkv, L]`` fp32 (``-inf`` outside ``A``) and ``lam [rows, Hkv]``."""
    length = key_norms.shape[-1]
    mask = allowed_mask(lo, hi, length)
    log_f = pool_evidence(evidence, mask, params.alpha)
    if params.lambda_max == 0.0:
        # lam = clamp(., 0, 0) = 0 and fuse() gives logaddexp(log f + 0, -inf) = log f exactly: the
        # prior cannot enter (selector "quest" runs so), so it is not computed
        log_s, lam = log_f, torch.zeros(log_f.shape[:2], dtype=log_f.dtype, device=log_f.device)
    else:
        log_r = log_prior(key_norms, lo, hi, mask, params)
        log_s, lam = fuse(log_f, log_r, mask, params.lambda_max, params.eps)
    log_s = soft_nms(log_s, mask, params.nms_radius, params.mu)
    log_s = cross_head_exclusivity(log_s, mask, params.cross_head_temperature, params.lam_x, params.eps)
    return log_s, lam


def span_dilate(score: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, span: int,
                back: int = 0) -> torch.Tensor:
    """``l(j) <- max_{-back <= d <= span, j - d in A} l(j - d)`` inside ``A`` (``-inf`` outside; NaN
    counts as ``-inf``): a token the evidence picks brings the ``span`` tokens after it and the
    ``back`` tokens before it into the ranking."""
    if span <= 0 and back <= 0:
        return score
    rows, heads, length = score.shape
    mask = allowed_mask(lo, hi, length)
    x = torch.where(mask & ~torch.isnan(score), score.float(), NEG_INF)
    m = F.max_pool1d(F.pad(x.reshape(rows * heads, 1, length), (span, back), value=NEG_INF),
                     kernel_size=span + back + 1, stride=1).reshape(rows, heads, length)
    return torch.where(mask, m, NEG_INF)


def exclude_positions(score: torch.Tensor, exclude: torch.Tensor | None,
                      exclude_slot: torch.Tensor | None = None,
                      exclude_count: torch.Tensor | None = None) -> torch.Tensor:
    """``score`` with ``-inf`` at the positions ``exclude [rows, Hkv, E]`` lists per (row, head) (entries
    ``< 0`` or ``>= L`` are padding): a position kept by an earlier selection (``sfi.keep_prefill``)
    is not chosen again while finite scores remain. ``exclude_slot [rows]``: ``exclude`` is a table
    ``[C, Hkv, E]`` and row ``r`` reads its entry ``exclude_slot[r]`` (none when negative);
    ``exclude_count [rows]``: only a row's first ``exclude_count[r]`` entries count."""
    if exclude is None or exclude.shape[-1] == 0:
        return score
    rows, heads, length = score.shape
    if exclude_slot is not None:
        slot = exclude_slot.long()
        exclude = torch.where((slot >= 0)[:, None, None], exclude[slot.clamp_min(0)], -1)
    if exclude_count is not None:
        e = torch.arange(exclude.shape[-1], device=exclude.device)
        exclude = torch.where(e < exclude_count.long()[:, None, None], exclude, -1)
    idx = exclude.long()
    idx = torch.where((idx >= 0) & (idx < length), idx, length)
    padded = F.pad(score, (0, 1))
    padded = padded.scatter(-1, idx, NEG_INF)
    return padded[..., :length]


# ---------------------------------------------------------------------------------- 5. top-K
def score_key32(score: torch.Tensor) -> torch.Tensor:
    """Order-preserving int32 key of fp32 scores (NaN -> key of ``-inf``)."""
    s = torch.where(torch.isnan(score), NEG_INF, score.float()).contiguous()
    bits = s.view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def resolve_k(k: int | torch.Tensor, params: SelectorParams, rows: int, device: torch.device,
              k_cap: int | None = None) -> tuple[int, torch.Tensor]:
    """Output width and per-row effective budget ``k_eff [rows]`` int32 (at least ``k_min``).

    ``k`` an int: width = ``k_eff`` = ``max(k, k_min)``. ``k`` a tensor ``[rows]`` (per-request budgets,
    no sync): width = ``max(k_cap or params.k, k_min)``, ``k_eff = clamp(k, k_min, width)``."""
    width = output_width(k, params, k_cap)
    if isinstance(k, torch.Tensor):
        k_eff = k.to(device=device, dtype=torch.int32).clamp(int(params.k_min), width).expand(rows)
        return width, k_eff.contiguous()
    return width, torch.full((rows,), width, dtype=torch.int32, device=device)


def topk_positions(score: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_eff: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, head) the ``n_sel = min(k_eff, |A|)`` positions of ``A`` with the largest scores,
    ties to the lower position; ``[rows, Hkv, width]`` int32 sorted ascending, padded with -1, and
    ``n_sel [rows]`` int32."""
    rows, heads, length = score.shape
    device = score.device
    lo_c, hi_c = clamp_bounds(lo, hi, length)
    n_sel = torch.minimum(k_eff.long(), hi_c - lo_c)                   # [rows]
    out = torch.full((rows, heads, width), -1, dtype=torch.int32, device=device)
    kk = min(width, length)
    if kk == 0 or rows == 0:
        return out, n_sel.to(torch.int32)
    mask = allowed_mask(lo, hi, length)
    key32 = torch.where(mask, score_key32(score), _INT32_MIN)
    pos = torch.arange(length, device=device, dtype=torch.int64)
    key = key32.long() * (2 ** 32) + (2 ** 31 - 1 - pos)                # unique: ties -> lower position
    idx = torch.topk(key, kk, dim=-1, largest=True, sorted=True).indices
    keep = torch.arange(kk, device=device) < n_sel[:, None, None]
    idx = torch.where(keep, idx, length)
    idx = torch.sort(idx, dim=-1).values
    out[..., :kk] = torch.where(idx < length, idx, -1).to(torch.int32)
    return out, n_sel.to(torch.int32)


def select(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           params: SelectorParams, k: int | torch.Tensor, *, k_cap: int | None = None,
           exclude: torch.Tensor | None = None, exclude_slot: torch.Tensor | None = None,
           exclude_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected memory ``M_h`` of every (row, KV head) (ALGORITHMS.md §1 steps 1-5).

    Args:
      evidence: ``[rows, Hkv, R, L]`` evidence logits (``R = G*W`` rows per KV head) or ``[rows, Hkv, L]``
        pooled log-evidence; see :func:`pool_evidence`. Any float dtype (computed in fp32).
      key_norms: ``[rows, Hkv, L]`` ``||k_j||`` per position and KV head (any float dtype).
      lo, hi: ``[rows]`` int, the allowed set ``A = [lo, hi)`` of each row (``hi <= lo``: empty).
      params: the constants and ``k_min`` (:class:`vllm_ext.kernels.selector_params.SelectorParams`).
      k: budget per KV head, an int or an int tensor ``[rows]`` (see :func:`resolve_k`).
      k_cap: output width when ``k`` is a tensor (default ``params.k``).
      exclude: ``[rows, Hkv, E]`` int positions per (row, head) whose final score is set to ``-inf``
        before the top-K (:func:`exclude_positions`; ``-1`` pads). They still count in ``|A|``: the
        caller lowers ``k`` by their number so that only finite scores are chosen.
      exclude_slot, exclude_count: the table form of ``exclude`` and the entries that count
        (:func:`exclude_positions`).

    Returns ``(selected, n_sel)``: ``selected [rows, Hkv, width]`` int32 positions sorted ascending,
    padded with -1 after the first ``n_sel[row]`` entries; ``n_sel [rows]`` int32 = ``min(k_eff, |A|)``
    (all of ``A`` when ``|A| <= k_eff``).
    """
    rows = key_norms.shape[0]
    width, k_eff = resolve_k(k, params, rows, key_norms.device, k_cap)
    score, _ = selector_scores(evidence, key_norms, lo, hi, params)
    score = span_dilate(score, lo, hi, params.select_span, params.select_span_back)
    score = exclude_positions(score, exclude, exclude_slot, exclude_count)
    return topk_positions(score, lo, hi, k_eff, width)
