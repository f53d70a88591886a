"""Per-process counters of the SPEEDSFI backend.

Counters are plain host integers bumped where the host already decides something (once per layer
call or per step, never per token). ``VLLM_EXT_TRACE_DIR`` (the ``VLLM_`` prefix makes Ray forward it)
makes every process write its counters to ``$VLLM_EXT_TRACE_DIR/trace-<pid>.json`` at most every
``VLLM_EXT_TRACE_INTERVAL_S`` seconds (default 0: on every update; for tests and the demo), so a
test or the demo can prove which backend ran inside the worker processes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter

COUNTS: Counter = Counter()
_lock = threading.Lock()
_last_flush = 0.0
_logged_once: set[str] = set()
logger = logging.getLogger("vllm_ext")


def bump(key: str, n: int = 1) -> None:
    with _lock:
        COUNTS[key] += n
    _maybe_flush()


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(COUNTS)


def reset() -> None:
    with _lock:
        COUNTS.clear()


def fallback(key: str, message: str, *args) -> None:
    """Count a fallback and log it once per process and key (never silently degrade)."""
    bump(f"fallback.{key}")
    if key not in _logged_once:
        _logged_once.add(key)
        logger.warning("vllm_ext fallback [%s]: " + message, key, *args)


def _maybe_flush() -> None:
    global _last_flush
    trace_dir = os.environ.get("VLLM_EXT_TRACE_DIR")
    if not trace_dir:
        return
    now = time.monotonic()
    if now - _last_flush < float(os.environ.get("VLLM_EXT_TRACE_INTERVAL_S", "0")):
        return
    _last_flush = now
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"trace-{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot(), f)
    os.replace(tmp, path)


def read_traces(trace_dir: str) -> dict[int, dict[str, int]]:
    """All processes' counters in ``trace_dir``: pid -> counters."""
    out = {}
    if not os.path.isdir(trace_dir):
        return out
    for name in os.listdir(trace_dir):
        if name.startswith("trace-") and name.endswith(".json"):
            with open(os.path.join(trace_dir, name)) as f:
                out[int(name[6:-5])] = json.load(f)
    return out
