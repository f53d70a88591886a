"""Rows computed per attention path, per layer call: what shows that a step computes every row once
(``SPEEDSFI_ROW_COUNTERS=1``; off by default, when nothing here runs).

Counters (``vllm_ext.metrics`` snapshot keys, summed over layers and steps):

* ``rows.layer``: rows of the layer calls (decode rows of a FULL CUDA graph include its padding);
* ``rows.delegate``: rows the dense path attended (CUDA: vLLM's Triton delegate, with its metadata
  cut to the rows it owns; CPU: ``CPU_ATTN``'s kernel or ``paged_reference``, whose pass skips the
  rows whose output SFI writes);
* ``rows.paged_decode``: decode rows attended by our dense split-K ``paged_decode`` (SFI's dense rows
  on CUDA, or every decode row with ``speedsfi.dense_decode = "paged_decode"``);
* ``rows.sfi_slow``: rows whose output SFI's slow pass (dense + evidence) wrote (on the CPU build
  with the PyTorch twins the dense pass attends the slow rows and SFI's pass scores them only:
  ``rows.delegate``);
* ``rows.sfi_fast``: rows whose output SFI's two-segment pass wrote (with the Quest selector its
  selection rows too);
* ``rows.critiprefill``: rows of CritiPrefill's block-sparse sub-batch.

Each row of a layer call is written by exactly one path, so ``rows.layer`` equals the sum of the
others (``tests/test_sfi_mixed_steps.py`` and the engine test check it on mixed steps). The counts
live in a device tensor (:class:`vllm_ext.device_counters.DeviceCounters`): SFI's masks are added
on the device (graph-capturable, no host synchronisation), host-known counts as scalars; the
metadata builder publishes once per step. Torch only (no vLLM).
"""

from __future__ import annotations

import os

import torch

from vllm_ext import env_vars

from vllm_ext.device_counters import DeviceCounters

ENV = "SPEEDSFI_ROW_COUNTERS"
KEYS = ("rows.layer", "rows.delegate", "rows.paged_decode", "rows.sfi_slow", "rows.sfi_fast",
        "rows.critiprefill")
LAYER, DELEGATE, PAGED_DECODE, SFI_SLOW, SFI_FAST, CRITIPREFILL = range(len(KEYS))


def enabled() -> bool:
    return (env_vars.get(ENV) or "0").strip().lower() not in ("", "0", "false", "no", "off")


class RowCounters:
    def __init__(self, device: torch.device):
        self.counters = DeviceCounters(len(KEYS), device)

    def add(self, i: int, n) -> None:
        """Add ``n`` rows to counter ``i``: a host int, or a bool mask / int tensor (summed on its
        device)."""
        if isinstance(n, torch.Tensor):
            n = n.sum() if n.dim() else n
            self.counters.values[i:i + 1].add_(n.to(torch.int64))
        elif n:
            self.counters.values[i:i + 1].add_(int(n))

    def add_sfi(self, dense: torch.Tensor | None, slow: torch.Tensor | None,
                fast: torch.Tensor) -> None:
        """A call of SFI's decode path (the plan's masks of its rows): ``dense`` (None when the dense path already
        wrote the dense rows) to ``paged_decode``; slow rows that are not also fast (Quest's selection
        rows are written by the fast pass) to ``sfi_slow`` (``slow`` None when the dense path wrote
        them: the CPU build); fast rows to ``sfi_fast``. (The layer call's rows are counted once, by
        the impl.)"""
        if dense is not None:
            self.add(PAGED_DECODE, dense)
        if slow is not None:
            self.add(SFI_SLOW, slow & ~fast)
        self.add(SFI_FAST, fast)

    def publish(self) -> None:
        self.counters.publish()

    def read(self) -> dict[str, int]:
        return dict(zip(KEYS, self.counters.read()))


def counters_if_enabled(device: torch.device) -> RowCounters | None:
    """New counters on ``device`` when ``SPEEDSFI_ROW_COUNTERS`` is on, else None. Merged into
    ``vllm_ext.metrics.snapshot()``."""
    if not enabled():
        return None
    rc = RowCounters(torch.device(device))
    from vllm_ext import metrics

    metrics.add_provider(f"row_counters:{torch.device(device)}", rc.read)
    return rc
