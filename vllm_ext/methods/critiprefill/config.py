"""CritiPrefill's section of the configuration (``speedsfi.critiprefill``; ALGORITHMS.md §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_ext.config_fields import ConfigError, in_unit, non_negative, positive


@dataclass(frozen=True)
class CritiPrefillConfig:
    """CritiPrefill, segment-wise criticality for prefill (ALGORITHMS.md §3)."""

    enabled: bool = False
    segment_size: int = 512
    block_size: int = 32
    budget: int = 1024                 # keys per query segment
    alpha: float = 0.25
    fusion: Literal["paper", "ema"] = "paper"
    score: Literal["paper", "code"] = "paper"
    min_len: int = 4096                # shorter prompts prefill densely
    dense_layers: tuple[int, ...] = (0,)
    # system: an optional upper bound on the prompts in a sparse prefill at once (the others wait in
    # vLLM's queue: sched.critiprefill_admission_waits). None (default): no bound of ours; each
    # prompt's state is KV-cache pages that vLLM's block manager allocates
    # (vllm_ext.methods.critiprefill.kv_spec, docs/per_request_memory.md).
    max_requests: int | None = None

    def validate(self) -> None:
        for name in ("segment_size", "block_size", "budget"):
            positive(f"critiprefill.{name}", getattr(self, name))
        non_negative("critiprefill.min_len", self.min_len)
        in_unit("critiprefill.alpha", self.alpha)
        if self.max_requests is not None:
            positive("critiprefill.max_requests", self.max_requests)
        if self.segment_size % self.block_size:
            raise ConfigError(f"speedsfi.critiprefill.segment_size ({self.segment_size}) must be a "
                              f"multiple of critiprefill.block_size ({self.block_size})")
        if self.budget % self.block_size:
            raise ConfigError(f"speedsfi.critiprefill.budget ({self.budget}) must be a multiple of "
                              f"critiprefill.block_size ({self.block_size})")
        for layer in self.dense_layers:
            non_negative("critiprefill.dense_layers[]", layer)
