"""bench/vllm_e2e.py and its modules: each module's CPU test, without vLLM
or a GPU: every call of the documented invocation fits its deadline in --dry-run; call 1 proves SFI
under FULL CUDA graphs before it measures, and SFI before its baselines; a hung job is killed at its
own estimate x 1.5; the report is rebuilt from a recorded JSON; the derived checks compare what they
should (graph tokens == eager tokens, each row once, SFI covering == all off through paged_decode)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("speedsfi_vllm_e2e_modules", BENCH / "vllm_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)            # puts bench/ on sys.path for its modules
    return mod


def _driver(*args, timeout=60):
    return subprocess.run([sys.executable, str(BENCH / "vllm_e2e.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------------ e2e_stages
@pytest.mark.parametrize("call", [1, 2, 3, 4, 5, 6])
def test_each_documented_call_fits_its_deadline_in_dry_run(e2e, call):
    p = _driver("--call", str(call), "--deadline-s", str(e2e.CALL_DEADLINE_S), "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "(fits)" in p.stdout and "OVER" not in p.stdout
    assert "heavy modules imported by the plan: none" in p.stdout
    args, _ = e2e.parse(["--call", str(call)])
    jobs = e2e.build_plan(args)
    assert e2e.plan_total(jobs) <= e2e.CALL_DEADLINE_S <= 540
    # a job is killed at 1.5 x its estimate: even then a call stays within the device's 600 s
    assert all(e2e.hang_timeout(j["est_s"]) < 600 for j in jobs)


def test_a_lent_session_runs_calls_1_and_2_within_its_device_time(e2e):
    """A session is lent 15 minutes of device time, start-up and the payload's stash call included:
    call 1 (the principal question) and call 2 (the token check that flips the default) fit it by
    the plan's own estimates, and the printed plan says so (exit status 0)."""
    plan = e2e.SESSION_PLAN
    assert plan["calls"] == (1, 2) and plan["device_budget_s"] <= 900
    est = {c: e2e.call_estimate(c) for c in plan["calls"]}
    assert e2e.session_total(est) <= plan["device_budget_s"]
    # call 2 runs on the warm machine after call 1: even with every job at its kill time (1.5 x its
    # estimate) it ends before the session's time does
    args, _ = e2e.parse(["--call", "2"])
    worst_2 = sum(e2e.hang_timeout(j["est_s"]) for j in e2e.build_plan(args))
    assert e2e.session_total(est) - est[2] + worst_2 <= plan["device_budget_s"]
    p = _driver("session")
    assert p.returncode == 0, p.stderr
    assert "(fits)" in p.stdout and "call 1" in p.stdout and "call 2" in p.stdout


def test_session_total_counts_every_overhead(e2e):
    plan = dict(device_budget_s=900, start_s=100, stash_call_s=50, per_call_overhead_s=10, calls=(1, 2))
    assert e2e.session_total({1: 400.0, 2: 100.0, 3: 999.0}, plan) == 100 + 50 + 410 + 110


def test_calls_cover_every_stage_once(e2e):
    stages = [s for c in e2e.CALLS.values() for s in c["stages"].split(",")]
    assert set(stages) == set(e2e.STAGES)
    configs = [c for call in e2e.CALLS.values() for key in ("perf_configs", "sfi_perf_configs")
               for c in call.get(key, "").split(",") if c]
    assert {"vllm_default", "flash_attn_v1", "speedsfi_dense_auto", "speedsfi_sfi_auto",
            "speedsfi_sfi_speed"} <= set(configs)


