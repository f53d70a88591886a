"""The GPU driver's stages (bench/vllm_e2e.py): the plan of each call, the job kinds, and the checks
derived from what the jobs recorded. No vLLM, no torch (the work runs in ``e2e_worker``).

Stages, in the order they run (SFI under FULL CUDA graphs is proved first, SFI is measured
before its baselines):

* ``smoke``: vLLM's ``_C`` kernels against PyTorch, imports and the plugin entry point;
* ``graphs``: a small engine with SFI (small budget) under FULL CUDA graphs (``FULL_DECODE_ONLY``) and
  the same engine eager: graph tokens == eager tokens (a check), fast and slow steps in the graph run,
  every row of every mixed step computed once (``SPEEDSFI_ROW_COUNTERS``);
* ``kernels``: the copy rate (1 GiB torch copy); our ``paged_decode`` against the delegate's kernel (vLLM's Triton unified attention,
  as ``TritonAttentionImpl`` launches it) at the perf stage's (context, batch) points, in CUDA graphs;
* ``sfi_perf``: the SFI configurations' perf engines (SFI preset, SFI + SPEED);
* ``correct``: Llama-3.1-8B and Qwen3-4B shapes, random weights, eager: SFI with a covering budget ==
  SPEEDSFI all off **through the same dense kernel** (``dense_decode = paged_decode``), the strict
  check; vs TRITON_ATTN (two bf16 kernels) for information; all off == TRITON_ATTN; the SFI preset
  runs fast and slow steps;
* ``quality``: ``scripts/eval_quality.py`` on ``models/retrieval-llama`` vs the CPU's numbers;
* ``perf``: the baselines' perf engines: vLLM's defaults (Model Runner V2 and the backend vLLM picks,
  FLASH_ATTN on Hopper), TRITON_ATTN (V1 runner), SPEEDSFI all off (delegate, and paged_decode);
* ``critiprefill``: TTFT of long prompts, CritiPrefill vs SPEEDSFI all off;
* ``serving``: ``vllm serve`` + ``vllm bench serve`` (random long prompts at a request rate: mixed
  steps), vLLM's defaults vs the SFI preset.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from e2e_jobs import (JSON_NAME, PNG_NAME, ROOT, JobRunner, log, looks_like_c_op_failure, short_error,
                      spawn)
from e2e_models import CONFIGS, MODELS, backend_of, make_model_dir, speedsfi_section
from e2e_report import compare_quality, markdown_report, plot_perf
from e2e_timing import compare_tokens, est_engine_s, make_perf_row

STAGES = ("smoke", "graphs", "kernels", "sfi_perf", "correct", "quality", "perf", "critiprefill", "serving")
# The documented invocation: calls of at most CALL_DEADLINE_S each, each independent of the others
# (a later session can run the rest).
CALL_DEADLINE_S = 520
# The GPU half in calls of at most 10 minutes each, ordered by what they decide. A session is lent 15
# minutes of device time (the device tool's README), start-up, the payload's stash call and idle
# seconds included: SESSION_PLAN below. Call 1 alone
# answers the principal question: SFI against what `vllm serve` gives by default at 32K with the batch
# that fills the default's KV cache (TPOT, TTFT, and a kernel table of a decode window from the torch
# profiler), after SFI under FULL CUDA graphs == eager. Call 2, on the same warm machine right after:
# all off with dense_delegate "auto" == that backend on the V1 runner token for token (what flips the
# default). What does not fit a session is calls 3 to 6, for later sessions: the 128K rows; the 8K
# rows and the serving run; the runner's share (the default backend on the V1 runner), all off, SFI +
# SPEED and CritiPrefill's TTFT at 32K, the kernel-only read rates; the Llama-3.1-8B shape's token
# checks and quality.
CALLS: dict[int, dict[str, str]] = {
    1: dict(stages="smoke,graphs,sfi_perf,perf", sfi_perf_configs="speedsfi_sfi_auto",
            perf_configs="vllm_default", lengths="32768", batches="32768:max", profile="1"),
    2: dict(stages="correct", correct_models="qwen3-4b", correct_configs="flash_attn_v1,speedsfi_dense_auto"),
    3: dict(stages="sfi_perf,perf", sfi_perf_configs="speedsfi_sfi_auto",
            perf_configs="vllm_default", lengths="131072", batches="131072:max"),
    4: dict(stages="sfi_perf,perf,serving", sfi_perf_configs="speedsfi_sfi_auto",
            perf_configs="vllm_default", lengths="8192", batches="8192:max",
            serve_configs="vllm_default,speedsfi_sfi_auto", serve_prompts="8", serve_rate="0.5"),
    5: dict(stages="kernels,sfi_perf,perf,critiprefill", sfi_perf_configs="speedsfi_sfi_speed",
            perf_configs="flash_attn_v1,speedsfi_dense_auto", lengths="32768", batches="32768:max"),
    6: dict(stages="correct,quality", correct_models="llama-3.1-8b",
            correct_configs="flash_attn_v1,speedsfi_dense_auto,speedsfi_sfi"),
}
# One session's device time and what it spends besides the driver (seconds): the machine's start
# (a minute or more, HOPPER/README), the stash call that leaves the payload's second half on the warm
# machine (bench/README.md: the payload and the tree do not fit one transfer), and per call the
# transfer, the unpack and the files back. `session_fits` checks a session's calls against it.
SESSION_PLAN = dict(device_budget_s=900, start_s=120, stash_call_s=60, per_call_overhead_s=40,
                    calls=(1, 2))


MAX_BATCH = 64
# the driver's options a call may set (the rest keep their defaults)
CALL_OPTIONS = ("perf_configs", "sfi_perf_configs", "lengths", "batches", "correct_models",
                "correct_configs", "serve_configs", "serve_prompts", "serve_rate", "profile")
SFI_PERF_CONFIGS = ("speedsfi_sfi", "speedsfi_sfi_speed")


def parse_batches(text: str) -> dict[int, int | str]:
    out: dict[int, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, v = part.split(":")
        out[int(k)] = v if v == "max" else int(v)
    return out


def _engine_job(stage: str, name: str, model: str, config: str, eager: bool, groups: list[dict],
                max_model_len: int, max_num_seqs: int, cpu: bool, min_s: float, **kw) -> dict:
    est = kw.pop("est_s", None) or est_engine_s(model, groups, eager, cpu, warmup=stage in ("perf", "sfi_perf"))
    return dict(stage=stage, kind="engine", name=name, model=model, config=config, eager=eager,
                groups=groups, max_model_len=max_model_len, max_num_seqs=max_num_seqs, est_s=est,
                min_s=min_s, **kw)


def _perf_jobs(args, stage: str, configs: list[str]) -> list[dict]:
    cpu = args.cpu
    caps = parse_batches(args.batches)
    modes = [m for m in args.modes if not (cpu and m == "graph")]
    order = [(cfg, mode) for mode in ("graph", "eager") if mode in modes for cfg in configs]
    jobs = []
    for model in args.perf_models:
        for cfg, mode in order:
            lens = [n for n in args.lengths if mode == "graph" or n <= args.eager_max_len]
            if not lens:
                continue
            groups = [dict(kind="perf", input_len=n, output_len=args.output_len,
                           batch_cap=caps.get(n, args.default_batch),
                           profile_steps=args.profile_steps if getattr(args, "profile", 0) else 0)
                      for n in sorted(lens)]
            ints = [g["batch_cap"] for g in groups if isinstance(g["batch_cap"], int)]
            # "max": the batch that fills the KV cache (vLLM's "Maximum concurrency"), up to 64
            max_seqs = max(ints + [1]) if all(isinstance(g["batch_cap"], int) for g in groups) else MAX_BATCH
            jobs.append(_engine_job(stage, f"{stage}/{model}/{cfg}/{mode}", model, cfg, mode == "eager", groups,
                                    max(lens) + args.output_len + 16, max_seqs, cpu,
                                    min_s=60 if mode == "graph" else 45))
    return jobs


def build_plan(args) -> list[dict]:
    """Every job of the requested stages, in the order it runs (STAGES order)."""
    jobs: list[dict] = []
    cpu = args.cpu
    st = set(args.stages)
    engines = st & {"graphs", "sfi_perf", "correct", "perf", "critiprefill", "serving", "kernels"}
    if not cpu and "smoke" not in st and engines:
        jobs.append(dict(stage="preflight", kind="c_ops", name="c_ops", est_s=15, min_s=20))
    if "smoke" in st:
        if not cpu:
            jobs.append(dict(stage="smoke", kind="c_ops", name="c_ops", est_s=15, min_s=20))
        jobs.append(dict(stage="smoke", kind="imports", name="imports", est_s=20, min_s=20))
    if "graphs" in st:
        # SFI under FULL CUDA graphs (FULL_DECODE_ONLY), and the same engine eager: same tokens. Four
        # prompts, all decoding together in the captured batch size 4 (no padded rows). A small token
        # budget per step chunks the prompts, so the first requests decode beside the others'
        # chunks: mixed steps (the "every row computed once" check needs some; with vLLM's default
        # budget all four prompts fit one step on the GPU and no step is mixed).
        model = "cpu-tiny-llama" if cpu else "tiny-llama"
        lengths = [300, 200, 120, 60] if cpu else [3000, 2000, 1200, 600]
        groups = [dict(kind="greedy", lengths=lengths, input_len=max(lengths), output_len=48 if cpu else 96,
                       batch_cap=len(lengths))]
        # the CPU build has no CUDA graphs: its "graph" job runs eager, and a second eager engine
        # would repeat it (the graph == eager check is the GPU's)
        for mode in ("graph",) if cpu else ("graph", "eager"):
            eager = mode == "eager" or cpu
            # measured on an H200 (2026-11-26): 86 s with CUDA graphs (vLLM's JIT warm-up and graph
            # memory profiling come first), 43 s eager
            est = None if cpu else (90.0 if mode == "graph" else 45.0)
            jobs.append(_engine_job("graphs", f"graphs/{model}/speedsfi_sfi_small/{mode}", model,
                                    "speedsfi_sfi_small", eager, groups, max(lengths) + 128, len(lengths),
                                    cpu, min_s=40, graph_mode="full_decode", mode=mode, est_s=est,
                                    max_num_batched_tokens=None if cpu else 1024,
                                    env={"SPEEDSFI_ROW_COUNTERS": "1"}))
    if "kernels" in st:
        if not cpu:
            # the copy rate the achieved GB/s are compared with (env.copy_gbps_rw; merged into later calls)
            jobs.append(dict(stage="kernels", kind="env", name="copy_bandwidth", est_s=12, min_s=15))
        caps = parse_batches(args.batches)
        points = [[n, caps.get(n, args.default_batch)] for n in args.lengths]
        points = [[n, b if isinstance(b, int) else 16] for n, b in points]
        m = MODELS[args.perf_models[0]]
        jobs.append(dict(stage="kernels", kind="kernels", name=f"kernels/{args.perf_models[0]}/paged_decode_vs_delegate",
                         points=points, heads=m["heads"], kv_heads=m["kv_heads"], head_dim=m["head_dim"],
                         est_s=10.0 + 6.0 * len(points), min_s=20))
    if "sfi_perf" in st:
        jobs += _perf_jobs(args, "sfi_perf", args.sfi_perf_configs)
    if "correct" in st:
        lengths = args.correct_lengths
        out_len = args.correct_output_len
        mml = max(lengths) + out_len + 16
        for model in args.correct_models:
            for cfg in args.correct_configs.get(model, args.correct_configs["*"]):
                groups = [dict(kind="greedy", lengths=lengths, input_len=max(lengths), output_len=out_len,
                               batch_cap=len(lengths))]
                jobs.append(_engine_job("correct", f"correct/{model}/{cfg}/eager", model, cfg, True, groups, mml,
                                        len(lengths), cpu, min_s=40))
    if "quality" in st:
        jobs.append(dict(stage="quality", kind="quality", name="quality/retrieval-llama", est_s=140, min_s=60))
    if "perf" in st:
        jobs += _perf_jobs(args, "perf", args.perf_configs)
    if "critiprefill" in st:
        # TTFT of CritiPrefill at the perf stage's lengths and batches (its TTFT is compared with the
        # perf rows of SPEEDSFI all off, same input and batch); a few tokens out
        caps = parse_batches(args.batches)
        model = args.perf_models[0]
        lens = [n for n in args.lengths if n >= args.critiprefill_min_len] or args.lengths[-1:]
        groups = [dict(kind="perf", input_len=n, output_len=args.ttft_output_len,
                       batch_cap=caps.get(n, args.default_batch)) for n in lens]
        ints = [g["batch_cap"] for g in groups if isinstance(g["batch_cap"], int)]
        jobs.append(_engine_job("critiprefill", f"critiprefill/{model}/speedsfi_critiprefill/{'eager' if cpu else 'graph'}",
                                model, "speedsfi_critiprefill", cpu, groups,
                                max(lens) + args.ttft_output_len + 16, max(ints + [1]), cpu, min_s=45))
    if "serving" in st and not cpu:
        model = args.perf_models[0]
        n, o, rate, num = args.serve_input_len, args.serve_output_len, args.serve_rate, args.serve_prompts
        for cfg in args.serve_configs:
            # server start (import, weights, capture) + the requests: num at `rate` per s, each a
            # prefill of n tokens and o decode steps
            p = MODELS[model]
            est = 75.0 + num / rate + (num * n) / 20000.0 + o * 0.03 + 15.0
            jobs.append(dict(stage="serving", kind="serving", name=f"serving/{model}/{cfg}", model=model,
                             config=cfg, input_len=n, output_len=o, rate=rate, num_prompts=num,
                             max_model_len=n + o + 64, max_num_seqs=args.serve_max_seqs,
                             layers=p["layers"], est_s=est, min_s=90))
    return jobs


def plan_total(jobs: list[dict]) -> float:
    return sum(j["est_s"] for j in jobs)


def session_total(call_estimates: dict[int, float], plan: dict = SESSION_PLAN) -> float:
    """Device seconds a session spends on ``plan``'s calls (their plans' estimates), start-up, the
    stash call and each call's transfer and unpack included."""
    return (plan["start_s"] + plan["stash_call_s"]
            + sum(call_estimates[c] + plan["per_call_overhead_s"] for c in plan["calls"]))


