"""Host-to-device staging of small per-step arrays (the host plans, the device reads)."""

from __future__ import annotations

import torch


class PinnedStaging:
    """A host buffer (pinned when the device is CUDA) and its device twin; copies are non-blocking.

    Writes to the host side must only happen while the runner guarantees that the previous step's
    copy has completed (vLLM's ``synchronize_input_prep`` window, where these are written).
    """

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        # explicit device: vLLM builds attention layers under a default-device context (CUDA), and a
        # pinned buffer must be a CPU tensor
        self.cpu = torch.zeros(n, dtype=dtype, device="cpu", pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(n, dtype=dtype, device=device)

    def copy_to_device(self, n: int) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]
