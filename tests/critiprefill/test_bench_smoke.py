"""The CritiPrefill benchmark's --smoke mode runs on the CPU and writes its JSON and PNG."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_critiprefill.py"), "--smoke", "--out", str(tmp_path),
         "--lengths", "256,512", "--iters", "1", "--warmup", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "critiprefill_bench.json").read_text())
    assert data["smoke"] is True and data["device"].startswith("cpu")
    assert "SDPA" in data["dense_kernel"]
    assert [r["n"] for r in data["results"]] == [256, 512]
    for r in data["results"]:
        for key in ("dense_sdpa_ms", "plan_ms", "sparse_kernel_ms", "critiprefill_ms", "speedup_vs_sdpa"):
            assert r[key] > 0, key
        assert 0 < r["attended_fraction"] <= 1
        # the all-dense plan through our kernel is dense causal attention
        assert r["max_abs_err_dense_ours_vs_sdpa"] < 1e-4
    # 512 tokens, segments of 128, budget 128 (4 blocks of 32): segment 2 prunes
    assert data["results"][1]["attended_fraction"] < 1
    png = (tmp_path / "critiprefill_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