def print_plan(jobs: list[dict], args) -> None:
    total = 0.0
    print(f"plan: stages {','.join(args.stages)}; deadline {args.deadline_s:.0f} s; "
          f"{'CPU build (tests)' if args.cpu else 'GPU'}")
    for j in jobs:
        total += j["est_s"]
        extra = ""
        if j["kind"] == "engine":
            b = backend_of(j["config"], args.cpu) or "vLLM's choice"
            sec = speedsfi_section(j["config"], j["max_model_len"], args.cpu, j.get("max_num_seqs"))
            gs = "; ".join(f"in {g['input_len']} x{g['batch_cap']} out {g['output_len']}" if g["kind"] == "perf"
                           else f"prompts {g['lengths']} out {g['output_len']}" for g in j["groups"])
            extra = (f" backend {b} speedsfi {json.dumps(sec) if sec else '-'} "
                     f"{'eager' if j['eager'] else 'cuda graphs'} max_model_len {j['max_model_len']}: {gs}")
        elif j["kind"] == "kernels":
            extra = f" (context, batch) {j['points']}"
        elif j["kind"] == "serving":
            extra = f" {j['num_prompts']} prompts of {j['input_len']} at {j['rate']}/s, {j['output_len']} out"
        print(f"  [{j['stage']:12s}] {j['name']:52s} ~{j['est_s']:5.0f} s, killed at {1.5 * j['est_s']:5.0f} s "
              f"(cum ~{total:5.0f} s){extra}")
    print(f"estimated total ~{total:.0f} s ({total / 60:.1f} min) against a deadline of {args.deadline_s:.0f} s"
          + (" (fits)" if total <= args.deadline_s else " -- OVER: the tail will be skipped (recorded)"))