def test_call_1_alone_answers_sfi_against_the_default_at_32k_with_the_batch_that_fills_the_cache(e2e):
    """Correctness under FULL graphs first, then SFI (dense rows on vLLM's pick) and
    what `vllm serve` gives by default, at 32K with the batch the default's KV cache holds, each with
    a kernel table of a decode window."""
    args, _ = e2e.parse(["--call", "1"])
    jobs = e2e.build_plan(args)
    names = [j["name"] for j in jobs]
    assert [j["stage"] for j in jobs][:2] == ["smoke", "smoke"]
    g = [j for j in jobs if j["stage"] == "graphs"]
    assert [j["mode"] for j in g] == ["graph", "eager"] and names.index(g[0]["name"]) == 2
    assert not g[0]["eager"] and g[0]["graph_mode"] == "full_decode"
    assert g[0]["env"] == {"SPEEDSFI_ROW_COUNTERS": "1"} and g[0]["config"] == "speedsfi_sfi_small"
    # four prompts: the captured batch size 4 decodes without padded rows
    assert g[0]["groups"][0]["batch_cap"] == 4 == g[0]["max_num_seqs"]
    # a step budget below the prompts' total chunks them, so early requests decode beside later
    # chunks: mixed steps, which the "every row once" check needs (with vLLM's default budget all
    # four prompts fit one step, and the check would fail for want of mixed steps)
    for j in g:
        lengths = j["groups"][0]["lengths"]
        assert j["max_num_batched_tokens"] < sum(lengths) - min(lengths)
    engines = [j for j in jobs if j["kind"] == "engine" and j["stage"] in ("sfi_perf", "perf")]
    assert [j["config"] for j in engines] == ["speedsfi_sfi_auto", "vllm_default"]
    for j in engines:
        (grp,) = j["groups"]
        assert (grp["input_len"], grp["batch_cap"], grp["output_len"]) == (32768, "max", 256)
        assert grp["profile_steps"] > 0 and not j["eager"]
        assert j["max_num_seqs"] >= 16                      # an H100's KV cache holds ~13 at 32K
    assert e2e.CONFIGS["speedsfi_sfi_auto"]["speedsfi"]["dense_delegate"] == "auto"
    assert e2e.backend_of("vllm_default", cpu=False) is None            # vLLM picks (FLASH_ATTN on Hopper)
    assert e2e.CONFIGS["vllm_default"]["env"] == {}                     # Model Runner V2, vLLM's default


