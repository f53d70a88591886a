"""``sfi.maintenance_rows`` left unset: the slow-step scratch takes about ``MAINTENANCE_BUDGET_BYTES``
at ``max_model_len`` (never fewer than 16 rows), resolved once at start-up for the served model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_ext.methods.sfi.method import resolve_maintenance_rows  # noqa: E402
from vllm_ext.config import SpeedSfiConfig  # noqa: E402
from vllm_ext.methods.sfi.config import (MAINTENANCE_BUDGET_BYTES, MIN_MAINTENANCE_ROWS, SfiConfig,  # noqa: E402
                                         auto_maintenance_rows, maintenance_row_bytes)
from vllm_ext.methods.sfi.step_plan import maintenance_chunk  # noqa: E402

QWEN3_4B = dict(num_heads=32, num_kv_heads=8)


def _vllm_config(max_len, heads=32, kv_heads=8):
    model = SimpleNamespace(max_model_len=max_len, get_num_attention_heads=lambda parallel: heads,
                            get_num_kv_heads=lambda parallel: kv_heads)
    return SimpleNamespace(model_config=model, parallel_config=None)


def test_row_bytes_match_the_runtimes_formula():
    # docs/sfi.md: 52.4 MiB per row for Qwen3-4B at L 131072 with the ring's 4 slots (the selector's
    # smaller tables left out of the estimate)
    row = maintenance_row_bytes(**QWEN3_4B, max_len=131072, ring_slots=4)
    assert row == 4 * 131072 * (9 * 8 + 32)
    assert 50 << 20 < row < 53 << 20


@pytest.mark.parametrize("max_len", [2048, 8192, 32768, 131072, 1 << 20])
def test_auto_rows_fill_the_budget_and_never_fall_below_the_floor(max_len):
    rows = auto_maintenance_rows(**QWEN3_4B, max_len=max_len, ring_slots=4)
    row = maintenance_row_bytes(**QWEN3_4B, max_len=max_len, ring_slots=4)
    assert rows >= MIN_MAINTENANCE_ROWS
    if rows > MIN_MAINTENANCE_ROWS:
        assert rows * row <= MAINTENANCE_BUDGET_BYTES < (rows + 1) * row
    else:
        assert (MIN_MAINTENANCE_ROWS + 1) * row > MAINTENANCE_BUDGET_BYTES


def test_shorter_contexts_get_more_rows():
    rows = [auto_maintenance_rows(**QWEN3_4B, max_len=n, ring_slots=4) for n in (8192, 32768, 131072)]
    assert rows[0] > rows[1] > rows[2] >= MIN_MAINTENANCE_ROWS


def test_start_up_resolves_the_unset_field_for_the_served_model_and_logs_it(caplog):
    cfg = SpeedSfiConfig.from_dict({"preset": "sfi"})
    assert cfg.sfi.maintenance_rows is None
    with caplog.at_level(logging.INFO, logger="vllm_ext"):
        gpu = resolve_maintenance_rows(cfg, _vllm_config(32768), on_cpu=False)
        cpu = resolve_maintenance_rows(cfg, _vllm_config(32768), on_cpu=True)
    assert gpu == auto_maintenance_rows(**QWEN3_4B, max_len=32768, ring_slots=cfg.sfi.side_stream_slots)
    assert cpu == auto_maintenance_rows(**QWEN3_4B, max_len=32768, ring_slots=1)   # no side stream
    assert any("maintenance_rows unset" in r.getMessage() for r in caplog.records)


def test_an_explicit_value_is_kept_and_capped_by_the_capacity():
    cfg = SfiConfig(enabled=True, maintenance_rows=3)
    assert maintenance_chunk(cfg, 64) == 3 and maintenance_chunk(cfg, 2) == 2
    # unset outside vLLM (benchmarks, kernel tests): the floor
    assert maintenance_chunk(SfiConfig(enabled=True), 64) == MIN_MAINTENANCE_ROWS
