#!/usr/bin/env python
"""Teacher-forced agreement with dense on long answers through real vLLM.

For every document of ``vllm_ext.quality.long_answers`` (summarise or continue a logbook of about
``--lengths`` tokens, one per kind, length and seed):

1. the reference: dense in ``--reference-dtype`` (bf16) answers greedily (``--max-tokens``); its own
   greedy choices and how decided each was are recorded (``vllm_ext.quality.forced_tokens``);
2. every ``--configs`` entry is run with the reference answer forced token by token: at each step
   the engine's own greedy choice is recorded, then the reference token is written instead, so
   every step's context is the reference's and a disagreement at step t says nothing about step
   t + 1's context. With SFI the backend's per-step recorder gives each step's kind (slow, fast,
   dense) for the same request.

``vllm_ext.quality.forced_agreement`` turns the records into agreement rates (overall, by step kind,
by decode steps since the last slow step, by position in the answer, by how decided the reference
was). Results go to ``bench/results/<name>.json``; a second run with the same ``--name`` reuses the
reference and the configurations already there and adds the new ones.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python scripts/eval_forced_agreement.py \\
        --model .cache/real_model/SmolLM2-135M-Instruct --lengths 4096,7900 --seeds 0,1 \\
        --configs '{"dense_fp32": {"dtype": "float32"}, "sfi_preset": {"speedsfi": {"preset": "sfi"}}}' \\
        --name forced_agreement_cpu_smollm2_tune
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
# in-process engine: the logits processor's records and the backend's recorder are read here
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPEEDSFI_TRACE_INTERVAL_S", "0")


def log(msg: str) -> None:
    print(f"[eval_forced_agreement {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="4096,7900")
    p.add_argument("--kinds", default="summary,continue")
    p.add_argument("--seeds", default="0,1", help="document seeds (one document per kind, length and seed)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reference-dtype", default="bfloat16")
    p.add_argument("--configs", default="{}",
                   help='JSON {name: {"dtype": ..., "speedsfi": {...}}}: forced on the reference, each in its own engine')
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-mib", type=int, default=3072, help="enough for every request at once (no preemption)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", required=True)
    p.add_argument("--reference-from", default=None,
                   help="another results JSON whose reference answers this run forces (same documents)")
    return p.parse_args(argv)


def engine_run(args, prompts, speedsfi: dict, dtype: str, forced: dict | None):
    """One fresh engine on ``prompts``; ``forced``: key -> reference tokens (None: the reference run).
    Returns (key -> output tokens, key -> records, key -> step kinds or None, SFI counters, seconds)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics
    from vllm_ext.quality import forced_tokens as F
    from vllm_ext.quality.forced_agreement import request_modes
    from vllm_ext.runner_hooks import table_of

    metrics.reset()
    F.RECORDS.clear()
    t0 = time.time()
    llm = LLM(model=args.model, enforce_eager=True, max_num_seqs=args.max_num_seqs, dtype=dtype,
              max_model_len=max(len(p.prompt_ids) for p in prompts) + args.max_tokens + 16,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, attention_backend="SPEEDSFI", max_num_batched_tokens=2048,
              block_size=32, additional_config={"speedsfi": speedsfi} if speedsfi else {}, seed=0,
              logits_processors=[F.ForcedTokensProcessor])
    try:
        worker = llm.llm_engine.model_executor.driver_worker
        table = table_of(getattr(worker, "worker", worker).model_runner)
        recording = table is not None and table.sfi is not None
        if recording:
            table.recorder = []
        params = []
        for p in prompts:
            ref = None if forced is None else forced[p.key]
            params.append(SamplingParams(temperature=0, max_tokens=args.max_tokens if ref is None else len(ref),
                                         ignore_eos=ref is not None, extra_args=F.force_args(p.key, ref)))
        before = metrics.snapshot()
        outs = llm.generate([{"prompt_token_ids": p.prompt_ids} for p in prompts], params, use_tqdm=False)
        after = metrics.snapshot()
        snapshots = table.recorder if recording else None
        if recording:
            table.recorder = None
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    tokens = {p.key: list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
    texts = {p.key: o.outputs[0].text for p, o in zip(prompts, outs)}
    records = {p.key: [F.RECORDS[p.key][s] for s in sorted(F.RECORDS[p.key])] for p in prompts}
    modes = {p.key: (request_modes(snapshots, o.request_id, len(tokens[p.key])) if snapshots is not None else None)
             for p, o in zip(prompts, outs)}
    unrecorded = [k for k, m in modes.items() if snapshots is not None and m is None]
    if unrecorded:
        raise RuntimeError(f"the backend's recorder does not hold every decode step of {unrecorded}")
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if k.startswith(("sfi.", "fallback."))}
    return tokens, texts, records, modes, counters, time.time() - t0


