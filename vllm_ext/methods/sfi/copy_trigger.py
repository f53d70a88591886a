"""``sfi.copy_ngram``'s copy trigger as the step plan runs it: each step records the rows' input
tokens in the per-compact-slot token histories (:class:`vllm_ext.methods.sfi.history_slots.HistorySlots`;
inside vLLM pages of SFI's history groups) and flags the decode rows whose last tokens repeat an
earlier span (:mod:`vllm_ext.kernels.copy_match`); with ``sfi.copy_once`` a slot that copied at its
last decode step does not copy again. Torch and numpy only (no vLLM).
"""

from __future__ import annotations

from typing import Mapping

import torch

from vllm_ext.config_fields import ConfigError
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.copy_match import copy_match, record_tokens
from vllm_ext.kernels.token_history import TokenHistory
from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX, HistorySlots


class CopyTrigger:
    """The token histories (``history_slots``), each row's copy flag of the step (``row_copy``) and
    with ``sfi.copy_once`` per compact slot (+ the scratch entry) whether its last decode step
    copied (``copy_prev``)."""

    def __init__(self, cfg: SfiConfig, *, capacity: int, n_slots: int, max_rows: int, max_len: int,
                 device: torch.device, paged: bool):
        if max_len <= 0:
            raise ConfigError("speedsfi.sfi.copy_ngram needs the model's max_model_len (the token "
                              "history's size)")
        self.cfg = cfg
        self.history_slots = HistorySlots(capacity=capacity, n_slots=n_slots, max_rows=max_rows,
                                          max_len=max_len, device=device, paged=paged)
        self.row_copy = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.copy_prev = torch.zeros(capacity + 1, dtype=torch.int32, device=device) if cfg.copy_once else None

    @property
    def history(self) -> TokenHistory | None:
        """The token histories (None: not bound to vLLM's pages yet)."""
        return self.history_slots.history

    def bind(self, groups: Mapping[int, tuple]) -> None:
        """SFI's KV-cache groups; the history groups are those whose layers all end in ``HISTORY_SUFFIX``."""
        self.history_slots.bind({gid: g for gid, g in groups.items()
                                 if all(n.endswith(HISTORY_SUFFIX) for n in g[1])})

    def assigned(self, slot: int) -> None:
        """Request slot ``slot`` took a compact slot: it records from its first chunk."""
        self.history_slots.on_host[slot] = True
        self.history_slots.started[slot] = False

    def released(self, slot: int) -> None:
        self.history_slots.on_host[slot] = False

    def reset(self, idx: torch.Tensor, fresh: torch.Tensor) -> None:
        """Request slots ``idx`` (compact-slot entries ``fresh``) start with nothing recorded."""
        self.history_slots.reset(idx, fresh)
        if self.copy_prev is not None:
            self.copy_prev.index_fill_(0, fresh, 0)

    def rows(self, step, sfi_rows: torch.Tensor, sfi_on: torch.Tensor, sfi_slot_of: torch.Tensor,
             requested: torch.Tensor) -> torch.Tensor:
        """Record the step's input tokens in the history, then flag the decode rows whose last
        tokens repeat an earlier span. A request with SFI on (``requested``) and a compact slot
        records from its first chunk, whether or not it holds its compact blocks yet; its rows match
        (and advance ``copy_once``'s state) while ``sfi_on`` (SFI on and its compact blocks held). A
        row whose request lacks the history pages of its step neither records nor matches
        (:mod:`vllm_ext.methods.sfi.history_slots`)."""
        cfg, history_slots = self.cfg, self.history_slots
        num_rows = step.num_rows
        slot = step.row_slot.long()
        sfi_slot = sfi_slot_of[slot]
        hist_slot, row_from = history_slots.plan_rows(step, requested[slot] & (sfi_slot >= 0), sfi_slot)
        seq_lens = step.seq_lens[:num_rows]
        history_slots.backfill(step, hist_slot)
        if step.is_real and step.num_reqs and step.input_ids is not None:
            if step.host_geometry is not None and not bool(step.row_is_decode_np[:step.num_reqs].all()):
                qsl = step.host_geometry[0]
                max_q_len = int((qsl[1:step.num_reqs + 1] - qsl[:step.num_reqs]).max())
            else:
                max_q_len = 1                       # decode rows: one input token each
            record_tokens(self.history, step.input_ids, step.query_start_loc, seq_lens,
                          hist_slot[:step.num_reqs], max_q_len)
        active = sfi_rows * sfi_on[slot].to(sfi_rows.dtype)
        return copy_match(self.history, seq_lens, hist_slot, active, self.row_copy[:num_rows],
                          n_sink=cfg.n_sink, n_recent=cfg.n_recent, ngram=cfg.resolved_copy_ngram,
                          max_matches=cfg.copy_max_matches, prev=self.copy_prev, row_from=row_from)
