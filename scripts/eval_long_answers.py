#!/usr/bin/env python
"""Long answers through real vLLM: does SFI's text stay as close to dense's as
dense's own precision noise?

For every document (``vllm_ext.quality.long_answers``: summarise or continue a logbook of about
``--lengths`` tokens), three greedy 256-token answers: dense in bf16, dense in fp32, and the
``--config`` (default the ``sfi`` preset) in bf16, each from a fresh in-process engine. Reports the
mean ROUGE-L F of the config's text against dense bf16's, and of dense bf16's against dense fp32's
(the noise floor: the same exact attention, another precision), per kind and length, and SFI's
counters. Writes ``bench/results/<name>.json``.

    .venv/bin/python scripts/eval_long_answers.py --model .cache/real_model/SmolLM2-135M-Instruct \\
        --lengths 4096,7900 --per-kind 5 --name long_answers_cpu_smollm2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # in-process: counters readable here
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPEEDSFI_TRACE_INTERVAL_S", "0")


def log(msg: str) -> None:
    print(f"[eval_long_answers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="4096,7900", help="prompt bounds; with the answer within the model's 8192 positions")
    p.add_argument("--kinds", default="summary,continue")
    p.add_argument("--per-kind", type=int, default=5, help="documents per (kind, length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--config", default='{"preset": "sfi"}', help="JSON speedsfi section compared with dense")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default="long_answers_cpu_smollm2")
    return p.parse_args(argv)


def run(args, prompts, speedsfi: dict, dtype: str) -> tuple[dict, dict, float]:
    """One engine; every prompt greedily; key -> (text, n_tokens), SFI's counters, wall seconds."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics

    metrics.reset()
    t0 = time.time()
    llm = LLM(model=args.model, enforce_eager=True, max_num_seqs=args.max_num_seqs, dtype=dtype,
              max_model_len=max(len(p.prompt_ids) for p in prompts) + args.max_tokens + 16,
              kv_cache_memory_bytes=768 << 20, attention_backend="SPEEDSFI", max_num_batched_tokens=2048,
              block_size=32, additional_config={"speedsfi": speedsfi} if speedsfi else {}, seed=0)
    try:
        before = metrics.snapshot()
        outs = llm.generate([{"prompt_token_ids": p.prompt_ids} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        after = metrics.snapshot()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    texts = {p.key: dict(text=o.outputs[0].text, n_tokens=len(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)}
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if k.startswith(("sfi.", "fallback."))}
    return texts, counters, time.time() - t0


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv=None):
    args = parse(argv)
    # the code this run imports, before anything is committed during it
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    from transformers import AutoTokenizer

    from vllm_ext.quality.long_answers import make_long_answer_prompt, rouge_l_f

    tok = AutoTokenizer.from_pretrained(args.model)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    kinds = [k for k in args.kinds.split(",") if k]
    prompts = [make_long_answer_prompt(k, n, args.seed + i, tok) for k in kinds for n in lengths
               for i in range(args.per_kind)]
    config = json.loads(args.config)
    runs = {"dense_bf16": ({}, "bfloat16"), "dense_fp32": ({}, "float32"), "config_bf16": (config, "bfloat16")}
    log(f"{len(prompts)} prompts x {len(runs)} runs")
    results = {}
    for name, (section, dtype) in runs.items():
        texts, counters, wall = run(args, prompts, section, dtype)
        results[name] = dict(speedsfi=section, dtype=dtype, outputs=texts, counters=counters, wall_s=wall)
        log(f"{name}: {wall:.0f} s")
    rows = []
    for p in prompts:
        d16, d32, c16 = (results[n]["outputs"][p.key] for n in ("dense_bf16", "dense_fp32", "config_bf16"))
        rows.append(dict(kind=p.kind, length=p.length, seed=p.seed, prompt_tokens=len(p.prompt_ids),
                         config_vs_dense_bf16=rouge_l_f(d16["text"], c16["text"]),
                         dense_bf16_vs_dense_fp32=rouge_l_f(d32["text"], d16["text"]),
                         config_vs_dense_fp32=rouge_l_f(d32["text"], c16["text"]),
                         identical_config_dense_bf16=d16["text"] == c16["text"],
                         identical_dense_bf16_fp32=d16["text"] == d32["text"],
                         tokens={n: results[n]["outputs"][p.key]["n_tokens"] for n in results}))
    groups = {"all": rows}
    for k in kinds:
        for n in lengths:
            groups[f"{k}|{n}"] = [r for r in rows if r["kind"] == k and r["length"] == n]
    summary = {g: dict(n=len(rs), **{m: mean(r[m] for r in rs) for m in
                                     ("config_vs_dense_bf16", "dense_bf16_vs_dense_fp32", "config_vs_dense_fp32")},
                       identical_config_dense_bf16=sum(r["identical_config_dense_bf16"] for r in rs),
                       identical_dense_bf16_fp32=sum(r["identical_dense_bf16_fp32"] for r in rs))
               for g, rs in groups.items()}
    c = results["config_bf16"]["counters"]
    ret, ctx = c.get("sfi.fast_retained_tokens", 0), c.get("sfi.fast_context_tokens", 0)
    import torch
    import vllm

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    meta = dict(command="python scripts/eval_long_answers.py " + " ".join(sys.argv[1:] if argv is None else argv),
                model=os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model,
                device="cpu", device_desc=f"{cpu}, {os.cpu_count()} cores", vllm=vllm.__version__,
                torch=torch.__version__, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=commit, load_average=os.getloadavg(), n_prompts=len(prompts), max_tokens=args.max_tokens,
                metric="ROUGE-L F (rouge-score, no stemming) between two configurations' greedy texts",
                fast_retained_fraction=(ret / ctx) if ctx else None,
                slow_steps=c.get("sfi.slow_steps", 0), fast_steps=c.get("sfi.fast_steps", 0))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.name + ".json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, summary=summary, rows=rows,
                       runs={n: {k: v for k, v in r.items()} for n, r in results.items()}), f, indent=1)
    for g, s in summary.items():
        log(f"{g}: n {s['n']}  config~dense_bf16 {s['config_vs_dense_bf16']:.3f}  "
            f"dense_bf16~dense_fp32 {s['dense_bf16_vs_dense_fp32']:.3f}  config~dense_fp32 {s['config_vs_dense_fp32']:.3f}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
