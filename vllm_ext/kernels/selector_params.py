"""The constants the SFI selector's kernels read (:mod:`vllm_ext.kernels.sfi_selector` and its twins).

The method builds them from its configuration (``vllm_ext.methods.sfi.selector_params``); the
fields keep the configuration's names and meanings (ALGORITHMS.md §1 steps 1-5).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SelectorParams:
    k: int                          # output width for a per-row budget tensor without k_cap
    k_min: int                      # no row selects fewer (where its allowed set has them)
    alpha: float                    # power mean of the evidence rows
    gamma_k: float                  # key-norm prior: -gamma_k log ||k_j||
    w_k: float
    w_pos: float                    # position prior: -pos_beta u^pos_power + pos_eta log(1 - u)
    pos_power: float
    pos_eta: float
    pos_beta: float
    lambda_max: float               # fusion weight of the prior, clipped to [0, lambda_max]
    nms_radius: int                 # Soft-NMS window and strength
    mu: float
    cross_head_temperature: float   # cross-head exclusivity
    lam_x: float
    eps: float
    select_span: int                # span dilation: [j - select_span, j + select_span_back]
    select_span_back: int


def output_width(k: int | torch.Tensor, params: SelectorParams, k_cap: int | None = None) -> int:
    """The output width of a selection with budget ``k``: ``max(k_cap or params.k, k_min)`` for a
    tensor ``k`` (per-row budgets), ``max(k, k_min)`` for an int."""
    if isinstance(k, torch.Tensor):
        return max(int(k_cap if k_cap is not None else params.k), int(params.k_min))
    return max(int(k), int(params.k_min))
