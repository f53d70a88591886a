"""The share of the KV that SFI's fast decode steps read for the requests made inside a ``with``
block, from SPEEDSFI's counters, read once those requests' counters have landed.

    with KVRead() as kv:                          # offline: the engine this process started (LLM)
        llm.chat(messages, params)
    with KVRead("http://localhost:8000") as kv:   # a server: its /metrics
        client.chat.completions.create(...)
    print(kv.share, kv)                           # 0.231  "23.1 % of the KV on 14 fast steps (5 slow)"

The counters are SPEEDSFI's (``vllm_ext.metrics``): ``sfi.fast_retained_tokens`` over
``sfi.fast_context_tokens`` between entering and leaving the block, i.e. what the fast steps read
over what a dense step would have read; slow steps read all of it and are counted apart. Each
process writes its counters at most every ``SPEEDSFI_TRACE_INTERVAL_S`` (1 s unless set), and a
request's last counters are bumped when its slot is released after its last token; leaving the
block waits until ``requests`` more slots have been released, so the share covers the whole of
those requests. Nothing else should run on the engine meanwhile: the counters are engine-wide.
"""

from __future__ import annotations

import re
import time
import urllib.request

_EVENT = re.compile(r'^speedsfi_events_total\{event="([^"]+)"\}\s+(\S+)', re.M)


def metrics_counters(base_url: str) -> dict[str, int]:
    """SPEEDSFI's counters as a server's ``/metrics`` exports them (``speedsfi_events_total``)."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {key: int(float(value)) for key, value in _EVENT.findall(text)}


def engine_counters() -> dict[str, int]:
    """SPEEDSFI's counters summed over this process and the engine processes it started (the
    counter files under ``SPEEDSFI_TRACE_DIR``, which the plugin sets when vLLM loads it)."""
    from vllm_ext import metrics

    return metrics.totals()


class KVRead:
    """Counters before and after a ``with`` block (module docstring). ``server``: a server's base
    URL (its ``/metrics``); ``None``: this process's engine."""

    def __init__(self, server: str | None = None, *, requests: int = 1, timeout_s: float = 60.0):
        self.server, self.requests, self.timeout_s = server, requests, timeout_s
        self.counters: dict[str, int] = {}        # what changed inside the block

    def _read(self) -> dict[str, int]:
        return metrics_counters(self.server) if self.server else engine_counters()

    def __enter__(self) -> "KVRead":
        self._before = self._read()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            after = self._read()
            released = after.get("slots.released", 0) - self._before.get("slots.released", 0)
            if released >= self.requests:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SPEEDSFI's counters show {released} of {self.requests} request(s) finished "
                    f"{self.timeout_s:.0f} s after the block (is the engine SPEEDSFI's, and its "
                    "counters directory shared: SPEEDSFI_TRACE_DIR?)")
            time.sleep(0.2)
        self.counters = {k: v - self._before.get(k, 0) for k, v in after.items()
                         if v != self._before.get(k, 0)}

    @property
    def fast_steps(self) -> int:
        return self.counters.get("sfi.fast_steps", 0)

    @property
    def slow_steps(self) -> int:
        return self.counters.get("sfi.slow_steps", 0)

    @property
    def share(self) -> float | None:
        """Retained over context tokens of the fast decode steps; ``None`` without a fast step (SFI
        off, or every row below ``min_len``: they read all of the KV)."""
        context = self.counters.get("sfi.fast_context_tokens", 0)
        return self.counters.get("sfi.fast_retained_tokens", 0) / context if context else None

    def __str__(self) -> str:
        if self.share is None:
            return f"all of the KV (no fast step; {self.slow_steps} slow)"
        return (f"{self.share:.1%} of the KV on {self.fast_steps} fast steps "
                f"({self.slow_steps} slow, which read all of it)")
