"""SPEEDSFI's families on vLLM's /metrics follow Prometheus conventions: counters end in ``_total``,
units in the names, gauges for the slots in use, a histogram of the retained fraction whose buckets
are cumulative and whose +Inf bucket and count are the fast row-steps. Rendered by prometheus_client
(vLLM's exporter) from a trace directory as the engine's processes write it."""

import json

import pytest

from vllm_ext import metrics

prometheus_client = pytest.importorskip("prometheus_client")


def _scrape(trace_dir, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("SPEEDSFI_TRACE_DIR", str(trace_dir))
    monkeypatch.setattr(metrics, "snapshot", lambda: {})           # this process adds nothing
    reg = CollectorRegistry()
    reg.register(metrics.PrometheusCollector())
    text = generate_latest(reg).decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def test_families_from_two_processes(tmp_path, monkeypatch):
    engine = {"slots.acquired": 7, "slots.released": 4, "sfi.slots_assigned": 5, "sfi.slots_released": 3,
              "sfi.fast_steps": 10, "sfi.fast_retained_tokens": 300, "sfi.fast_context_tokens": 6000,
              "sfi.fast_retained_fraction_le_1pct": 0, "sfi.fast_retained_fraction_le_2pct": 1,
              "sfi.fast_retained_fraction_le_5pct": 6, "sfi.fast_retained_fraction_le_10pct": 8,
              "sfi.fast_retained_fraction_le_20pct": 9, "sfi.fast_retained_fraction_le_50pct": 9,
              "sfi.fast_retained_fraction_sum_ppm": 612_500, "speed.blocks_saved": 42,
              "fallback.sfi_capacity": 2}
    worker = {"sfi.fast_steps": 2, "sfi.fast_retained_fraction_le_50pct": 1,
              "sfi.fast_retained_fraction_le_20pct": 1, "sfi.fast_retained_fraction_sum_ppm": 150_000}
    for pid, counts in ((11, engine), (12, worker)):
        (tmp_path / f"trace-{pid}.json").write_text(json.dumps(counts))
    text, fams = _scrape(tmp_path, monkeypatch)

    assert 'speedsfi_events_total{event="fallback.sfi_capacity"} 2.0' in text
    assert "fraction_le" not in text and "sum_ppm" not in text      # only inside the histogram
    assert fams["speedsfi_request_slots_in_use"].type == "gauge"
    assert fams["speedsfi_request_slots_in_use"].samples[0].value == 3
    assert fams["speedsfi_sfi_slots_in_use"].samples[0].value == 2
    assert "speedsfi_sfi_fast_retained_tokens_total 300.0" in text
    assert "speedsfi_sfi_fast_context_tokens_total 6000.0" in text
    assert "speedsfi_speed_kv_blocks_saved_total 42.0" in text

    hist = fams["speedsfi_sfi_fast_retained_fraction"]
    assert hist.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in hist.samples if s.name.endswith("_bucket")]
    assert buckets == [("0.01", 0), ("0.02", 1), ("0.05", 6), ("0.1", 8), ("0.2", 10), ("0.5", 10),
                       ("+Inf", 12)]
    by_name = {s.name: s.value for s in hist.samples}
    assert by_name["speedsfi_sfi_fast_retained_fraction_count"] == 12
    assert by_name["speedsfi_sfi_fast_retained_fraction_sum"] == pytest.approx(0.7625)


def test_no_sfi_no_histogram(tmp_path, monkeypatch):
    (tmp_path / "trace-1.json").write_text(json.dumps({"steps.built": 5}))
    text, fams = _scrape(tmp_path, monkeypatch)
    assert "speedsfi_sfi_fast_retained_fraction" not in fams
    assert fams["speedsfi_sfi_slots_in_use"].samples[0].value == 0
    assert 'speedsfi_events_total{event="steps.built"} 5.0' in text
