"""Every benchmark runs in --smoke mode (tiny sizes, CPU, PyTorch twins) and writes its JSON with the
fields the GPU run reports; the plots are written too. Proves the bench logic without a GPU."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"speedsfi_bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _run(name, tmp_path, monkeypatch, *args):
    # parse_args sets SPEEDSFI_FORCE_TORCH_KERNELS; keep it scoped to this test
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    mod = _load(name)
    mod.main(["--smoke", "--out", str(tmp_path), *args])
    return mod


def _json(tmp_path, name):
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["env"]["gpu"], "every JSON names the GPU"
    assert data["smoke"] is True
    return data


def _png(tmp_path, name):
    p = tmp_path / f"{name}.png"
    assert p.exists() and p.stat().st_size > 1000


def test_bench_fast_step_smoke(tmp_path, monkeypatch):
    _run("bench_fast_step", tmp_path, monkeypatch)
    d = _json(tmp_path, "fast_step")
    assert "FlashInfer" in d["baseline"]
    rs = d["retention_sweep"]
    assert [r["fraction_pct"] for r in rs["rows"]] == [1.6, 3.1, 6.25, 12.5, 25.0, 50.0, 100.0]
    for r in rs["rows"]:
        # the reported figures are the measured times' own consequences
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["sparse_ms"])
        assert r["sparse_gbps"] == pytest.approx(r["sparse_kv_bytes"] / r["sparse_ms"] / 1e6)
        assert r["retained_tokens"] == r["sink"] + r["selected"] + r["recent"]
    # bytes follow the retained tokens (x2 tokens -> x2 bytes at a fixed batch and shape)
    by_tokens = {r["retained_tokens"]: r["sparse_kv_bytes"] for r in rs["rows"]}
    t0 = min(by_tokens)
    assert all(b * t0 == by_tokens[t0] * t for t, b in by_tokens.items())
    full = rs["rows"][-1]
    assert full["retained_tokens"] == rs["ctx"] and full["max_abs_err_vs_dense"] < 1e-4
    assert [r["ctx"] for r in d["context_sweep"]["rows"]] == [256, 512]
    assert d["copy_bandwidth"]["copy_gbps_rw"] > 0
    _png(tmp_path, "fast_step_retention")
    _png(tmp_path, "fast_step_context")


def test_bench_bandwidth_smoke(tmp_path, monkeypatch):
    _run("bench_bandwidth", tmp_path, monkeypatch)
    d = _json(tmp_path, "bandwidth")
    names = " ".join(r["kernel"] for r in d["rows"])
    for k in ("paged_decode", "two_segment_decode", "dense_decode_with_evidence", "gather_compact",
              "merge_states"):
        assert k in names
    for r in d["rows"]:
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert r["fraction_of_floor"] == pytest.approx(r["floor_ms"] / r["ms"])
    _png(tmp_path, "bandwidth")


def test_bench_selector_smoke(tmp_path, monkeypatch):
    _run("bench_selector", tmp_path, monkeypatch)
    d = _json(tmp_path, "selector")
    assert isinstance(d["selector_available"], bool)
    for r in d["rows"]:
        assert r["gather_ms"] > 0 and r["dense_with_evidence_ms"] > 0
        if d["selector_available"]:
            assert r["selector_ms"] > 0 and "maintenance_ms" in r
            assert r["selector_keep_ms"] > 0
            assert r["quest_page16_evidence_ms"] > 0 and r["quest_page8_evidence_ms"] > 0
            assert r["quest_page16_selection_ms"] > 0 and r["quest_page16_rerank4_selection_ms"] > 0
        else:
            assert d["selector_skip_reason"]
    _png(tmp_path, "selector")


def test_bench_model_step_smoke(tmp_path, monkeypatch):
    _run("bench_model_step", tmp_path, monkeypatch)
    d = _json(tmp_path, "model_step")
    assert "model-shaped" in d["label"]
    rows = d["models"]["tiny"]["rows"]
    assert [r["ctx"] for r in rows] == [128, 256]
    for r in rows:
        assert r["sfi_amortized_ms"] == pytest.approx((31 * r["sfi_fast_ms"] + r["sfi_slow_ms"]) / 32)
        assert r["speedup_fast"] == pytest.approx(r["dense_ms"] / r["sfi_fast_ms"])
        assert r["dense_tok_per_s"] == pytest.approx(d["batch"] * 1e3 / r["dense_ms"])
    _png(tmp_path, "model_step")


def test_bench_sfi_path_smoke(tmp_path, monkeypatch):
    """The whole-path bench drives the backend's own plan and path: slow and fast rows both ran
    (the schedule's counters), the row schema is complete, and speed-ups follow from the times."""
    _run("bench_sfi_path", tmp_path, monkeypatch)
    d = _json(tmp_path, "sfi_path")
    assert "model-shaped" in d["label"] and d["env"]["gpu"]
    for r in d["rows"]:
        for key in ("model", "ctx", "batch", "dense_ms", "sfi_ms", "slow_fraction", "fast_only_ms",
                    "kv_gbps"):
            assert key in r, key
        assert 0 < r["slow_fraction"] < 1 and r["slow_rows"] > 0
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["sfi_ms"])
        assert r["speedup_fast_only"] == pytest.approx(r["dense_ms"] / r["fast_only_ms"])
    _png(tmp_path, "sfi_path")


