"""A process's counters reach its trace file within one write interval of the last bump, with no
later bump (the trailing write of ``vllm_ext.metrics``): the counters a request bumps last, when
vLLM hands it back after its last token, are current on ``/metrics`` while the server is idle."""

from __future__ import annotations

import json
import os
import time

from vllm_ext import metrics


def _written(trace_dir) -> dict:
    path = trace_dir / f"trace-{os.getpid()}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_the_last_bump_is_written_within_the_interval(tmp_path, monkeypatch):
    interval = 0.3
    monkeypatch.setenv("SPEEDSFI_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("SPEEDSFI_TRACE_INTERVAL_S", str(interval))
    metrics.reset()
    monkeypatch.setattr(metrics, "_last_flush", 0.0)
    metrics.bump("test.first")                     # written at once: the last write is old
    assert _written(tmp_path) == {"test.first": 1}
    metrics.bump("test.last")                      # inside the interval: not written yet
    assert "test.last" not in _written(tmp_path)
    bumped = time.monotonic()
    deadline = bumped + interval + 2.0             # slack for a loaded machine
    while "test.last" not in _written(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _written(tmp_path) == {"test.first": 1, "test.last": 1}
    metrics.reset()


def test_no_trace_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEEDSFI_TRACE_DIR", raising=False)
    metrics.reset()
    metrics.bump("test.nothing")
    assert not list(tmp_path.iterdir())
    metrics.reset()