def main(argv=None):
    args = parse(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    from transformers import AutoTokenizer

    from vllm_ext.quality.forced_agreement import step_rows, summarise
    from vllm_ext.quality.long_answers import make_long_answer_prompt

    tok = AutoTokenizer.from_pretrained(args.model)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    kinds = [k for k in args.kinds.split(",") if k]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    prompts = [make_long_answer_prompt(k, n, s, tok) for s in seeds for k in kinds for n in lengths]
    path = os.path.join(args.out, args.name + ".json")
    res = json.load(open(path)) if os.path.exists(path) else dict(meta={}, reference={}, configs={})

    def save():
        os.makedirs(args.out, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=None, separators=(",", ":"))
        os.replace(tmp, path)

    if args.reference_from:
        other = json.load(open(args.reference_from))["reference"]
        for p in prompts:
            if p.key in other and p.key not in res["reference"]:
                assert other[p.key]["prompt_tokens"] == len(p.prompt_ids), f"{p.key}: another document"
                res["reference"][p.key] = other[p.key]
    missing = [p for p in prompts if p.key not in res["reference"]]
    if missing:
        log(f"reference (dense {args.reference_dtype}): {len(missing)} documents")
        tokens, texts, records, _, _, wall = engine_run(args, missing, {}, args.reference_dtype, None)
        for p in missing:
            recs = records[p.key]
            assert [r.argmax for r in recs] == tokens[p.key], f"{p.key}: the records are not the greedy answer"
            res["reference"][p.key] = dict(kind=p.kind, length=p.length, seed=p.seed, prompt_tokens=len(p.prompt_ids),
                                           dtype=args.reference_dtype, tokens=tokens[p.key], text=texts[p.key],
                                           gap=[round(r.gap, 4) for r in recs])
        res.setdefault("reference_wall_s", {})[",".join(p.key for p in missing)] = wall
        log(f"reference: {wall:.0f} s")
        save()
    forced = {p.key: res["reference"][p.key]["tokens"] for p in prompts}
    for name, cfg in json.loads(args.configs).items():
        done = res["configs"].get(name, {}).get("requests", {})
        todo = [p for p in prompts if p.key not in done]
        if not todo:
            continue
        speedsfi, dtype = cfg.get("speedsfi", {}), cfg.get("dtype", "bfloat16")
        log(f"{name}: {len(todo)} documents forced")
        tokens, _, records, modes, counters, wall = engine_run(args, todo, speedsfi, dtype, forced)
        entry = res["configs"].setdefault(name, dict(speedsfi=speedsfi, dtype=dtype, requests={}, runs=[]))
        for p in todo:
            assert tokens[p.key] == forced[p.key], f"{name} {p.key}: the forced run did not write the reference"
            recs = records[p.key]
            entry["requests"][p.key] = dict(argmax=[r.argmax for r in recs], margin=[round(r.margin, 4) for r in recs],
                                            modes=modes[p.key])
        entry["runs"].append(dict(keys=[p.key for p in todo], counters=counters, wall_s=wall, commit=commit,
                                  date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                                  load_average=os.getloadavg()))
        log(f"{name}: {wall:.0f} s")
        save()
    # summaries over the documents of this invocation
    import torch
    import vllm

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    res["meta"] = dict(model=os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model,
                       device="cpu", device_desc=f"{cpu}, {os.cpu_count()} cores", vllm=vllm.__version__,
                       torch=torch.__version__, commit=commit, max_tokens=args.max_tokens,
                       date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       reference_dtype=args.reference_dtype,
                       measure="teacher-forced top-1 agreement: at each step of the reference (dense) answer, "
                               "the configuration's greedy choice given the reference's prefix")
    res["summary"] = {}
    for name, entry in res["configs"].items():
        keys = [p.key for p in prompts if p.key in entry["requests"]]
        rows = [r for k in keys for r in step_rows(res["reference"][k], entry["requests"][k], k)]
        c = {}
        for run in entry["runs"]:
            for key, v in run["counters"].items():
                c[key] = c.get(key, 0) + v
        ret, ctx = c.get("sfi.fast_retained_tokens", 0), c.get("sfi.fast_context_tokens", 0)
        res["summary"][name] = dict(documents=keys, **summarise(rows),
                                    fast_retained_fraction=(ret / ctx) if ctx else None,
                                    slow_steps=c.get("sfi.slow_steps", 0), fast_steps=c.get("sfi.fast_steps", 0))
        s = res["summary"][name]
        log(f"{name}: {len(keys)} docs, agree {s['agree']:.4f} ({s['disagree_n']} of {s['n']} differ)  "
            f"by kind {json.dumps({k: round(v['agree'], 4) for k, v in s['by_mode'].items()})}  "
            f"fast read {s['fast_retained_fraction']}")
    save()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