class Run(JobRunner):
    """One call: its plan's jobs, then the derived checks, the plot and the markdown report."""

    def worker(self, job, timeout, spec_extra=None, env_extra=None):
        env = dict(CONFIGS[job["config"]]["env"]) if job.get("config") else {}
        env.update(job.get("env") or {})
        env.update(env_extra or {})
        return super().worker(job, timeout, spec_extra, env)

    def prepare_spec(self, job: dict, spec: dict) -> None:
        spec["gpu_memory_utilization"] = self.args.gpu_memory_utilization
        spec["graph_mode"] = job.get("graph_mode") or self.args.graph_mode
        spec["weights"] = self.args.weights
        spec["custom_ops_none"] = spec.get("custom_ops_none", bool(self.state.get("custom_ops_none")))
        if job.get("model"):
            spec["model_dir"] = make_model_dir(self.args.models_dir, job["model"])

    def run(self, jobs: list[dict]) -> int:
        self.run_jobs(jobs)
        self.finish_stage_checks()
        if any(s in self.args.stages for s in ("perf", "sfi_perf")) and not self.args.no_plot:
            plot_perf(self.result, self.out / PNG_NAME)
        self.write()
        print(markdown_report(self.result), flush=True)
        for st, secs in self.stage_times.items():
            log(f"stage {st}: {secs:.0f} s")
        failed = [c for c in self.result["checks"] if c["ok"] is False]
        log(f"done in {self.elapsed():.0f} s: {len(self.result['rows'])} perf rows, "
            f"{len(self.result['checks'])} checks ({len(failed)} failed), {len(self.result['failures'])} failures, "
            f"{len(self.result['skipped'])} skipped -> {self.out / JSON_NAME}")
        return 1 if (failed or self.result["failures"]) else 0

    def on_skip(self, j: dict, why: str) -> None:
        if j["kind"] == "engine" and j["stage"] in ("perf", "sfi_perf", "critiprefill"):
            for g in j["groups"]:
                self.result["rows"].append(self._perf_stub(j, g, f"skipped ({why})"))

    def after_job(self, j: dict) -> None:
        self.finish_stage_checks()
        if j["kind"] == "engine" and j["stage"] in ("perf", "sfi_perf") and not self.args.no_plot:
            try:
                plot_perf(self.result, self.out / PNG_NAME)
            except Exception as exc:  # pragma: no cover
                log(f"plot failed: {exc}")

    def job_env(self, j: dict, timeout: float) -> None:
        rc, events, text, secs = self.worker(j, timeout)
        info = next((e for e in events if e.get("type") == "env"), None)
        if info:
            self.result["env"].update({k: v for k, v in info.items() if k != "type"})
        else:
            self.failure(j["stage"], j["name"], "env", short_error(text) or f"exit status {rc}")

    def job_c_ops(self, j: dict, timeout: float) -> None:
        if j["stage"] == "preflight" and "c_ops_ok" in self.state:
            log(f"c_ops already checked on this machine: ok={self.state['c_ops_ok']}")
            return
        rc, events, text, secs = self.worker(j, timeout)
        res = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "c_ops"), None)
        if res is None:
            err = short_error(text) or f"exit status {rc}"
            self.check("smoke", "_C kernels load and match PyTorch", False, err)
            self.failure(j["stage"], j["name"], "c_ops", err, workaround="custom_ops ['none'] for every engine")
            ok = False
        else:
            ok = all(r.get("ok") for r in res["ops"].values())
            self.check("smoke", "_C kernels load and match PyTorch", ok, res["ops"])
            for k in ("gpu", "torch", "triton", "cuda"):
                if res.get(k):
                    self.result["env"][k] = res[k]
            if not ok:
                self.failure(j["stage"], j["name"], "c_ops", json.dumps(res["ops"])[:600],
                             workaround="custom_ops ['none'] for every engine")
        self.state["c_ops_ok"] = ok
        if not ok and self.args.custom_ops == "auto":
            self.state["custom_ops_none"] = True
            self.result["workarounds"].append("custom_ops ['none'] (vLLM's _C kernels failed the check)")
        self._save_state()

    def job_imports(self, j: dict, timeout: float) -> None:
        rc, events, text, secs = self.worker(j, timeout)
        res = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "imports"), None)
        if res is None:
            err = short_error(text) or f"exit status {rc}"
            self.check("smoke", "vLLM + plugin import", False, err)
            self.failure(j["stage"], j["name"], "imports", err)
            return
        ok = not res["failed"]
        self.check("smoke", "vLLM + plugin import", ok, res)
        for k in ("vllm", "torch", "triton", "transformers"):
            if res.get(k):
                self.result["env"][k] = res[k]
        if not ok:
            self.failure(j["stage"], j["name"], "imports", json.dumps(res["failed"])[:800])

    def job_engine(self, j: dict, timeout: float) -> None:
        t_start = time.monotonic()
        rc, events, text, secs = self.worker(j, timeout)
        retry_note = None
        init_err = next((e for e in events if e.get("type") == "error" and e.get("phase") == "init"), None)
        grp_errs = [e for e in events if e.get("type") == "error" and e.get("phase") == "group"]
        first_err_text = (init_err or (grp_errs[0] if grp_errs else {})).get("traceback", "") or (
            text if rc not in (0, None) else "")
        used_none = bool(self.state.get("custom_ops_none"))
        rows_done = [e for e in events if e.get("type") in ("row", "greedy")]
        if (rc != 0 and not used_none and self.args.custom_ops == "auto" and not rows_done
                and looks_like_c_op_failure(first_err_text)):
            err = short_error(first_err_text)
            left = timeout - (time.monotonic() - t_start)
            self.failure(j["stage"], j["name"], "init" if init_err else "run", err,
                         workaround="retried with compilation_config custom_ops ['none']")
            if left > j["min_s"]:
                log(f"retrying {j['name']} with custom_ops ['none'] ({left:.0f} s left for it)")
                rc, events, text, secs = self.worker(j, left, {"custom_ops_none": True})
                retry_note = f"custom_ops ['none'] after: {err}"
                if rc == 0:
                    self.state["custom_ops_none"] = True
                    self._save_state()
                    self.result["workarounds"].append(f"custom_ops ['none'] from {j['name']} on ({err})")
        engine = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "engine"), {})
        for e in events:
            if e.get("type") == "info" and "warmup_s" in e:
                engine = dict(engine, warmup_s=e["warmup_s"], warmup_batches=e.get("warmup_batches"))
        errors = [e for e in events if e.get("type") == "error"]
        for e in errors:
            self.failure(j["stage"], j["name"], e.get("phase", "?"), e.get("error", "?"),
                         traceback=e.get("traceback", "")[-3000:])
        if rc is None:
            self.failure(j["stage"], j["name"], "timeout", f"killed after {timeout:.0f} s (timeout / deadline)")
        elif rc != 0 and not errors:
            self.failure(j["stage"], j["name"], "crash", short_error(text) or f"exit status {rc}",
                         log_tail=text[-2000:])
        mc = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
        common = dict(model=j["model"], config=j["config"], backend=backend_of(j["config"], self.args.cpu),
                      mode=j.get("mode") or ("eager" if j["eager"] else "graph"), engine=engine,
                      workaround=retry_note,
                      max_concurrency_vllm_log=(float(mc[-1][1]) if mc else None),
                      max_concurrency_vllm_log_tokens=(int(mc[-1][0].replace(",", "")) if mc else None))
        if engine:
            for k in ("gpu", "torch", "vllm", "triton"):
                if engine.get(k) and not self.result["env"].get(k):
                    self.result["env"][k] = engine[k]
        for e in events:
            if e.get("type") == "kernel_table":
                self.result.setdefault("kernel_tables", []).append(
                    dict({k: v for k, v in e.items() if k != "type"}, model=j["model"]))
        if j["stage"] in ("perf", "sfi_perf", "critiprefill"):
            got = {(e["input_len"]): e for e in events if e.get("type") == "row"}
            for g in j["groups"]:
                e = got.get(g["input_len"])
                if e is None:
                    why = (errors[-1]["error"] if errors else
                           ("killed at the timeout before this length" if rc is None else
                            (short_error(text) or f"exit status {rc}")))
                    self.result["rows"].append(self._perf_stub(j, g, f"not measured: {why}", engine=engine,
                                                               workaround=retry_note))
                else:
                    row = dict(e)
                    row.pop("type", None)
                    row.update({k: v for k, v in common.items() if k not in row or row[k] is None})
                    self.result["rows"].append(make_perf_row(**row))
        else:
            for e in events:
                if e.get("type") == "greedy":
                    rec = dict(common, stage=j["stage"], **{k: v for k, v in e.items() if k != "type"})
                    rec["cuda_graphs"] = engine.get("cuda_graphs")
                    rec["cudagraph_mode"] = engine.get("cudagraph_mode") or engine.get("cudagraph_mode_config")
                    self.result["correctness"].append(rec)
            if not any(e.get("type") == "greedy" for e in events):
                self.result["correctness"].append(dict(common, stage=j["stage"], error=(
                    errors[-1]["error"] if errors else short_error(text) or f"exit status {rc}")))

    def _perf_stub(self, j: dict, g: dict, error: str, **kw) -> dict:
        return make_perf_row(model=j["model"], config=j["config"], backend=backend_of(j["config"], self.args.cpu),
                             mode="eager" if j["eager"] else "graph", input_len=g["input_len"],
                             output_len=g["output_len"], batch=g["batch_cap"], error=error, **kw)

    def job_quality(self, j: dict, timeout: float) -> None:
        qdir = self.work / "quality"
        qdir.mkdir(exist_ok=True)
        name = "quality_cpu-build_retrieval-llama" if self.args.cpu else "quality_gpu_retrieval-llama"
        configs = {"sfi_k256": {"sfi": {"enabled": True, "k": 256, "n_recent": 64}},
                   "sfi_k256_span4": {"sfi": {"enabled": True, "k": 256, "n_recent": 64, "select_span": 4}}}
        base = ["--per-cell", str(self.args.quality_per_cell), "--configs", json.dumps(configs),
                "--out", str(qdir), "--name", name, "--no-plots"]
        if self.args.quality_lengths:
            base += ["--lengths", self.args.quality_lengths]
        attempts = [("float32", base + ["--engine-args", json.dumps({"dtype": "float32"})])]
        attempts.append(("bfloat16", base + ["--engine-args", json.dumps({"dtype": "bfloat16"})]))
        wrapper = ("import sys, runpy; sys.argv = ['scripts/eval_quality.py'] + sys.argv[1:]; import vllm_ext; "
                   "vllm_ext.register(); runpy.run_path('scripts/eval_quality.py', run_name='__main__')")
        t_start = time.monotonic()
        res = None
        for dtype, argv in attempts:
            left = timeout - (time.monotonic() - t_start)
            if left < j["min_s"]:
                break
            rc, text, secs = self.spawn(f"{j['name']}_{dtype}", [sys.executable, "-c", wrapper] + argv, left,
                                        self.child_env())
            path = qdir / f"{name}.json"
            if rc == 0 and path.is_file():
                res = (dtype, path)
                break
            err = short_error(text) or f"exit status {rc}"
            self.failure("quality", j["name"], f"eval_quality ({dtype})", err,
                         workaround="retry in bfloat16" if dtype == "float32" else None)
        if res is None:
            self.result["quality"] = {"error": "eval_quality did not finish (see failures)"}
            self.check("quality", "retrieval-llama accuracy GPU vs CPU", False, "no result")
            return
        dtype, path = res
        for ext in (".json", ".md"):
            src = path.with_suffix(ext)
            if src.is_file():
                shutil.copy(src, self.out / src.name)
        self.result["quality"] = compare_quality(json.loads(path.read_text()), dtype)
        q = self.result["quality"]
        for c in q["configs"]:
            if c.get("cpu_accuracy") is None:
                continue
            ok = abs(c["accuracy"] - c["cpu_accuracy"]) <= self.args.quality_tolerance
            self.check("quality", f"retrieval-llama {c['name']}: accuracy {100 * c['accuracy']:.1f}% here "
                       f"vs {100 * c['cpu_accuracy']:.1f}% on the CPU", ok,
                       f"same output as the CPU for {100 * (c['same_output_as_cpu'] or 0):.1f}% of the samples")


    # -- kernels: paged_decode vs the delegate's kernel --
    def job_kernels(self, j: dict, timeout: float) -> None:
        rc, events, text, secs = self.worker(j, timeout)
        got = [e for e in events if e.get("type") == "kernel"]
        for e in got:
            e = {k: v for k, v in e.items() if k != "type"}
            self.result["kernels"].append(e)
        for e in events:
            if e.get("type") == "error":
                self.failure(j["stage"], j["name"], e.get("phase", "?"), e.get("error", "?"),
                             traceback=e.get("traceback", "")[-3000:])
        if rc is None:
            self.failure(j["stage"], j["name"], "timeout", f"killed after {timeout:.0f} s (estimate x 1.5 / deadline)")
        elif not got:
            self.failure(j["stage"], j["name"], "kernels", short_error(text) or f"exit status {rc}")

    # -- serving: vllm serve + vllm bench serve --
    def _serve_argv(self, j: dict, model_dir: str, port: int) -> list[str]:
        cfg = j["config"]
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--tokenizer", model_dir,
                "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(j["max_model_len"]),
                "--max-num-seqs", str(j["max_num_seqs"]), "--no-enable-prefix-caching", "--port", str(port),
                "--gpu-memory-utilization", str(self.args.gpu_memory_utilization), "--seed", "0"]
        backend = backend_of(cfg, self.args.cpu)
        if backend:
            argv += ["--attention-backend", backend]
        section = speedsfi_section(cfg, j["max_model_len"], self.args.cpu, j["max_num_seqs"])
        if section is not None:
            argv += ["--additional-config", json.dumps({"speedsfi": section})]
            sizes = sorted({1, 2, 4, 8, 16, 32} | {j["max_num_seqs"]})
            sizes = [x for x in sizes if x <= j["max_num_seqs"]]
            argv += ["--compilation-config", json.dumps({"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY",
                                                        "cudagraph_capture_sizes": sizes})]
        if self.state.get("custom_ops_none"):
            argv += ["--compilation-config", json.dumps({"custom_ops": ["none"]})] if section is None else []
        return argv

    def job_serving(self, j: dict, timeout: float) -> None:
        import socket
        import subprocess
        import urllib.request

        t_start = time.monotonic()
        model_dir = make_model_dir(self.args.models_dir, j["model"])
        with socket.socket() as s_:
            s_.bind(("127.0.0.1", 0))
            port = s_.getsockname()[1]
        env = self.child_env(dict(CONFIGS[j["config"]]["env"]))
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        log_path = self.log_path(j["name"] + "_server")
        fo = open(log_path, "ab")
        server = subprocess.Popen(self._serve_argv(j, model_dir, port), stdout=fo, stderr=subprocess.STDOUT,
                                  cwd=str(ROOT), env=env, start_new_session=True)
        rec: dict[str, Any] = dict(model=j["model"], config=j["config"], backend=backend_of(j["config"], False),
                                   input_len=j["input_len"], output_len=j["output_len"], request_rate=j["rate"],
                                   num_prompts=j["num_prompts"], error=None)
        try:
            ready = False
            while time.monotonic() - t_start < timeout * 0.6 and server.poll() is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                    ready = True
                    break
                except Exception:
                    time.sleep(2)
            rec["server_start_s"] = round(time.monotonic() - t_start, 1)
            if not ready:
                text = Path(log_path).read_text(errors="replace")
                rec["error"] = f"server not ready: {short_error(text) or 'timeout'}"
                self.failure(j["stage"], j["name"], "server", rec["error"], log_tail=text[-2000:])
                return
            res_dir = self.work / "serve_results"
            res_dir.mkdir(exist_ok=True)
            fname = re.sub(r"[^A-Za-z0-9._-]+", "_", j["name"]) + ".json"
            bench = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
                     "--base-url", f"http://127.0.0.1:{port}", "--model", model_dir, "--tokenizer", model_dir,
                     "--dataset-name", "random", "--random-input-len", str(j["input_len"]),
                     "--random-output-len", str(j["output_len"]), "--num-prompts", str(j["num_prompts"]),
                     "--request-rate", str(j["rate"]), "--ignore-eos", "--seed", "0", "--save-result",
                     "--result-dir", str(res_dir), "--result-filename", fname]
            left = timeout - (time.monotonic() - t_start)
            rc, text, secs = spawn(bench, self.log_path(j["name"] + "_bench"), left, self.child_env())
            path = res_dir / fname
            if rc == 0 and path.is_file():
                rec.update(serving_summary(json.loads(path.read_text())))
            else:
                rec["error"] = ("killed at the timeout" if rc is None else short_error(text) or f"exit status {rc}")
                self.failure(j["stage"], j["name"], "bench serve", rec["error"], log_tail=text[-2000:])
        finally:
            try:
                import os
                import signal

                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=20)
            except Exception:
                try:
                    os.killpg(server.pid, signal.SIGKILL)
                except Exception:
                    pass
            fo.close()
            self.result["serving"].append(rec)

    # -- checks derived from the records (idempotent: recomputed after every job) --
    def finish_stage_checks(self) -> None:
        self.result["checks"] = [c for c in self.result["checks"] if not c.get("derived")]
        self.result["checks"] += derived_checks(self.result)


