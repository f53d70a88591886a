"""CritiPrefill's section of the configuration (``speedsfi.critiprefill``; ALGORITHMS.md §3).

The defaults are the authors' published code (docs/ALGORITHMS.md §3 says where it departs from the
paper's text): its score and fusion, its default budget (2048 keys), no forced sink block, and its
``threshold_len`` (here ``min_len``) read as the position where sparse segments begin."""

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
    budget: int = 2048                 # keys each sparse segment selects (budget // block_size blocks)
    alpha: float = 0.25
    fusion: Literal["ema", "paper", "sum"] = "ema"
    score: Literal["code", "paper"] = "code"
    # the authors' threshold_len: segments starting before this position attend densely, whatever
    # the prompt's length (and the prompt's final segment always does)
    min_len: int = 4096
    sink_block: bool = False           # also select block 0 in every sparse segment
    dense_layers: tuple[int, ...] = (0,)
    # system: an optional upper bound on the prompts in a sparse prefill at once (the others wait in
    # vLLM's queue: sched.critiprefill_admission_waits). None (default): no bound of ours; each
    # prompt's state is KV-cache pages that vLLM's block manager allocates
    # (vllm_ext.methods.critiprefill.kv_spec, docs/per_request_memory.md).
    max_requests: int | None = None

    @property
    def selected_blocks(self) -> int:
        """Blocks a sparse segment reads before its own keys: the top ``budget // block_size``, and
        block 0 with ``sink_block``."""
        return self.budget // self.block_size + int(self.sink_block)

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
