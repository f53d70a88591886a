"""The SFI Selector on the CPU build: the twin's stages (:mod:`vllm_ext.kernels.sfi_selector_torch`)
per live row over its allowed set ``A = [lo, hi)`` only, as contiguous views.

The masked full-length twin spends most of a call on ``torch.where`` over every position of the
padded length (about 40 masked passes at 8K, 0.5 ms of its 1.5 ms per layer on the real model).
Here nothing outside ``A`` exists, so the masks go: ``-inf`` outside ``A`` in the twin is a
``-inf`` pad or an absent term here (``exp(-inf) = 0`` adds nothing to a normalising sum; a window
maximum pads with ``-inf``). The selection is the twin's; scores can differ by the last bits of a
reduction's order, as between any two summation orders.

The host reads the plan for free on the CPU, so rows are a Python loop over the live rows (the
decode path's compacted slow list, at most ``sfi`` capacity entries); each row's work is a fixed
number of vector ops over ``|A|`` positions. CPU only; no vLLM import.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_ext.kernels import cpu_native
from vllm_ext.kernels import sfi_selector_torch as _ref
from vllm_ext.kernels.selector_params import SelectorParams

NEG_INF = float("-inf")


def _lse(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``logsumexp`` over ``dim`` (kept) for ``x`` without ``+inf`` or NaN: ``-inf`` where every term
    is ``-inf``. ``torch.logsumexp`` costs about 3x this on the CPU (its general infinity handling
    is several more passes)."""
    m = x.amax(dim, keepdim=True)
    m = torch.where(m > NEG_INF, m, 0.0)
    return (x - m).exp_().sum(dim, keepdim=True).log_().add_(m)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """``x - logsumexp(x)`` per head (``[H, n]``); ``-inf`` everywhere where ``x`` is ``-inf`` everywhere."""
    z = _lse(x, -1)
    if bool((z > NEG_INF).all()):
        return x - z
    return torch.where(z > NEG_INF, x - z, NEG_INF)


