"""SPEEDSFI's environment variables, and their deprecated ``VLLM_EXT_*`` names.

vLLM warns about every ``VLLM_*`` variable it does not know ("Unknown vLLM environment variable
detected"), so ours start with ``SPEEDSFI_``. The deprecated ``VLLM_EXT_*`` names work too, with a
deprecation note logged once per process; the ``SPEEDSFI_`` name wins when both are set. vLLM's Ray executor
copies only ``VLLM_*`` (and a few other) variables to its actors, so ``register()`` adds the
``SPEEDSFI_`` prefix to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (:func:`forward_to_ray`)."""

from __future__ import annotations

import logging
import os

PREFIX = "SPEEDSFI_"
TRACE_DIR = "SPEEDSFI_TRACE_DIR"                  # where every process writes its counters
TRACE_INTERVAL_S = "SPEEDSFI_TRACE_INTERVAL_S"    # at most one write per interval (plus a trailing one)
LOG_INTERVAL_S = "SPEEDSFI_LOG_INTERVAL_S"        # the counters' summary in the log
ROW_COUNTERS = "SPEEDSFI_ROW_COUNTERS"            # rows per path per step, a diagnostic
OLD_NAMES = {TRACE_DIR: "VLLM_EXT_TRACE_DIR", TRACE_INTERVAL_S: "VLLM_EXT_TRACE_INTERVAL_S",
             LOG_INTERVAL_S: "VLLM_EXT_LOG_INTERVAL_S", ROW_COUNTERS: "VLLM_EXT_ROW_COUNTERS"}
RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
_noted: set[str] = set()


def get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is not None:
        return value
    old = OLD_NAMES.get(name)
    if old is not None and old in os.environ:
        if old not in _noted:
            _noted.add(old)
            logging.getLogger("vllm_ext").warning(
                "vllm_ext: %s is deprecated (vLLM warns about unknown VLLM_* variables); use %s", old, name)
        return os.environ[old]
    return default


def forward_to_ray() -> None:
    """Make vLLM's Ray executor copy ``SPEEDSFI_*`` variables to its actors too."""
    prefixes = [p.strip() for p in os.environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if PREFIX not in prefixes:
        os.environ[RAY_PREFIXES] = ",".join([*prefixes, PREFIX])
