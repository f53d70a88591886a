"""SPEED's section of the configuration (``speedsfi.speed``; ALGORITHMS.md §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_ext.config_fields import positive


@dataclass(frozen=True)
class SpeedConfig:
    """SPEED, shallow prefill / deep decode (ALGORITHMS.md §2)."""

    enabled: bool = False
    l_cut: int | None = None           # lower layers 0..l_cut-1; None = 3/4 of the model's layers
    anchor: Literal["bos", "none"] = "bos"
    variant: Literal["speed", "self_only"] = "speed"

    def validate(self) -> None:
        if self.l_cut is not None:
            positive("speed.l_cut", self.l_cut)

    def resolved_l_cut(self, num_layers: int) -> int:
        return self.l_cut if self.l_cut is not None else max(1, (3 * num_layers) // 4)
