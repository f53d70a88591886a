"""A decode step's SFI plan with the row modes forced (``"slow"``, ``"fast"``, ``"dense"``), as the
slot tables would plan it for rows of lengths ``lens``: slot ``i`` for sparse row ``i``, the budget
``k``, the recent window and the allowed set after the sink; with ``sfi.keep_prefill`` each live slow
entry keeps its prefill tokens and selects the rest of its budget (what ``SfiSlotTables.plan`` adds);
with the Quest selector a selecting row also attends fast in its step."""

import torch

from vllm_ext.methods.sfi.step_plan import write_plan


def forced_step(buffers, cfg, modes, lens, block_table):
    rows = len(modes)
    t = torch.tensor(lens, dtype=torch.int32)
    slow = torch.tensor([m == "slow" for m in modes])
    fast = torch.tensor([m == "fast" for m in modes])
    if cfg.selector == "quest":
        fast = fast | slow
    sparse = slow | fast
    step = write_plan(buffers, rows, slow=slow, fast=fast, sparse=sparse,
                      row_sfi_slot=torch.where(sparse, torch.arange(rows, dtype=torch.int32), 0),
                      k=torch.full_like(t, cfg.k), recent_start=torch.clamp(t - cfg.n_recent, min=0),
                      lo=torch.full_like(t, cfg.n_sink),
                      hi=torch.clamp(t - cfg.n_recent, min=cfg.n_sink), t=t, block_table=block_table)
    if cfg.keep_prefill:
        live = step.slow_sfi_slot >= 0
        step.slow_kept.copy_(torch.where(live, cfg.keep_prefill, 0))
        step.slow_k.sub_(step.slow_kept)
    return step, t
