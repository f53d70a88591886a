"""``vllm_ext.tools.kv_read`` (the README examples' share of the KV read): it reads a server's
``/metrics`` as exported, waits until the block's requests have released their slots before it takes
the counters (their last steps' counters land with the release), and reports the fast steps' share
of those requests alone."""

from __future__ import annotations

import io

import pytest

from vllm_ext import metrics
from vllm_ext.tools import kv_read


def test_metrics_text_is_read_as_exported(monkeypatch):
    counts = {"slots.released": 3, "sfi.fast_retained_tokens": 1200, "sfi.fast_context_tokens": 5000}
    from prometheus_client import CollectorRegistry, generate_latest

    class Families:
        def collect(self):
            yield from metrics.prometheus_families(counts)

    registry = CollectorRegistry()
    registry.register(Families())
    text = generate_latest(registry)
    monkeypatch.setattr(kv_read.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(text))
    assert kv_read.metrics_counters("http://x:1") == counts


def test_the_share_waits_for_the_requests_counters(monkeypatch):
    before = {"slots.released": 4, "sfi.fast_retained_tokens": 100, "sfi.fast_context_tokens": 400}
    landing = {"slots.released": 4, "sfi.fast_retained_tokens": 300, "sfi.fast_context_tokens": 1400,
               "sfi.fast_steps": 5}
    landed = {"slots.released": 5, "sfi.fast_retained_tokens": 400, "sfi.fast_context_tokens": 1900,
              "sfi.fast_steps": 6, "sfi.slow_steps": 2}
    reads = iter([before, landing, landing, landed])
    monkeypatch.setattr(kv_read, "engine_counters", lambda: next(reads))
    monkeypatch.setattr(kv_read.time, "sleep", lambda s: None)
    with kv_read.KVRead() as kv:
        pass
    assert kv.share == pytest.approx(300 / 1500)                  # the block's requests only, all of it
    assert (kv.fast_steps, kv.slow_steps) == (6, 2)
    assert str(kv) == "20.0% of the KV on 6 fast steps (2 slow, which read all of it)"


def test_no_fast_step_and_no_landing_are_said(monkeypatch):
    monkeypatch.setattr(kv_read, "engine_counters", lambda: {"slots.released": 1})
    monkeypatch.setattr(kv_read.time, "sleep", lambda s: None)
    with pytest.raises(TimeoutError, match="0 of 1 request"):
        with kv_read.KVRead(timeout_s=0):
            pass
    reads = iter([{"slots.released": 1}, {"slots.released": 2, "sfi.slow_steps": 1}])
    monkeypatch.setattr(kv_read, "engine_counters", lambda: next(reads))
    with kv_read.KVRead() as kv:
        pass
    assert kv.share is None and str(kv).startswith("all of the KV")