def _window_max(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``m(j) = max x[j - left .. j + right]`` along the last axis (``-inf`` past the ends), by
    doubling: ``log2(left + right + 1)`` maxima of shifted views (``max_pool1d`` compares every
    window element: 2-3x slower at a window of 33)."""
    n = x.shape[-1]
    w = left + right + 1
    y = F.pad(x, (left, right), value=NEG_INF)              # y[i] = x[i - left]
    span = 1                                                # y[i] = max x[i - left .. i - left + span - 1]
    while span * 2 <= w:
        y = torch.maximum(y[..., :-span], y[..., span:])
        span *= 2
    if span < w:
        y = torch.maximum(y[..., :y.shape[-1] - (w - span)], y[..., w - span:])
    return y[..., :n]


def _log_delta(n: int, params: SelectorParams) -> torch.Tensor:
    """The position factor ``log delta [n]`` over ``A`` (``u = i / max(n - 1, 1)``, ``1 - u`` from integers)."""
    den = max(n - 1, 1)
    rel = torch.arange(n, dtype=torch.float32)
    u = rel / den
    one_minus_u = (den - rel) / den
    return (-params.pos_beta * u.pow(params.pos_power)
            + params.pos_eta * torch.log(one_minus_u.clamp_min(params.eps)))


def _scores(ev: torch.Tensor, kn: torch.Tensor, params: SelectorParams) -> torch.Tensor:
    """Steps 1-4 of one row over its allowed set: pooled log evidence ``ev [H, n]`` and key norms
    ``kn [H, n]`` -> the refined score ``[H, n]`` (twin: :func:`_ref.selector_scores`). A score that
    is ``-inf`` stays ``-inf`` (the twin's ``keep`` masks); the masks are applied only when such a
    score exists (with the prior mixed in, none does)."""
    heads, n = ev.shape
    log_f = _normalize(ev.float())
    if params.lambda_max == 0.0:
        log_s = log_f
    else:
        log_pi = torch.log(kn.float().clamp_min(params.eps)).mul_(-params.gamma_k * params.w_k)
        log_r = _normalize(log_pi.add_(_log_delta(n, params), alpha=params.w_pos))
        lam = _ref.fusion_lambda(log_f, log_r, params.lambda_max, params.eps)[:, None]
        log_s = torch.logaddexp(torch.log1p(-lam) + log_f, torch.log(lam) + log_r)
    finite = bool((log_s > NEG_INF).all())
    if params.nms_radius > 0 and params.mu != 0.0:
        r = params.nms_radius
        gap = (_window_max(log_s, r, r) - log_s).clamp_min_(0.0)
        if finite:
            log_s = log_s - params.mu * gap
        else:
            keep = log_s > NEG_INF
            log_s = torch.where(keep, log_s - params.mu * torch.where(keep, gap, 0.0), NEG_INF)
    if heads > 2 and params.lam_x != 0.0:
        z = log_s / params.cross_head_temperature
        if finite:
            log_rho = (z - _lse(z, 0)).clamp_min_(math.log(params.eps))
            log_s = log_s + params.lam_x * log_rho
        else:
            keep = log_s > NEG_INF
            log_rho = torch.where(keep, z - _lse(z, 0), 0.0)
            log_s = torch.where(keep, log_s + params.lam_x * log_rho.clamp_min(math.log(params.eps)), NEG_INF)
    return log_s


def _dilate(score: torch.Tensor, span: int, back: int) -> torch.Tensor:
    """:func:`_ref.span_dilate` over ``A`` (positions before ``A`` are ``-inf`` there, the pad here):
    position ``j`` takes the best of ``j - span .. j + back``."""
    if span <= 0 and back <= 0:
        return score
    x = torch.where(torch.isnan(score), NEG_INF, score)
    return _window_max(x, span, back)


def select_rows(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                params: SelectorParams, k, k_cap, count, exclude=None, exclude_slot=None, exclude_count=None,
                *, native: bool = False, live_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vllm_ext.kernels.sfi_selector_torch.select` for pooled evidence ``[rows, Hkv, L]`` on the
    CPU, per live row (``count``; every row without it) over its allowed set. ``native`` (the CPU
    build's dispatch): every row through the compiled kernel in one call
    (:func:`vllm_ext.kernels.cpu_native.select_rows`) when it applies. ``live_only``: the results
    hold the live rows only (``[live, Hkv, W]``, ``[live]``)."""
    rows, heads, length = evidence.shape
    width, k_eff = _ref.resolve_k(k, params, rows, evidence.device, k_cap)
    live = rows if count is None else max(0, min(rows, int(count.reshape(-1)[0])))
    sel = torch.full((live if live_only else rows, heads, width), -1, dtype=torch.int32)
    n_sel = torch.zeros(live if live_only else rows, dtype=torch.int32)
    if live == 0:
        return sel, n_sel
    a_t = lo.reshape(-1)[:live].long().clamp(0, length)
    b_t = torch.maximum(hi.reshape(-1)[:live].long().clamp(max=length), a_t)
    n_sel[:live] = torch.minimum(k_eff[:live].long(), b_t - a_t).to(torch.int32)
    excl = _exclusions(exclude, exclude_slot, exclude_count, live)
    if native and cpu_native.select_rows(evidence[:live], key_norms[:live], a_t, b_t,
                                         n_sel[:live].long().clamp(max=width), params, excl, sel[:live]):
        return sel, n_sel
    for r, (a, b, n) in enumerate(zip(a_t.tolist(), b_t.tolist(), n_sel[:live].clamp(max=width).tolist())):
        if n <= 0:
            continue
        score = _dilate(_scores(evidence[r, :, a:b], key_norms[r, :, a:b], params), params.select_span,
                        params.select_span_back)
        if excl is not None:
            score = _exclude(score, excl[r], a, b)
        key = _ref.score_key32(score).long() * (2 ** 32) + (2 ** 31 - 1 - torch.arange(a, b))
        idx = torch.topk(key, n, dim=-1, largest=True, sorted=False).indices
        sel[r, :, :n] = (torch.sort(idx, dim=-1).values + a).to(torch.int32)
    return sel, n_sel


def _exclusions(exclude, exclude_slot, exclude_count, live: int):
    """Per live row the positions ``[Hkv, E]`` (int64, ``-1`` pads) to exclude, or None."""
    if exclude is None or exclude.shape[-1] == 0:
        return None
    if exclude_slot is not None:
        slot = exclude_slot.reshape(-1)[:live].long()
        ex = torch.where((slot >= 0)[:, None, None], exclude[slot.clamp_min(0)], -1)
    else:
        ex = exclude[:live]
    if exclude_count is not None:
        e = torch.arange(ex.shape[-1])
        ex = torch.where(e < exclude_count.reshape(-1)[:live].long()[:, None, None], ex, -1)
    return ex.long()


def _exclude(score: torch.Tensor, positions: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """``score [H, b - a]`` with ``-inf`` at the listed absolute positions inside ``[a, b)``."""
    n = b - a
    idx = positions - a
    idx = torch.where((positions >= a) & (positions < b), idx, n)
    return F.pad(score, (0, 1)).scatter(-1, idx, NEG_INF)[:, :n]
