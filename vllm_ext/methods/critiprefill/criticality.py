"""CritiPrefill method logic in plain PyTorch (ALGORITHMS.md §3). Imports neither vLLM nor Triton.

Vocabulary (absolute token positions ``0..n-1`` of one request):

- *segment* ``j`` = query positions ``[j*Sq, (j+1)*Sq)`` (``Sq = segment_size``);
- *block* ``b`` = key positions ``[b*Bk, (b+1)*Bk)`` (``Bk = block_size``, the criticality block,
  independent of vLLM's page size); ``segment_size`` must be a multiple of ``block_size``, so
  segment ``j`` starts at block ``sb = j*Sq/Bk``;
- *representatives*: element-wise max / min over a segment's queries (``Qmax, Qmin``) and over a
  block's keys (``Kmax, Kmin``), per head.

Scores (per query head, then averaged over the GQA group: one score row per KV head):

- ``"code"`` (the authors' repository; the default): ``Amax = (QmaxKmaxᵀ + QminKmaxᵀ)/2``,
  ``Amin = (QmaxKminᵀ + QminKminᵀ)/2``, ``A = max(Amax, Amin)``, group mean of the raw ``A``,
  causal mask, one softmax over blocks;
- ``"paper"`` (the paper's Algorithm 1): ``S1..S4 = softmax_b(Q{max,min} K{max,min}ᵀ)`` over the
  segment's candidate blocks, ``Smax = (S1+S3)/2``, ``Smin = (S2+S4)/2``, ``S = max(Smax, Smin)``;
  then the group mean.

No ``1/sqrt(d)`` scaling in either form (neither the paper nor the code scales). Scores are fp32
(the authors' code computes them in the model's dtype, bf16; see docs/ALGORITHMS.md §3).

Causal mask: the softmaxes run over the blocks strictly before the segment's start. The authors'
code adds the dtype's lowest value to the other blocks before its softmax, which gives them 0; the
paper masks after the softmax. Under chunked prefill the blocks after the current chunk do not exist
yet, so normalising over the visible candidates is also the only chunk-invariant choice. Masked
entries are 0 after the softmax (rows with no candidate are all 0).

Layer fusion (``S_prev`` = the fused score of the previous sparse layer, same chunk):

- ``"ema"`` (the authors' code; the default): ``S = (1 - alpha) * S + alpha * S_prev``, i.e.
  ``0.75 * S + 0.25 * S_prev`` at ``alpha = 0.25``;
- ``"paper"`` (the paper's Algorithm 1, line 14): ``S = alpha * S + (1 - alpha) * S_prev``;
- ``"sum"``: ``S = alpha * S + S_prev``, a running sum (neither source's; kept to reproduce older
  measurements).

The state resets at the first sparse layer of each forward pass (:class:`LayerFusion`).

Selection, per (segment, KV head): the top ``budget // block_size`` blocks among the candidates
``0 <= b < sb`` by fused score (ties: the lower block index first), plus the segment's own keys
(positions ``sb*Bk .. q`` with the exact causal mask, handled by the kernel, not listed). With
``sink_block`` (ours, off by default; the authors force none) block 0 is always selected and the
top-k runs over ``1 <= b < sb``. A segment whose candidates all fit the budget selects them all,
which is dense.

Dense segments (the authors' code): every segment that starts before ``min_len`` (the authors'
``threshold_len``), whatever the prompt's length; the final segment of the prompt (the one holding
position ``prompt_len - 1``, partial or full) and any segment after it (only a preempted request
recomputing its prompt and output has one). Layers in ``dense_layers`` are dense throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ScoreForm = Literal["code", "paper"]
FusionForm = Literal["ema", "paper", "sum"]
FUSION_FORMS = ("ema", "paper", "sum")

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------- representatives
def segment_representatives(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max / min of ``x [n, H, D]`` over consecutive groups of ``size`` rows.

    Returns ``(xmax, xmin)``, each ``[ceil(n / size), H, D]`` fp32; the last group may be partial
    (its representatives cover the rows that exist). Used for query segments and for key blocks of
    contiguous (non-paged) tensors.
    """
    n, h, d = x.shape
    n_groups = -(-n // size)
    pad = n_groups * size - n
    xf = x.float()
    if pad:
        xmax_in = torch.cat([xf, xf.new_full((pad, h, d), _NEG_INF)])
        xmin_in = torch.cat([xf, xf.new_full((pad, h, d), float("inf"))])
    else:
        xmax_in = xmin_in = xf
    xmax = xmax_in.reshape(n_groups, size, h, d).amax(dim=1)
    xmin = xmin_in.reshape(n_groups, size, h, d).amin(dim=1)
    return xmax, xmin


# ------------------------------------------------------------------------------------------ scoring
def candidate_mask(seg_start_block: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[..., num_blocks]`` bool: block ``b`` is visible to the segment (``b < seg_start_block``)."""
    b = torch.arange(num_blocks, device=seg_start_block.device)
    return b < seg_start_block.unsqueeze(-1)


def _masked_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.masked_fill(~mask, _NEG_INF)
    p = torch.softmax(x, dim=-1)
    return torch.nan_to_num(p, nan=0.0)   # rows without any candidate


def criticality_scores(qmax: torch.Tensor, qmin: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor,
                       visible: torch.Tensor, score: ScoreForm = "code") -> torch.Tensor:
    """Segment-to-block criticality, one row per KV head.

    ``qmax, qmin``: ``[..., S, Hq, D]`` segment representatives; ``kmax, kmin``: ``[..., NB, Hkv, D]``
    block representatives (same leading batch dims ``...``, or none); ``visible``: ``[..., S, NB]``
    bool, the causal candidate mask. Returns ``[..., S, Hkv, NB]`` fp32, 0 where not visible.
    """
    hq, d = qmax.shape[-2:]
    nb, hkv = kmax.shape[-3:-1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    g = hq // hkv
    lead = qmax.shape[:-3]
    s = qmax.shape[-3]
    q = torch.stack([qmax.float(), qmin.float()], dim=-2)            # [..., S, Hq, 2, D]
    q = q.reshape(*lead, s, hkv, g, 2, d)
    k = torch.stack([kmax.float(), kmin.float()], dim=-2)            # [..., NB, Hkv, 2, D]
    dots = torch.einsum("...shgqd,...nhkd->...shgqkn", q, k)         # [..., S, Hkv, G, 2q, 2k, NB]
    vis = visible[..., :, None, None, None, None, :]
    if score == "paper":
        p = _masked_softmax(dots, vis.expand_as(dots))               # S1..S4
        sk = p.mean(dim=-3)                                          # [..., 2k, NB]: Smax, Smin
        out = sk.amax(dim=-2).mean(dim=-2)                           # max, then the group mean
    elif score == "code":
        a = dots.mean(dim=-3).amax(dim=-2).mean(dim=-2)              # [..., S, Hkv, NB]
        out = _masked_softmax(a, visible[..., :, None, :].expand_as(a))
    else:
        raise ValueError(f"unknown criticality score form {score!r} (expected 'paper' or 'code')")
    return out


# ------------------------------------------------------------------------------------------- fusion
def fuse_scores(s: torch.Tensor, s_prev: torch.Tensor | None, fusion: FusionForm, alpha: float) -> torch.Tensor:
    """One step of layer fusion (see the module docstring). ``s_prev=None`` returns ``s``."""
    if fusion not in FUSION_FORMS:
        raise ValueError(f"unknown fusion {fusion!r} (expected one of {', '.join(FUSION_FORMS)})")
    if s_prev is None:
        return s
    if fusion == "ema":
        return (1.0 - alpha) * s + alpha * s_prev
    if fusion == "paper":
        return alpha * s + (1.0 - alpha) * s_prev
    return alpha * s + s_prev


class LayerFusion:
    """Fused-score state carried from one sparse layer to the next within one forward pass.

    Call :meth:`reset` at the start of every forward pass (the plan builder also resets by itself
    when the score shape changes, i.e. a new batch). ``enabled=False`` turns fusion off (ablation).
    """

    def __init__(self, fusion: FusionForm = "ema", alpha: float = 0.25, enabled: bool = True):
        if fusion not in FUSION_FORMS:
            raise ValueError(f"unknown fusion {fusion!r} (expected one of {', '.join(FUSION_FORMS)})")
        self.fusion = fusion
        self.alpha = float(alpha)
        self.enabled = enabled
        self.prev: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg) -> "LayerFusion":
        return cls(cfg.fusion, cfg.alpha)

    def reset(self) -> None:
        self.prev = None

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        """Fuse ``s`` with the stored state, store and return the result."""
        if not self.enabled:
            return s
        prev = self.prev
        if prev is not None and (prev.shape != s.shape or prev.device != s.device):
            prev = None                                               # a new batch: reset
        fused = fuse_scores(s, prev, self.fusion, self.alpha)
        self.prev = fused
        return fused


# ---------------------------------------------------------------------------------------- selection
def select_blocks(scores: torch.Tensor, seg_start_block: torch.Tensor, topk: int, *,
                  sink: bool = False) -> torch.Tensor:
    """Selected key blocks per (segment, KV head), ascending, padded with ``-1``.

    ``scores``: ``[..., S, Hkv, NB]``; ``seg_start_block``: ``[..., S]`` (int, the segment's first
    block ``sb``). Candidates are blocks ``0 <= b < sb``; the top ``topk`` of them (all of them when
    there are fewer). ``sink``: block 0 is always selected and the top ``topk`` come from
    ``1 <= b < sb``. Returns int32 ``[..., S, Hkv, topk + sink]``. Ties break towards the lower block
    index (a stable sort: deterministic on every device).
    """
    *lead, s, hkv, nb = scores.shape
    dev = scores.device
    b = torch.arange(nb, device=dev)
    sb = seg_start_block.to(torch.long)[..., None, None]             # [..., S, 1, 1]
    cand = (b >= int(sink)) & (b < sb)                                # [..., S, 1, NB]
    x = torch.nan_to_num(scores.float(), nan=0.0).masked_fill(~cand, _NEG_INF)
    k_eff = min(topk, nb)
    if k_eff > 0:
        order = torch.sort(x, dim=-1, descending=True, stable=True)
        vals, idx = order.values[..., :k_eff], order.indices[..., :k_eff]
        idx = torch.where(vals > _NEG_INF, idx, torch.full_like(idx, -1))
    else:
        idx = torch.empty(*lead, s, hkv, 0, dtype=torch.long, device=dev)
    if k_eff < topk:
        idx = torch.cat([idx, idx.new_full((*lead, s, hkv, topk - k_eff), -1)], dim=-1)
    if sink:
        sink_col = torch.where(sb >= 1, 0, -1).expand(*lead, s, hkv, 1).to(idx.dtype)
        idx = torch.cat([sink_col, idx], dim=-1)
    big = torch.iinfo(torch.int32).max
    sel = torch.where(idx < 0, big, idx).sort(dim=-1).values
    sel = torch.where(sel == big, -1, sel)
    return sel.to(torch.int32)


def dense_segments(seg_ids: torch.Tensor, prompt_len: torch.Tensor, cfg) -> torch.Tensor:
    """Which segments (absolute ids ``[..., S]``; ``prompt_len`` broadcastable) attend densely:
    those starting before ``cfg.min_len`` and the prompt's final segment or later."""
    final_seg = torch.div(prompt_len - 1, cfg.segment_size, rounding_mode="floor")
    return (seg_ids * cfg.segment_size < cfg.min_len) | (seg_ids >= final_seg)


# -------------------------------------------------------------------------------------------- misc
def is_dense_layer(cfg, layer_idx: int) -> bool:
    """Whether CritiPrefill leaves this layer dense (disabled, or the layer is in ``dense_layers``)."""
    return (not getattr(cfg, "enabled", True)) or layer_idx in tuple(cfg.dense_layers)


def check_sizes(segment_size: int, block_size: int, budget: int) -> None:
    if segment_size <= 0 or block_size <= 0 or budget < 0:
        raise ValueError("segment_size and block_size must be > 0 and budget >= 0")
    if segment_size % block_size:
        raise ValueError(f"critiprefill.segment_size ({segment_size}) must be a multiple of "
                         f"critiprefill.block_size ({block_size})")
    if budget % block_size:
        raise ValueError(f"critiprefill.budget ({budget}) must be a multiple of "
                         f"critiprefill.block_size ({block_size})")


@dataclass
class SequenceSelection:
    """Result of :func:`select_for_sequence` (contiguous, single-sequence form)."""

    sel: torch.Tensor        # [n_seg, Hkv, topk + sink] int32, -1 padded
    dense: torch.Tensor      # [n_seg] bool
    scores: torch.Tensor     # [n_seg, Hkv, NB] fused fp32


def select_for_sequence(q: torch.Tensor, k: torch.Tensor, cfg, fusion: LayerFusion | None = None, *,
                        ctx_len: int = 0, prompt_len: int | None = None) -> SequenceSelection:
    """The method on one contiguous sequence (documentation and test oracle for the paged plan).

    ``q``: ``[n_q, Hq, D]`` the chunk's queries at positions ``ctx_len .. ctx_len + n_q - 1``;
    ``k``: ``[ctx_len + n_q, Hkv, D]`` all keys so far. Segments are those of the chunk (absolute
    numbering, first = ``ctx_len // Sq``).
    """
    sq, bk = cfg.segment_size, cfg.block_size
    check_sizes(sq, bk, cfg.budget)
    n_q = q.shape[0]
    seq_len = ctx_len + n_q
    prompt_len = seq_len if prompt_len is None else prompt_len
    first_seg = ctx_len // sq
    last_seg = (seq_len - 1) // sq
    # pad the queries in front so that segments are aligned to absolute positions
    lead = ctx_len - first_seg * sq
    qpad = torch.cat([q.new_full((lead, *q.shape[1:]), float("nan")), q]) if lead else q
    qf = qpad.float()
    n_seg = last_seg - first_seg + 1
    pad = n_seg * sq - qf.shape[0]
    if pad:
        qf = torch.cat([qf, qf.new_full((pad, *q.shape[1:]), float("nan"))])
    qs = qf.reshape(n_seg, sq, *q.shape[1:])
    valid = ~torch.isnan(qs)
    qmax = torch.where(valid, qs, _NEG_INF).amax(dim=1)
    qmin = torch.where(valid, qs, float("inf")).amin(dim=1)
    kmax, kmin = segment_representatives(k, bk)
    nb = kmax.shape[0]
    seg_ids = torch.arange(first_seg, last_seg + 1, device=q.device)
    sb = seg_ids * (sq // bk)
    vis = candidate_mask(sb, nb)
    s = criticality_scores(qmax, qmin, kmax, kmin, vis, cfg.score)
    if fusion is not None:
        s = fusion(s)
    sel = select_blocks(s, sb, cfg.budget // bk, sink=cfg.sink_block)
    dense = dense_segments(seg_ids, torch.tensor(prompt_len, device=q.device), cfg)
    return SequenceSelection(sel=sel, dense=dense, scores=s)