SERVE_KEYS = ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms")


def serving_summary(bench_json: dict) -> dict:
    """The numbers kept from ``vllm bench serve --save-result``'s JSON (``output_tok_s`` = its
    ``output_throughput``)."""
    out = {k: bench_json.get(k) for k in SERVE_KEYS}
    out["output_tok_s"] = bench_json.get("output_throughput")
    return out


# (a, b, label, strict): strict checks fail the run when the tokens differ; the others are information
CORRECT_PAIRS = (
    ("speedsfi_dense", "triton", "SPEEDSFI all off == TRITON_ATTN", True),
    ("speedsfi_sfi_full", "speedsfi_dense_pd",
     "SFI budget covering the context == all off through the same dense kernel (paged_decode)", True),
    ("speedsfi_dense_pd", "speedsfi_dense", "all off: paged_decode == the delegate's kernel (two bf16 kernels; "
     "information)", False),
    ("speedsfi_sfi_full", "triton", "SFI budget covering the context vs TRITON_ATTN (two bf16 kernels; "
     "information)", False),
    ("triton_v2", "triton", "TRITON_ATTN on Model Runner V2 == V1 (information)", False),
    ("speedsfi_dense_auto", "flash_attn_v1",
     "SPEEDSFI all off with dense_delegate auto == vLLM's default backend on the V1 runner", True),
)