def test_bench_sfi_path_quest_modes_smoke(tmp_path, monkeypatch):
    """The Quest modes of the whole-path bench: every decode row of every step selects (refresh 1),
    and the speed-ups and bandwidths follow from the times and the bytes (page table included)."""
    _run("bench_sfi_path", tmp_path, monkeypatch, "--modes", "dense,quest,quest_keep,quest_rerank")
    d = _json(tmp_path, "sfi_path_quest")
    assert d["modes"] == ["dense", "quest", "quest_keep", "quest_rerank"] and "page table" in d["quest"]
    assert "candidates" in d["quest"]
    for r in d["rows"]:
        for m in ("quest", "quest_keep", "quest_rerank"):
            assert r[f"{m}_selection_rows"] == r["steps"] * r["batch"]
            assert r[f"{m}_speedup"] == pytest.approx(r["dense_ms"] / r[f"{m}_ms"])
            assert r[f"{m}_kv_gbps"] > 0
    _png(tmp_path, "sfi_path_quest")


def test_bench_speed_smoke(tmp_path, monkeypatch):
    """SPEED's model-shaped bench: the row schema, and the KV ratio is the block arithmetic of the
    upper group (l_cut of L layers hold the prompt; the upper ones BoS + the tail blocks)."""
    _run("bench_speed", tmp_path, monkeypatch)
    d = _json(tmp_path, "speed")
    assert "model-shaped" in d["label"]
    shape = d["shape"]
    for r in d["rows"]:
        for key in ("ctx", "prefill_dense_ms", "prefill_speed_ms", "decode_dense_ms",
                    "decode_speed_ms", "kv_ratio", "ttft_change", "tpot_change"):
            assert key in r, key
        blocks = -(-(r["ctx"] + r["decoded"]) // 16)
        upper = 1 + blocks - max(1, (r["ctx"] - 1) // 16)
        assert upper < blocks
        assert r["kv_ratio"] == pytest.approx(
            (shape["l_cut"] * blocks + (shape["layers"] - shape["l_cut"]) * upper)
            / (shape["layers"] * blocks))
        assert shape["l_cut"] / shape["layers"] < r["kv_ratio"] < 1
    _png(tmp_path, "speed")


def test_tile_sweep_smoke(tmp_path, monkeypatch):
    """The fixed-tile sweep restores every module constant it changes and records each launch."""
    from vllm_ext.kernels import dense_decode_evidence as dde
    from vllm_ext.kernels import two_segment_decode as tsd

    before = (dict(dde.SLOW_PASS_META), dde.PERSISTENT_WAVES, dict(dde.FIXED_META),
              dict(tsd.MASKED_META))
    _run("tune_fixed_tiles", tmp_path, monkeypatch)
    assert (dde.SLOW_PASS_META, dde.PERSISTENT_WAVES, dde.FIXED_META, tsd.MASKED_META) == before
    d = _json(tmp_path, "tile_sweep")
    cases = {r["case"] for r in d["rows"]}
    assert cases == {"slow_pass", "two_segment_masked", "dense_masked"}
    assert all("ms" in r or "error" in r for r in d["rows"])
    assert set(d["best"]) == {f"{c} ctx 256" + (" live 1" if c == "slow_pass" else "")
                              for c in cases}


def test_gpu_check_script_lists_every_bench():
    text = (Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh").read_text()
    for b in ("bench_fast_step.py", "bench_bandwidth.py", "bench_selector.py", "bench_model_step.py",
              "bench_critiprefill.py", "bench_sfi_path.py", "bench_speed.py", "tune_fixed_tiles.py",
              'not e2e', "tests/kernels", "tests/sfi",
              "tests/critiprefill", "tests/test_sfi_path.py"):
        assert b in text, b