def test_call_2_checks_auto_token_for_token_against_the_same_backend_on_the_same_runner(e2e):
    args, _ = e2e.parse(["--call", "2"])
    jobs = e2e.build_plan(args)
    correct = [j for j in jobs if j["stage"] == "correct"]
    assert {j["config"] for j in correct} == {"flash_attn_v1", "speedsfi_dense_auto"}
    assert {j["stage"] for j in jobs} <= {"preflight", "correct"}      # nothing else: it must be short
    assert all(j["eager"] for j in correct)
    strict = {(a, b) for a, b, _, s in __import__("e2e_stages").CORRECT_PAIRS if s}
    assert ("speedsfi_dense_auto", "flash_attn_v1") in strict
    assert e2e.CONFIGS["flash_attn_v1"]["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_kernel_table_aggregates_a_trace_per_step_and_layer(e2e):
    from e2e_report import kernel_table

    ev = [dict(ph="X", cat="kernel", name="_two_segment_kernel", dur=10.0)] * 72 + \
         [dict(ph="X", cat="kernel", name="gemm", dur=50.0)] * 8 + \
         [dict(ph="X", cat="cpu_op", name="aten::mm", dur=999.0)]
    t = kernel_table(ev, steps=2, layers=36)
    assert t["launches_per_step"] == 40 and t["gpu_us_per_step"] == pytest.approx(560.0)
    top = {k["kernel"]: k for k in t["kernels"]}
    assert top["_two_segment_kernel"]["launches_per_layer"] == 1.0
    assert top["gemm"]["us_per_step"] == 200.0 and top["gemm"]["longest_us"] == 50.0
    assert "aten::mm" not in top


def test_correctness_compares_sfi_covering_with_all_off_through_the_same_dense_kernel(e2e):
    args, _ = e2e.parse(["correct"])
    cfgs = {(j["model"], j["config"]) for j in e2e.build_plan(args) if j["kind"] == "engine"}
    for model in ("llama-3.1-8b", "qwen3-4b"):
        assert {(model, "speedsfi_sfi_full"), (model, "speedsfi_dense_pd")} <= cfgs
    assert e2e.CONFIGS["speedsfi_dense_pd"]["speedsfi"]["dense_decode"] == "paged_decode"
    strict = {(a, b) for a, b, _, s in __import__("e2e_stages").CORRECT_PAIRS if s}
    assert ("speedsfi_sfi_full", "speedsfi_dense_pd") in strict
    assert ("speedsfi_sfi_full", "triton") not in strict                  # two bf16 kernels: information


def test_every_speedsfi_configuration_is_valid(e2e):
    from vllm_ext.config import SpeedSfiConfig

    for name in e2e.CONFIGS:
        for cpu in (False, True):
            sec = e2e.speedsfi_section(name, 131344, cpu)
            if sec is not None:
                SpeedSfiConfig.from_dict(sec)
                # with a batch size, SFI holds every sequence of the batch (no queueing in the perf rows)
                cfg = SpeedSfiConfig.from_dict(e2e.speedsfi_section(name, 131344, cpu, 64))
                assert cfg.sfi.max_requests == (64 if cfg.sfi.enabled else None)
                assert cfg.sfi.k == SpeedSfiConfig.from_dict(sec).sfi.k      # nothing else changes


# ------------------------------------------------------------------------------------ e2e_jobs
def _runner(e2e, tmp_path, deadline=60.0):
    args = SimpleNamespace(out=str(tmp_path / "out"), cpu=True, deadline_s=deadline, custom_ops="auto")
    return e2e.JobRunner(args)


def test_a_hung_job_is_killed_at_its_estimate_times_1_5(e2e, tmp_path):
    run = _runner(e2e, tmp_path)
    jobs = [dict(stage="smoke", kind="fake", name="hangs", est_s=2.0, min_s=1, sleep_s=60),
            dict(stage="smoke", kind="fake", name="fits", est_s=5.0, min_s=1, sleep_s=0.2)]
    t = time.monotonic()
    run.run_jobs(jobs)
    took = time.monotonic() - t
    assert took < 15                                      # 3 s for the hung one (2 s x 1.5), not 60
    (f,) = run.result["failures"]
    assert f["job"] == "hangs" and f["phase"] == "timeout" and "killed after 3 s" in f["error"]
    assert run.result["stages"]["smoke"]["jobs"] == 2
    assert json.loads((tmp_path / "out" / "vllm_e2e.json").read_text())["failures"][0]["job"] == "hangs"


def test_a_job_that_no_longer_fits_the_deadline_is_skipped_and_recorded(e2e, tmp_path):
    run = _runner(e2e, tmp_path, deadline=5.0)
    run.run_jobs([dict(stage="perf", kind="fake", name="late", est_s=100.0, min_s=30, sleep_s=0)])
    assert run.result["skipped"][0]["job"] == "late" and not run.result["failures"]
    assert e2e.job_timeout(dict(est_s=100.0), remaining_s=50.0) == pytest.approx(40.0)
    assert e2e.job_timeout(dict(est_s=10.0), remaining_s=500.0) == pytest.approx(15.0)


# ------------------------------------------------------------------------------------ e2e_timing
def test_estimates_grow_with_the_work(e2e):
    small = [dict(kind="perf", input_len=8192, output_len=256, batch_cap=1)]
    big = [dict(kind="perf", input_len=131072, output_len=256, batch_cap=1)]
    assert e2e.est_engine_s("qwen3-4b", big, False, False) > e2e.est_engine_s("qwen3-4b", small, False, False)
    assert e2e.est_engine_s("qwen3-4b", small, False, False, warmup=True) > \
        e2e.est_engine_s("qwen3-4b", small, False, False)
    assert e2e.HANG_FACTOR == 1.5 and e2e.hang_timeout(100) == 150


# ------------------------------------------------------------------------------------ e2e_report
def test_report_from_the_recorded_h100_json(tmp_path):
    src = ROOT / "bench" / "results" / "vllm_e2e_route_h100.json"
    p = _driver("report", "--merge", str(src), "--out", str(tmp_path), "--no-plot")
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "vllm_e2e.json").read_text())
    ok = {c["name"]: c["ok"] for c in res["checks"]}
    assert ok["qwen3-4b: SPEEDSFI all off == TRITON_ATTN"] is True     # recomputed from the records
    assert "| correct | qwen3-4b: SPEEDSFI all off == TRITON_ATTN | PASS" in p.stdout


def test_report_tables_for_kernels_serving_and_the_default_baseline(e2e):
    rows = [e2e.make_perf_row(config=c, model="qwen3-4b", mode="graph", input_len=32768, batch=4, tpot_ms=t,
                              backend=None) for c, t in (("vllm_default", 30.0), ("speedsfi_sfi", 6.0))]
    res = {"env": {}, "rows": rows, "checks": [], "kernels": [dict(context=32768, batch=4, paged_decode_us=90.0,
                                                                 paged_decode_gbps=2900.0, delegate_us=120.0,
                                                                 delegate_gbps=2200.0, delegate_kernel="3D (split)",
                                                                 faster="paged_decode")],
           "serving": [dict(config="speedsfi_sfi", input_len=32768, output_len=256, request_rate=0.5, num_prompts=16,
                            output_tok_s=400.0, mean_ttft_ms=900.0, mean_tpot_ms=20.0)]}
    md = e2e.markdown_report(res)
    assert "speed-up over vllm_default" in md and "| 5.00x |" in md
    assert "| 32768 | 4 | 90.0 |" in md and "| paged_decode |" in md
    assert "| speedsfi_sfi | 32768 | 256 | 0.5 | 16 | 400.0 |" in md
    assert e2e.serving_summary({"output_throughput": 12.5, "mean_ttft_ms": 3.0})["output_tok_s"] == 12.5