def derived_checks(result: dict) -> list[dict]:
    checks: list[dict] = []
    recs = [r for r in result.get("correctness", []) if r.get("tokens") is not None]
    by = {(r["stage"], r["model"], r["config"], r.get("mode", "eager")): r for r in recs}
    for (stage, model) in sorted({(r["stage"], r["model"]) for r in recs if r["stage"] == "correct"}):
        for a, b, label, strict in CORRECT_PAIRS:
            ra, rb = by.get((stage, model, a, "eager")), by.get((stage, model, b, "eager"))
            if not (ra and rb):
                continue
            cmp = compare_tokens(ra["tokens"], rb["tokens"])
            checks.append(dict(stage=stage, name=f"{model}: {label}", ok=cmp["identical"] if strict else None,
                               detail={"identical": cmp["identical"], "first_diff": [x["first_diff"] for x in cmp["rows"]],
                                       "same_weights": ra.get("weights_checksum") == rb.get("weights_checksum")},
                               derived=True))
        r = by.get((stage, model, "speedsfi_sfi", "eager"))
        if r:
            c = r.get("counters") or {}
            checks.append(dict(stage=stage, name=f"{model}: speedsfi_sfi runs fast and slow steps",
                               ok=c.get("sfi.fast_steps", 0) > 0 and c.get("sfi.slow_steps", 0) > 0,
                               detail={k: c.get(k, 0) for k in ("sfi.fast_steps", "sfi.slow_steps", "sfi.dense_rows",
                                                                "sfi.fast_retained_tokens", "sfi.fast_context_tokens")},
                               derived=True))
        r = by.get((stage, model, "speedsfi_sfi_full", "eager"))
        if r:
            c = r.get("counters") or {}
            checks.append(dict(stage=stage, name=f"{model}: SFI covering budget decodes dense rows only",
                               ok=c.get("sfi.fast_steps", 0) == 0 and c.get("sfi.dense_rows", 0) > 0,
                               detail={k: c.get(k, 0) for k in ("sfi.fast_steps", "sfi.slow_steps", "sfi.dense_rows")},
                               derived=True))
    # graphs: the SFI engine under FULL CUDA graphs against the same engine eager
    for model in sorted({r["model"] for r in recs if r["stage"] == "graphs"}):
        g, e = by.get(("graphs", model, "speedsfi_sfi_small", "graph")), by.get(("graphs", model, "speedsfi_sfi_small", "eager"))
        if g:
            c = g.get("counters") or {}
            mode = str(g.get("cudagraph_mode") or "")
            cpu = bool((result.get("env") or {}).get("cpu_build"))
            checks.append(dict(stage="graphs", name=f"{model}: SFI runs under FULL CUDA graphs (FULL_DECODE_ONLY)",
                               ok=None if cpu else (bool(g.get("cuda_graphs")) and "FULL" in mode.upper()),
                               detail={"cudagraph_mode": mode, "cuda_graphs": g.get("cuda_graphs")}, derived=True))
            checks.append(dict(stage="graphs", name=f"{model}: fast and slow steps under CUDA graphs",
                               ok=c.get("sfi.fast_steps", 0) > 0 and c.get("sfi.slow_steps", 0) > 0,
                               detail={k: c.get(k, 0) for k in ("sfi.fast_steps", "sfi.slow_steps", "sfi.dense_rows")},
                               derived=True))
        for rec, label in ((g, "graph"), (e, "eager")):
            c = (rec or {}).get("counters") or {}
            if "rows.layer" in c:
                paths = sum(c.get(k, 0) for k in ("rows.delegate", "rows.paged_decode", "rows.sfi_slow",
                                                  "rows.sfi_fast", "rows.critiprefill"))
                checks.append(dict(stage="graphs", name=f"{model} ({label}): every row computed once "
                                   "(rows per path == rows of the layer calls)",
                                   ok=paths == c["rows.layer"] and c.get("steps.mixed", 0) > 0,
                                   detail={k: v for k, v in c.items() if k.startswith("rows.") or k == "steps.mixed"},
                                   derived=True))
        if g and e:
            cmp = compare_tokens(g["tokens"], e["tokens"])
            checks.append(dict(stage="graphs", name=f"{model}: SFI tokens under CUDA graphs == eager",
                               ok=cmp["identical"],
                               detail={"identical": cmp["identical"], "first_diff": [x["first_diff"] for x in cmp["rows"]],
                                       "graph_sha": g.get("tokens_sha"), "eager_sha": e.get("tokens_sha")},
                               derived=True))
    # perf: all off == TRITON_ATTN under the same mode (same prompts and weights)
    rows = [r for r in result.get("rows", []) if r.get("tokens_sha")]
    for r in rows:
        if r["config"] not in ("speedsfi_dense", "speedsfi_sfi"):
            continue
        ref_cfg = "triton" if r["config"] == "speedsfi_dense" else None
        ref = next((x for x in rows if x["config"] == ref_cfg and x["mode"] == r["mode"] and
                    x["input_len"] == r["input_len"] and x["batch"] == r["batch"] and x["model"] == r["model"]), None)
        if ref:
            checks.append(dict(stage="perf", name=f"perf {r['model']} {r['mode']} {r['input_len']} x{r['batch']}: "
                               "SPEEDSFI all off tokens == TRITON_ATTN", ok=r["tokens_sha"] == ref["tokens_sha"],
                               detail=None, derived=True))
    # CritiPrefill: TTFT against SPEEDSFI all off at the same input and batch (information)
    for r in result.get("rows", []):
        if r.get("config") != "speedsfi_critiprefill" or not r.get("ttft_ms"):
            continue
        ref = next((x for x in result["rows"] if x.get("config") == "speedsfi_dense" and x.get("ttft_ms")
                    and x["input_len"] == r["input_len"] and x["batch"] == r["batch"] and x["model"] == r["model"]),
                   None)
        if ref:
            checks.append(dict(stage="critiprefill", name=f"CritiPrefill TTFT {r['model']} {r['input_len']} x{r['batch']}: "
                               f"{r['ttft_ms']:.0f} ms vs all off {ref['ttft_ms']:.0f} ms", ok=None,
                               detail={"speed_up": ref["ttft_ms"] / r["ttft_ms"]}, derived=True))
    return checks
