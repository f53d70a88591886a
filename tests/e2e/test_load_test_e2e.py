"""``scripts/load_test.py`` end to end, small: it starts a real ``vllm serve`` with SFI on the committed
retrieval model, streams a few concurrent requests through the OpenAI client and writes a JSON with
every field the committed load run (bench/results/load_cpu.json) reports, and the plot."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_load_test_script_smoke(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "load_test.py"), "--configs", "sfi",
           "--num-requests", "3", "--passes", "2", "--concurrency", "3", "--lengths", "64,256",
           "--warmup", "1",
           "--extra-tokens", "2", "--out", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert not list(tmp_path.glob("*_server.log"))          # kept only when something failed

    assert "scripts/load_test.py --configs sfi --num-requests 3 --passes 2" in data["command"]
    m = data["machine"]
    assert m["cores"] == os.cpu_count() and "torch" in m["description"] and "vllm" in m["description"]
    assert data["workload"]["num_requests"] == 6 and data["workload"]["passes"] == 2
    assert data["workload"]["concurrency"] == 3
    assert data["failed_configs"] == []
    (c,) = data["configs"]
    assert c["name"] == "sfi" and c["speedsfi_config"]["sfi"]["enabled"] is True
    assert "--attention-backend speedsfi" in c["serve_command"] and "--additional-config" in c["serve_command"]
    assert c["serve_env"]["SPEEDSFI_FORCE_TORCH_KERNELS"] == "1"
    assert c["requests"] == 6 and c["errors"] == 0 and c["warmup_errors"] == 0 and c["healthy_after"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < c[key]["p50"] <= c[key]["p99"]
    assert c["exact_match"] is not None and 0 <= c["exact_match"] <= 1
    recs = c["requests_detail"]
    assert sorted((r["pass"], r["i"]) for r in recs) == [(p, i) for p in range(2) for i in range(3)]
    assert [(p["requests"], p["errors"]) for p in c["passes"]] == [(3, 0), (3, 0)]
    assert all(p["rss_end"]["total_mib"] > 100 for p in c["passes"])
    assert all(r["completion_tokens"] == r["max_tokens"] and r["ttft_s"] <= r["e2e_s"] for r in recs)
    assert {r["prompt_tokens"] for r in recs} == {64, 256}       # both lengths drawn (seeded)
    # the 256-token prompts outgrow sink + k + recent (132): SFI decoded them sparsely, and every
    # request slot and SFI slot came back
    ev = c["speedsfi"]["events"]
    assert ev["sfi.fast_steps"] > 0 and 0 < c["speedsfi"]["sfi_fast_retained_fraction"] < 1
    assert ev["slots.acquired"] == ev["slots.released"] == 6 and c["slots_idle_after"]
    assert c["speedsfi"]["fallbacks"] == {}
    # resident memory of the server's processes at each point, and its growth
    for key in ("rss_ready", "rss_after_warmup", "rss_middle", "rss_end"):
        assert c[key]["total_mib"] > 100 and len(c[key]["per_process_mib"]) >= 2
    assert set(c["rss_growth_mib"]) == {"ready_to_end", "after_warmup_to_end", "middle_to_end"}
    assert c["rss_timeline_mib"] and c["startup_s"] > 0
    assert "| sfi | 6 | 0 |" in proc.stdout                 # the printed table


def test_load_test_soak_smoke(tmp_path):
    """``--soak`` against a real server with every method on: client drops, the per-second series of
    RSS per process, KV usage and slot gauges, the end state once idle, back to zero."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "load_test.py"), "--soak", "--configs", "all_on",
           "--num-requests", "12", "--concurrency", "6", "--lengths", "64,1024", "--warmup", "2",
           "--extra-tokens", "2", "--abort-fraction", "0.4", "--repeat-fraction", "0.2",
           "--serve-args", "--max-num-batched-tokens 512", "--end-sample-s", "2",
           "--out", str(tmp_path), "--name", "soak"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 0
    w = data["workload"]
    assert w["abort_fraction"] == 0.4 and w["aborts_planned"] > 0 and data["code"]["commit"]
    (c,) = data["configs"]
    s = c["soak"]
    assert s["requests"] == 12 and s["failures"] == 0 and s["aborted"] == w["aborts_planned"]
    assert {"warmup", "run", "end"} <= {x["phase"] for x in c["timeline"]}
    for x in c["timeline"]:
        assert set(x["rss_mib"]) == {"api_server", "engine_core", "worker", "other", "total"}
        assert "metrics_error" not in x and 0 <= x["kv_cache_usage"] <= 1
    # the gauges are sampled once a second, so a 12-request run may show nothing at any sample: the
    # slots it used are read from the counters
    ev = c["speedsfi"]["events"]
    assert ev.get("slots.acquired", 0) > 0 and ev.get("sfi.slots_assigned", 0) > 0
    assert c["speedsfi"]["events"].get("critiprefill.slots_assigned", 0) > 0     # 1024-token prompts
    assert s["back_to_zero"] == {"slots": True, "kv_cache_usage": True, "queue": True}
    assert all(v == 0 for v in s["end_max"].values())
    assert set(s["rss_growth_mib"]) == {"api_server", "engine_core", "worker", "other", "total"}
    assert "| all_on | 12 |" in proc.stdout                       # the soak table
