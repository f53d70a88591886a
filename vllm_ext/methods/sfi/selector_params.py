"""The selector kernels' constants from SFI's configuration."""

from __future__ import annotations

import dataclasses

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.selector_params import SelectorParams


def selector_params(cfg: SfiConfig) -> SelectorParams:
    """The fields of ``cfg`` that the selector reads, under the same names."""
    return SelectorParams(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(SelectorParams)})
