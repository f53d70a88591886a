#!/usr/bin/env python3
"""Real vLLM 0.32 + SPEEDSFI end to end on a GPU: SFI under CUDA graphs, correctness, quality,
performance against what users run by default, and serving.

Run on the GPU machine by ``scripts/gpu_e2e.sh`` (which unpacks the payload of
``scripts/gpu_vllm_bundle.sh`` and puts it on ``PYTHONPATH``); the documented invocation is five
calls of at most 520 s each: 1 and 2 in a session's 15 minutes of device time (``session``
prints that budget), 3 to 6 in later sessions (``--call N`` picks a call's stages and configurations)::

    python bench/vllm_e2e.py --call 1 --out $OUT --deadline-s 520   # graphs == eager; 32K x max: SFI vs vLLM's default + kernel tables
    python bench/vllm_e2e.py --call 2 --out $OUT --deadline-s 520   # all off (auto) == FLASH_ATTN V1 token for token
    python bench/vllm_e2e.py --call 3 --out $OUT --deadline-s 520   # 128K rows
    python bench/vllm_e2e.py --call 4 --out $OUT --deadline-s 520   # 8K rows; serving (vllm bench serve)
    python bench/vllm_e2e.py --call 5 --out $OUT --deadline-s 520   # 32K: runner share, all off, SFI + SPEED, CritiPrefill
    python bench/vllm_e2e.py --call 6 --out $OUT --deadline-s 520   # Llama-3.1-8B token checks; quality
    python bench/vllm_e2e.py --call 1 --dry-run                     # the plan and its time estimate; no vLLM, no GPU
    python bench/vllm_e2e.py session                                # a session's calls against its device time
    python bench/vllm_e2e.py report --merge a.json b.json --out bench/results   # merge + re-plot (CPU)
    python bench/vllm_e2e.py smoke,graphs --out $OUT               # or any stages by name

This process never imports vLLM or torch: every job (one engine: a backend, a SPEEDSFI
configuration, eager or CUDA graphs) runs in its own subprocess, killed at its own estimate x 1.5 or
at the call's deadline; a failure is recorded with its exact error and the run goes on; the JSON is
rewritten after every job. The modules:

* ``e2e_stages.py``: the stages and each call's plan, the job kinds, the derived checks;
* ``e2e_jobs.py``: the job runner (subprocess, process group, deadline and hang kill, failure record);
* ``e2e_timing.py``: the timing rules (TPOT, TTFT, tok/s, KV GB/s), row schema, job estimates;
* ``e2e_report.py``: quality vs the CPU, plot, merge, markdown;
* ``e2e_models.py``: model shapes, configurations, model folders and prompts;
* ``e2e_worker.py``: the subprocess side (the only code that imports vLLM / torch).

Stages (``e2e_stages`` describes each): smoke, graphs, kernels, sfi_perf, correct, quality, perf,
critiprefill, serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the modules (re-exported: tests and tools address the driver as one module)
from e2e_jobs import (JSON_NAME, LOGS_TAR, PNG_NAME, ROOT, SCHEMA, JobRunner, job_timeout,  # noqa: E402,F401
                      log, looks_like_c_op_failure, short_error, spawn)
from e2e_models import (CONFIGS, MODELS, N_SPECIAL, SFI_CPU, SFI_SMALL, TRIGGER_EVERY,  # noqa: E402,F401
                        backend_of, build_tokenizer, kv_bytes_per_token, make_model_dir, make_prompts,
                        param_count, speedsfi_section, token_strings, trigger_ids, write_config)
from e2e_report import (compare_quality, markdown_report, merge_results, plot_perf,  # noqa: E402,F401
                        summary_table)
from e2e_stages import (CALL_DEADLINE_S, CALL_OPTIONS, CALLS, SESSION_PLAN, STAGES, Run, build_plan,  # noqa: E402,F401
                        derived_checks, parse_batches, plan_total, print_plan, serving_summary,
                        session_total)
from e2e_timing import (HANG_FACTOR, PERF_ROW_KEYS, compare_tokens, decode_timing,  # noqa: E402,F401
                        est_engine_s, hang_timeout, kv_gbps, make_perf_row, sfi_summary, tokens_digest)

CORRECT_CONFIGS = {
    # the strict pair on every model: SFI with a covering budget == all off through the same dense
    # kernel (paged_decode); Qwen3-4B also the SFI preset's fast and slow steps. All off == TRITON_ATTN
    # is checked by the perf stage (Qwen3-4B, 8K..128K, CUDA graphs; eager on the H100 route);
    # --correct-configs triton,speedsfi_dense,... adds the eager pair for every model.
    "*": ["speedsfi_dense_pd", "speedsfi_sfi_full"],
    "qwen3-4b": ["speedsfi_dense_pd", "speedsfi_sfi_full", "speedsfi_sfi"],
    "cpu-tiny-llama": ["triton", "speedsfi_dense", "speedsfi_dense_pd", "speedsfi_sfi_full", "speedsfi_sfi"],
    "cpu-tiny-qwen3": ["speedsfi_dense_pd", "speedsfi_sfi_full", "speedsfi_sfi"],
}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="?", default=None,
                    help=f"comma list of {','.join(STAGES)} | all | plan | session | report | note (or --call N)")
    ap.add_argument("--call", type=int, choices=sorted(CALLS), default=None,
                    help="one call of the documented invocation: its stages and configurations "
                         + "; ".join(f"{k}: {v['stages']}" for k, v in CALLS.items()))
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "vllm_e2e"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate; run nothing")
    ap.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_E2E_BUDGET_S", CALL_DEADLINE_S)),
                    help="wall-time budget of this invocation; jobs that no longer fit are skipped (recorded)")
    ap.add_argument("--cpu", action="store_true", help="the CPU build of vLLM with tiny models (tests)")
    ap.add_argument("--models-dir", default=os.environ.get("VLLM_E2E_MODELS", "/tmp/vllm_e2e_models"))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--custom-ops", choices=("auto", "none"), default="auto",
                    help="auto: vLLM's _C kernels unless they fail (then ['none'], recorded); none: always native")
    ap.add_argument("--graph-mode", choices=("full_decode", "piecewise", "vllm_default"), default="full_decode",
                    help="CUDA-graph runs: full_decode = compilation mode NONE + FULL_DECODE_ONLY graphs (no "
                         "torch.compile; default, every configuration alike); piecewise = VLLM_COMPILE + "
                         "PIECEWISE; vllm_default = vLLM's own")
    ap.add_argument("--weights", choices=("sharp", "dummy"), default="sharp")
    # correctness
    ap.add_argument("--correct-models", default="llama-3.1-8b,qwen3-4b")
    ap.add_argument("--correct-configs", default=None,
                    help="comma list of configurations for every correctness model (default: per model, "
                         "CORRECT_CONFIGS)")
    ap.add_argument("--correct-lengths", default="6000,4400,3000,1200",
                    help="prompt lengths of the correctness batch (longer than SFI's preset budget)")
    ap.add_argument("--correct-output-len", type=int, default=128)
    # quality
    ap.add_argument("--quality-per-cell", type=int, default=3)
    ap.add_argument("--quality-lengths", default=None)
    ap.add_argument("--quality-tolerance", type=float, default=0.05,
                    help="accuracy difference GPU vs CPU accepted as 'the same' (fp32 vs fp32, other kernels)")
    # performance
    ap.add_argument("--perf-models", default="qwen3-4b")
    ap.add_argument("--perf-configs", default="vllm_default,triton,speedsfi_dense",
                    help="the perf stage's baselines")
    ap.add_argument("--sfi-perf-configs", default="speedsfi_sfi,speedsfi_sfi_speed",
                    help="the sfi_perf stage's configurations (run before the baselines)")
    ap.add_argument("--modes", default="graph")
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", default="8192:16,32768:4,65536:2,131072:1",
                    help="input_len:batch (or :max = as many as the KV cache holds); capped by the fit")
    ap.add_argument("--default-batch", type=int, default=1)
    ap.add_argument("--eager-max-len", type=int, default=32768, help="eager runs only up to this input length")
    ap.add_argument("--critiprefill-min-len", type=int, default=32768)
    ap.add_argument("--ttft-output-len", type=int, default=16)
    # serving
    ap.add_argument("--serve-configs", default="vllm_default,speedsfi_sfi")
    ap.add_argument("--serve-input-len", type=int, default=32768)
    ap.add_argument("--serve-output-len", type=int, default=256)
    ap.add_argument("--serve-rate", type=float, default=0.5, help="requests per second (Poisson)")
    ap.add_argument("--serve-prompts", type=int, default=16)
    ap.add_argument("--serve-max-seqs", type=int, default=16)
    ap.add_argument("--profile", type=int, default=0,
                    help="perf engines: after each group, a kernel table of a decode window (vLLM's torch "
                         "profiler over PROFILE_STEPS decode steps; 0 = off)")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--no-plot", action="store_true")
    # report / note
    ap.add_argument("--merge", nargs="*", default=None, help="report: JSON files to merge")
    ap.add_argument("--error", default=None, help="note: an error to record")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.call is not None:
        call = CALLS[args.call]
        if args.stages is None:
            args.stages = call["stages"]
        for key in CALL_OPTIONS:
            if key in call:
                value = call[key]
                setattr(args, key, type(getattr(args, key))(value) if isinstance(getattr(args, key),
                                                                       (int, float)) else value)
    s = args.stages
    if s is None:
        ap.error("give stages or --call N")
    args.stages = list(STAGES) if s == "all" else [x for x in s.split(",") if x]
    if s not in ("plan", "session", "report", "note", "_worker"):
        bad = [x for x in args.stages if x not in STAGES]
        if bad:
            ap.error(f"unknown stage(s) {bad}; choose from {STAGES}, all, plan, report, note")
    if s in ("plan", "session"):
        args.dry_run = True
        args.stages = list(STAGES)
    args.correct_models = [m for m in args.correct_models.split(",") if m]
    args.perf_models = [m for m in args.perf_models.split(",") if m]
    args.perf_configs = [c for c in args.perf_configs.split(",") if c]
    args.sfi_perf_configs = [c for c in args.sfi_perf_configs.split(",") if c]
    args.serve_configs = [c for c in args.serve_configs.split(",") if c]
    args.modes = [m for m in args.modes.split(",") if m]
    args.lengths = ints(args.lengths)
    args.correct_lengths = ints(args.correct_lengths)
    if args.cpu:
        # tiny models through the CPU build: the same code path at test sizes
        if args.correct_models == ["llama-3.1-8b", "qwen3-4b"]:
            args.correct_models = ["cpu-tiny-llama", "cpu-tiny-qwen3"]
        if args.perf_models == ["qwen3-4b"]:
            args.perf_models = ["cpu-tiny-qwen3"]
        if args.lengths == [8192, 32768, 65536, 131072]:
            args.lengths = [96, 200]
        if args.correct_lengths == [6000, 4400, 3000, 1200]:
            args.correct_lengths = [120, 90, 60, 20]
        if args.batches == "8192:16,32768:4,65536:2,131072:1":
            args.batches = "96:2,200:1"
        if args.output_len == 256:
            args.output_len = 24
        if args.correct_output_len == 128:
            args.correct_output_len = 16
        if args.critiprefill_min_len == 32768:
            args.critiprefill_min_len = 96
        args.eager_max_len = max(args.lengths)
        if args.modes == ["graph"]:
            args.modes = ["eager"]          # no CUDA graphs on the CPU build
    args.correct_configs = (dict(CORRECT_CONFIGS) if args.correct_configs is None
                            else {"*": [c for c in args.correct_configs.split(",") if c]})
    for m in args.correct_models + args.perf_models:
        if m not in MODELS:
            ap.error(f"unknown model {m}; choose from {sorted(MODELS)}")
    configs = args.perf_configs + args.sfi_perf_configs + args.serve_configs + [
        c for cs in args.correct_configs.values() for c in cs]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c}; choose from {sorted(CONFIGS)}")
    return args, s


def call_estimate(call: int, argv: list[str] | None = None) -> float:
    """The driver's estimate of call ``call``'s plan (seconds; no vLLM, no GPU)."""
    args, _ = parse(["--call", str(call), *(argv or [])])
    return plan_total(build_plan(args))


def print_session(args) -> int:
    """One lent session: its calls' estimates, start-up, the stash call and each call's transfer,
    against the device time a session has (``e2e_stages.SESSION_PLAN``)."""
    plan = SESSION_PLAN
    extra = ["--cpu"] if args.cpu else []
    est = {c: call_estimate(c, extra) for c in plan["calls"]}
    total = session_total(est, plan)
    print(f"session: start ~{plan['start_s']} s, stash call ~{plan['stash_call_s']} s, "
          + ", ".join(f"call {c} ~{est[c]:.0f} s + {plan['per_call_overhead_s']} s transfer and unpack"
                      for c in plan["calls"]))
    fits = total <= plan["device_budget_s"]
    print(f"session total ~{total:.0f} s ({total / 60:.1f} min) of {plan['device_budget_s']} s of device time"
          + (" (fits)" if fits else " -- OVER"))
    return 0 if fits else 1


def main(argv=None) -> int:
    args, raw = parse(argv)
    if raw == "_worker":
        from e2e_worker import worker_main

        return worker_main(args.spec)
    if raw == "report":
        parts = [json.loads(Path(p).read_text()) for p in (args.merge or [Path(args.out) / JSON_NAME])]
        res = merge_results(parts) if len(parts) > 1 else parts[0]
        res["checks"] = [c for c in res.get("checks", []) if not c.get("derived")] + derived_checks(res)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / JSON_NAME).write_text(json.dumps(res, indent=1, default=str))
        plot_perf(res, out / PNG_NAME)
        print(markdown_report(res))
        return 0
    if raw == "note":
        run = Run(args)
        run.failure("setup", "gpu_e2e.sh", "setup", args.error or "unknown")
        run.write()
        return 0
    if raw == "session":
        return print_session(args)
    jobs = build_plan(args)
    print_plan(jobs, args)
    if args.dry_run:
        heavy = [m for m in ("vllm", "torch", "transformers") if m in sys.modules]
        print(f"heavy modules imported by the plan: {heavy or 'none'}")
        return 0
    return Run(args).run(jobs)


if __name__ == "__main__":
    sys.exit(main())
