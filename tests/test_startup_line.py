"""The start-up line: one INFO line in vLLM's log that says what the engine runs (backend, preset,
methods on, their key settings, the dense path), from the resolved configuration, once per engine."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from vllm_ext.backend.startup import STARTUP_LOGGER, Engine, describe
from vllm_ext.config import SpeedSfiConfig


def _resolved(raw: dict, **sfi) -> SpeedSfiConfig:
    cfg = SpeedSfiConfig.from_dict(raw)
    return dataclasses.replace(cfg, sfi=dataclasses.replace(cfg.sfi, **sfi)) if sfi else cfg


def test_the_sfi_preset_on_the_cpu_build():
    line = describe(_resolved({"preset": "sfi"}, maintenance_rows=48), num_layers=30, on_cpu=True)
    assert line.startswith("SPEEDSFI attention backend: preset sfi; methods on: sfi; ")
    for setting in ("k=1024", "n_sink=4", "n_recent=128", "min_len=2312", "refresh=32 (warm-up)",
                    "schedule=boundary", "selector=sfi", "keep_prefill=512", "copy_ngram=2",
                    "maintenance_rows=48"):
        assert f" {setting}" in line, setting
    assert line.endswith("; dense rows: CPU_ATTN (CPU build)")
    assert "speed" not in line and "critiprefill" not in line
    assert "\n" not in line


def test_explicit_fields_over_the_preset_are_what_the_line_shows():
    line = describe(_resolved({"preset": "sfi", "sfi": {"k": 768, "min_len": 0}}), num_layers=30, on_cpu=True)
    assert " k=768 " in line and " min_len=0 " in line and "preset sfi" in line
    quest = describe(_resolved({"sfi": {"enabled": True, "k": 256, "selector": "quest", "page_size": 32}}),
                     num_layers=30, on_cpu=True)
    assert " selector=quest page_size=32 " in quest


def test_every_method_with_the_model_resolved_settings():
    line = describe(_resolved({"preset": "all"}), num_layers=30, on_cpu=True)
    assert "methods on: speed, sfi, critiprefill" in line
    assert "speed l_cut=22 of 30 layers variant=speed" in line           # 3/4 of 30, rounded down
    assert "critiprefill budget=2048 segment_size=512 block_size=32 min_len=4096 dense_layers=0" in line
    explicit = describe(_resolved({"speed": {"enabled": True, "l_cut": 5}}), num_layers=8, on_cpu=True)
    assert "speed l_cut=5 of 8 layers" in explicit and "no preset" in explicit


def test_every_method_off():
    line = describe(_resolved({}), num_layers=2, on_cpu=True)
    assert line == ("SPEEDSFI attention backend: no preset; methods on: none (every row dense); "
                    "dense rows: CPU_ATTN (CPU build)")


@pytest.mark.parametrize("raw, dense", [
    ({}, "dense rows: TRITON_ATTN (dense_delegate triton), dense decode rows: TRITON_ATTN"),
    ({"preset": "sfi"}, "dense rows: TRITON_ATTN (dense_delegate triton), dense decode rows: paged_decode"),
    ({"dense_delegate": "flash_attn", "dense_decode": "paged_decode"},
     "dense rows: FLASH_ATTN (dense_delegate flash_attn), dense decode rows: paged_decode"),
])
def test_the_dense_path_on_cuda(raw, dense):
    assert describe(_resolved(raw), num_layers=36, on_cpu=False).endswith("; " + dense)


def _engine(rank: int, cfg: SpeedSfiConfig) -> Engine:
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: 2)
    return Engine(SimpleNamespace(parallel_config=SimpleNamespace(rank=rank), model_config=model), cfg)


def test_logged_once_per_engine_at_info_in_vllms_log():
    """Every caller in the worker asks the engine to announce itself; the line is logged once, by the
    first worker (rank 0), through a logger under vLLM's (its handler and format)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger(STARTUP_LOGGER)
    assert logger.name.startswith("vllm.")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)          # what vLLM's logging set-up gives its loggers in an engine
    try:
        first, other_rank = _engine(0, _resolved({})), _engine(1, _resolved({}))
        for _ in range(3):
            first.announce()
            other_rank.announce()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    assert records[0].getMessage() == describe(_resolved({}), num_layers=2, on_cpu=current_platform.is_cpu())
