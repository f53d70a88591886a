"""``scripts/first_hour.py`` (not run here: it takes over an hour) reads the two README commands'
output into what ``scripts/write_figures.py``'s ``first_hour`` block needs, with the skips grouped
by their reasons and the demo's batch section; the reader's environment it runs them in carries none
of this shell's venv or project variables."""

from __future__ import annotations

import importlib.util
import json

from tests import doc_blocks

_spec = importlib.util.spec_from_file_location("first_hour", doc_blocks.ROOT / "scripts" / "first_hour.py")
first_hour = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_hour)
_spec = importlib.util.spec_from_file_location("write_figures", doc_blocks.ROOT / "scripts" / "write_figures.py")
write_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(write_figures)

DEMO = """[demo] model: .cache/real_model/SmolLM2-135M-Instruct (30 layers; vllm_ext.tools.real_model)
[demo] server healthy after 31.2 s (server start)
[demo] dense: answer 'The spare key to the lighthouse kept is in the locker number 9186.'  correct: yes
[demo] sfi: answer 'The spare key to the lighthouse kept is in the locker number 9186.'  correct: yes
[demo] server healthy after 30.9 s (server start)
[demo] critiprefill: answer 'The spare key to the lighthouse kept in the locker named'  correct: no
[demo] summary: SmolLM2-135M-Instruct, a 4,994-token document question, greedy, expected answer 9186
[demo] batch: 4 requests of 3,500 prompt tokens decoding together, 64 steps timed per run (thread CPU time, one OpenMP thread), float32; SFI off for them, then the `sfi` preset
[demo] batch progress: SFI off: decode step 12 of 64 (130 s)
[demo]     run          tokens/s  ms a step  wall tokens/s  slow  fast  KV read
[demo]     SFI off          11.2        357            9.8     0     0    1.000
[demo]     sfi preset        9.6        417            8.1    41   215    0.334
"""
TESTS = """SKIPPED [1040] tests/kernels/test_x.py:12: needs a CUDA GPU
SKIPPED [7] tests/kernels/test_y.py:40: no GPU here
SKIPPED [6] tests/kernels/test_amx.py:9: this CPU has no AMX tiles
SKIPPED [2] tests/test_z.py:3: the real model is not built
1470 passed, 1055 skipped, 3 warnings in 3400.00s (0:56:40)
[run_tests] wall time 58 min 10 s: set-up 1 min 02 s, pytest 57 min 08 s (exit status 0)
"""


def test_demo_output_is_read():
    d = first_hour.parse_demo(DEMO)
    assert d["document_tokens"] == 4994
    assert d["correct"] == {"dense": True, "sfi": True, "critiprefill": False}
    assert d["servers"] == 2                                  # dense asked of SFI's server
    b = d["batch"]
    assert (b["requests"], b["prompt_tokens"], b["timed_steps"], b["dtype"]) == (4, 3500, 64, "float32")
    assert b["runs"]["SFI off"]["tokens_s"] == 11.2 and b["runs"]["sfi preset"]["kv_read"] == 0.334
    assert b["runs"]["sfi preset"]["slow_row_steps"] == 41


def test_suite_output_is_read_with_its_skip_reasons():
    t = first_hour.parse_tests(TESTS)
    assert (t["passed"], t["skipped"], t["failed"]) == (1470, 1055, 0)
    assert t["skipped_for"] == {"a GPU": 1047, "AMX": 6, "the real model": 2}
    assert sum(t["skip_reasons"].values()) == t["skipped"]
    assert t["run_tests_line"].startswith("58 min 10 s")


def test_the_figure_reads_what_it_writes(monkeypatch):
    result = {"machine": "2-core AMD EPYC", "date": "2026-11-28", "commit": "abcdef0",
              "demo": {"wall_s": 900, **first_hour.parse_demo(DEMO)},
              "tests": {"wall_s": 3490, **first_hour.parse_tests(TESTS)}}
    monkeypatch.setattr(write_figures, "_result_text", lambda name: json.dumps(result))
    text = write_figures.first_hour()
    assert "a 4,994-token logbook" in text and "Dense and SFI find the locker number" in text
    assert "4 requests of 3,500 prompt tokens" in text and "SFI off 11.2 tokens/s, the preset 9.6 (0.86x)" in text
    assert "1470 passed, 0 failed, 1055 skipped: 1047 for want of a GPU; 6 for want of AMX" in text
    assert "commit abcdef0" in text
    assert "twice (the `sfi` preset, asked also with SFI off for the request: dense;" in text
    result["demo"]["servers"] = 3                             # the demo before dense shared SFI's server
    assert "three times (dense, the `sfi` preset, CritiPrefill)" in write_figures.first_hour()


def test_reader_env_drops_this_shells_setup(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("VIRTUAL_ENV", str(doc_blocks.ROOT / ".venv"))
    monkeypatch.setenv("SPEEDSFI_TRACE_DIR", "/tmp/x")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("PATH", f"{doc_blocks.ROOT / '.venv' / 'bin'}:/usr/bin")
    env = first_hour.reader_env(tmp_path)
    assert not [k for k in env if k.startswith(("VIRTUAL_ENV", "VLLM_", "SPEEDSFI_")) and k not in
                ("VLLM_CACHE_ROOT", "SPEEDSFI_CPU_KERNEL_CACHE")]
    assert env["PATH"] == "/usr/bin"
    assert env["SPEEDSFI_CPU_KERNEL_CACHE"].startswith(str(tmp_path))          # cold caches
    assert env["PIP_CACHE_DIR"].startswith(str(tmp_path))
    assert "XDG_CACHE_HOME" not in first_hour.reader_env(None)                  # --warm-caches