def test_derived_checks_compare_graph_tokens_with_eager_and_rows_once(e2e):
    def rec(mode, tokens, counters):
        return dict(stage="graphs", model="tiny-llama", config="speedsfi_sfi_small", mode=mode, tokens=tokens,
                    tokens_sha=str(tokens), cuda_graphs=mode == "graph", cudagraph_mode="FULL_DECODE_ONLY"
                    if mode == "graph" else "NONE", counters=counters)

    c = {"sfi.fast_steps": 10, "sfi.slow_steps": 2, "rows.layer": 40, "rows.delegate": 10,
         "rows.paged_decode": 6, "rows.sfi_slow": 4, "rows.sfi_fast": 20, "steps.mixed": 3}
    res = {"env": {}, "correctness": [rec("graph", [[1, 2, 3]], c), rec("eager", [[1, 2, 4]], dict(c, **{"rows.delegate": 12}))]}
    ok = {x["name"]: x["ok"] for x in e2e.derived_checks(res)}
    assert ok["tiny-llama: SFI runs under FULL CUDA graphs (FULL_DECODE_ONLY)"] is True
    assert ok["tiny-llama: fast and slow steps under CUDA graphs"] is True
    assert ok["tiny-llama (graph): every row computed once (rows per path == rows of the layer calls)"] is True
    assert ok["tiny-llama (eager): every row computed once (rows per path == rows of the layer calls)"] is False
    assert ok["tiny-llama: SFI tokens under CUDA graphs == eager"] is False


# ------------------------------------------------------------------------------------ e2e_worker
def test_worker_engine_arguments_without_vllm(e2e):
    import e2e_worker

    base = dict(model_dir="/m", max_model_len=4096, max_num_seqs=4, eager=False, cpu=False,
                groups=[dict(kind="perf", input_len=1024, output_len=8, batch_cap=4)], graph_mode="full_decode")
    kw = e2e_worker._engine_kwargs(dict(base, config="vllm_default"))
    assert "attention_backend" not in kw and "additional_config" not in kw
    assert kw["compilation_config"] == {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": [1, 2, 4]}
    kw = e2e_worker._engine_kwargs(dict(base, config="speedsfi_dense_pd"))
    assert kw["attention_backend"] == "SPEEDSFI"
    assert kw["additional_config"] == {"speedsfi": {"preset": "dense", "dense_decode": "paged_decode"}}
    kw = e2e_worker._engine_kwargs(dict(base, config="speedsfi_sfi_small", max_num_batched_tokens=1024))
    assert kw["max_num_batched_tokens"] == 1024
    assert "import torch" not in Path(e2e_worker.__file__).read_text().split("def ", 1)[0]


def test_merge_keeps_the_measured_row_of_each_configuration(e2e):
    """Two device calls: the second re-runs a configuration the first could not measure."""
    def row(cfg, n, tpot, error=None):
        return dict(model="m", config=cfg, mode="graph", input_len=n, batch=1, tpot_ms=tpot, error=error)

    a = dict(command="a", rows=[row("sfi", 8192, None, "RuntimeError"), row("default", 8192, 8.4),
                                row("sfi", 32768, None, "RuntimeError")], failures=[{"job": "sfi"}])
    b = dict(command="b", rows=[row("sfi", 8192, 7.3), row("sfi", 32768, None, "timeout")])
    merged = e2e.merge_results([a, b])
    got = {(r["config"], r["input_len"]): (r["tpot_ms"], r["error"]) for r in merged["rows"]}
    assert got == {("sfi", 8192): (7.3, None), ("default", 8192): (8.4, None),
                   ("sfi", 32768): (None, "timeout")}
    assert len(merged["rows"]) == 3 and merged["failures"] == [{"job": "sfi"}]
    merged = e2e.merge_results([b, a])                 # a measured row is never replaced by an error
    assert {(r["config"], r["input_len"]): r["tpot_ms"] for r in merged["rows"]}[("sfi", 8192)] == 7.3
