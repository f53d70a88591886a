#!/usr/bin/env python
"""Quality harness: RULER-style retrieval tasks through real vLLM, dense vs SFI (and later methods).

For every configuration (a fresh in-process engine each, attention backend SPEEDSFI) it runs the
whole task suite with greedy decoding and records, per task / length / depth: exact-match accuracy,
agreement with the dense configuration (the greedy continuations identical token for token), and
the SFI retained fraction (vLLM_ext's device counters: ``sfi.fast_retained_tokens`` /
``sfi.fast_context_tokens``). Writes JSON and plots under ``bench/results/``.

    # the committed suite on the committed model (CPU build):
    .venv/bin/python scripts/eval_quality.py
    # later methods / other budgets: a JSON or YAML list of {"name": ..., "speedsfi": {...}}
    .venv/bin/python scripts/eval_quality.py --configs my_configs.yaml
    # a real model on a GPU, RULER text prompts sized with its tokenizer:
    python scripts/eval_quality.py --model Qwen/Qwen3-4B --text --lengths 8192,16384 \\
        --ks 512,1024,2048 --n-recent 256 --engine-args '{"dtype": "bfloat16"}'

The dense configuration (SPEEDSFI with every method off) is always run first: it is the reference
for "agreement with dense".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # in-process: counters readable here
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPEEDSFI_TRACE_INTERVAL_S", "0")

from vllm_ext.quality import tasks as T  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "models", "retrieval-llama")


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def log(msg: str) -> None:
    print(f"[eval_quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--text", action="store_true",
                   help="RULER text prompts sized with the model's tokenizer (any HF model); "
                        "default: the tiny model's word-level prompts (token ids)")
    p.add_argument("--chat", action="store_true",
                   help="with --text: ask through the model's chat template (instruction, context and "
                        "question as the user's turn, the answer prefix opening the assistant's), as an "
                        "instruct model is used")
    p.add_argument("--filler", choices=T.FILLERS, default="plain",
                   help="haystack style of the token-id prompts (tasks.make_sample): plain (the default) "
                        "or prose (3-25-word sentences with commas, . ; ? enders, paragraph breaks)")
    p.add_argument("--tasks", default=None,
                   help=f"default: {','.join(T.TASKS)}; with --text also {','.join(T.LONG_ANSWER_TASKS)} "
                        "(several sentences copied from the context, scored by ROUGE-L)")
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--per-cell", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wordings", default="ruler",
                   help=f"with --text: niah_single's wordings, comma-separated, of {','.join(T.TEXT_WORDINGS)}")
    p.add_argument("--user-forms", default=None,
                   help="with --text: single-needle prompts as a user writes them instead of --tasks/--wordings "
                        "(vllm_ext.quality.user_needles: prose, the value in a record card, a sentence, a table "
                        "row, a quoted e-mail, a ticket or a text message; a plain chat question): "
                        "comma-separated, of card,vault,table,email,ticket,sms")
    p.add_argument("--value-digits", default="7",
                   help="with --text: digits of each value; a comma-separated list runs each length")
    p.add_argument("--ks", default="64,128,256,512", help="SFI budgets of the default configurations")
    p.add_argument("--n-recent", type=int, default=64)
    p.add_argument("--configs", default=None,
                   help="JSON or YAML file (or inline JSON): a list of {name, speedsfi[, engine_args]} "
                        "or a mapping name -> speedsfi section; replaces the default SFI configurations "
                        "(SPEED configurations run with prefix caching off)")
    p.add_argument("--engine-args", default="{}", help="JSON of extra vllm.LLM arguments")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--extra-tokens", type=int, default=4,
                   help="greedy tokens beyond the expected answer (agreement covers them too)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None, help="file stem; default quality_<device>_<model>")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resume", default=None, metavar="JSON[,JSON...]",
                   help="take the configurations already run in these earlier JSONs on these samples (or "
                        "more; same name and section) from them instead of running them again; with every configuration "
                        "found, this only writes the combined report")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="rewrite the markdown tables of an earlier run's JSON (no engines) and exit")
    return p.parse_args(argv)


def load_configs(args) -> list[dict]:
    dense = {"name": "dense", "speedsfi": {}}
    if args.configs:
        src = args.configs
        if os.path.exists(src):
            with open(src) as f:
                text = f.read()
            if src.endswith((".yaml", ".yml")):
                import yaml

                raw = yaml.safe_load(text)
            else:
                raw = json.loads(text)
        else:
            raw = json.loads(src)
        if isinstance(raw, dict):
            raw = [{"name": k, "speedsfi": v or {}} for k, v in raw.items()]
        configs = [dict({"name": c["name"], "speedsfi": c.get("speedsfi") or {}},
                        **({"engine_args": c["engine_args"]} if c.get("engine_args") else {}))
                   for c in raw]
    else:
        configs = [{"name": f"sfi_k{k}", "speedsfi": {"sfi": {"enabled": True, "k": int(k),
                                                              "n_recent": args.n_recent}}}
                   for k in args.ks.split(",") if k]
    configs = [c for c in configs if c["name"] != "dense"]
    return [dense] + configs


def device_name() -> tuple[str, str]:
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "cpu", f"{cpu}, {os.cpu_count()} cores"


def build_samples(args, tokenizer):
    tasks = [t for t in (args.tasks or ",".join(T.TEXT_TASKS if args.text else T.TASKS)).split(",") if t]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    depths = [float(x) for x in args.depths.split(",") if x]
    if not args.text:
        return T.make_suite(tasks, lengths, depths, args.per_cell, seed=args.seed, filler=args.filler)
    wordings = [w for w in args.wordings.split(",") if w]
    digits = [int(x) for x in str(args.value_digits).split(",") if x]
    if args.user_forms:
        from vllm_ext.quality.user_needles import make_user_needle

        # chat-templated already (no answer prefix): --chat does not apply to them
        return [make_user_needle(f, n, d, args.seed + 1000 * j + 100 * v + i, tokenizer, value_digits=nd)
                for j, f in enumerate(f for f in args.user_forms.split(",") if f)
                for v, nd in enumerate(digits)
                for n in lengths for d in depths for i in range(args.per_cell)]
    # each (wording, value length) takes its own seeds: seed + 1000 x its place in --wordings + 100 x
    # its place in --value-digits (a sample's key stays (task, length, depth, seed))
    samples = [T.make_text_sample(t, n, d, args.seed + 1000 * j + 100 * v + i, tokenizer, wording=w,
                                  value_digits=nd)
               for t in tasks for j, w in enumerate(wordings if t == "niah_single" else ["ruler"])
               for v, nd in enumerate(digits)
               for n in lengths for d in depths for i in range(args.per_cell)]
    if args.chat:
        samples = [T.chat_sample(s, tokenizer) for s in samples]
    return samples


def max_tokens_of(args, s) -> int:
    if args.text:
        return {"niah_multivalue": 96, "passage_copy": 80}.get(s.task, 32)
    return len(s.answer_ids) + args.extra_tokens


def run_config(args, cfg, samples, on_cuda):
    """One engine; every sample greedily; returns per-sample outputs and per-length SFI counters."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics

    lengths = sorted({s.meta.get("requested_length", s.length) for s in samples})
    settings = dict(enforce_eager=True, max_num_seqs=args.max_num_seqs,
                    max_model_len=max(s.length for s in samples) + 128,
                    kv_cache_memory_bytes=args.kv_cache_bytes, attention_backend="SPEEDSFI",
                    additional_config={"speedsfi": cfg["speedsfi"]} if cfg["speedsfi"] else {},
                    seed=0)
    if not on_cuda:
        settings.update(dtype="float32", max_num_batched_tokens=2048, block_size=32)
    if (cfg["speedsfi"].get("speed") or {}).get("enabled"):
        settings["enable_prefix_caching"] = False     # SPEED refuses prefix caching at start-up
    settings.update(json.loads(args.engine_args))
    settings.update(cfg.get("engine_args") or {})
    metrics.reset()
    t0 = time.time()
    llm = LLM(model=args.model, **settings)
    startup = time.time() - t0
    outputs: dict[tuple, list[int] | str] = {}
    counters = {}
    try:
        before = metrics.snapshot()
        for n in lengths:
            group = [s for s in samples if s.meta.get("requested_length", s.length) == n]
            params = [SamplingParams(temperature=0, max_tokens=max_tokens_of(args, s), ignore_eos=not args.text)
                      for s in group]
            t1 = time.time()
            outs = llm.generate([{"prompt_token_ids": s.prompt_ids} for s in group], params, use_tqdm=False)
            for s, o in zip(group, outs):
                outputs[s.key] = o.outputs[0].text if args.text else list(o.outputs[0].token_ids)
                outputs[s.key + ("ids",)] = list(o.outputs[0].token_ids)
            after = metrics.snapshot()
            counters[n] = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
                           if k.startswith(("sfi.", "speed.", "critiprefill.", "fallback."))}
            before = after
            log(f"  {cfg['name']}: length {n}: {len(group)} samples in {time.time() - t1:.1f} s")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    return outputs, counters, startup, time.time() - t0


def _same_output(a: dict, b: dict, key: tuple) -> bool:
    """Greedy continuations identical token for token (text where an older JSON kept no ids)."""
    ia, ib = a.get(key + ("ids",)), b.get(key + ("ids",))
    if isinstance(ia, list) and isinstance(ib, list):
        return ia == ib
    return a[key] == b[key]


def resumed_results(paths: str, samples) -> dict:
    """name -> results of configurations in earlier JSONs whose samples are these samples."""
    keys = {(s.task, s.meta.get("requested_length", s.length), s.depth, s.seed): s.key for s in samples}
    found = {}
    for path in [p for p in paths.split(",") if p]:
        with open(path) as f:
            data = json.load(f)
        for c in data["configs"]:
            rows = [r for r in c["samples"] if (r["task"], r["length"], r["depth"], r["seed"]) in keys]
            if len(rows) != len(samples):
                log(f"--resume: {path}: {c['name']} has other samples; not taken")
                continue
            outputs = {}
            for r in rows:
                k = keys[(r["task"], r["length"], r["depth"], r["seed"])]
                outputs[k] = r["output"]
                outputs[k + ("ids",)] = r.get("output_ids")
            found[c["name"]] = dict(outputs=outputs, counters={int(n): v for n, v in c["counters"].items()},
                                    startup_s=c["startup_s"], wall_s=c["wall_s"], speedsfi=c["speedsfi"])
    return found


def summarise(args, configs, samples, results):
    """accuracy / agreement / retained fraction per config, per task, per (task, length, depth)."""
    dense_out = results["dense"]["outputs"]

    def score(s, out):
        if args.text:
            return T.sample_score(s, out)
        return float(T.exact_match(s, out))

    def decode_context(group, outs):
        # tokens of KV each decode step could read: a sample with n generated tokens runs n - 1
        # decode steps (the first token comes from the prefill) over contexts L+1 .. L+n-1
        total = 0
        for s in group:
            n = len(outs[s.key + ("ids",)] or [])        # none kept by an older JSON: dense anyway
            total += sum(s.length + i for i in range(1, n))
        return total

    table = []
    for cfg in configs:
        name = cfg["name"]
        outs = results[name]["outputs"]
        rows = []
        for s in samples:
            out_text = outs[s.key] if args.text else " ".join(T.words_of(outs[s.key]))
            rows.append(dict(task=s.task, length=s.meta.get("requested_length", s.length), depth=s.depth,
                             seed=s.seed, wording=s.meta.get("wording", "ruler"),
                             prompt_tokens=s.length, correct=score(s, outs[s.key]),
                             agree=_same_output(outs, dense_out, s.key),
                             expected=s.answer, output=out_text, output_ids=outs[s.key + ("ids",)]))
        c_all = results[name]["counters"]
        ret = sum(c.get("sfi.fast_retained_tokens", 0) for c in c_all.values())
        ctx = sum(c.get("sfi.fast_context_tokens", 0) for c in c_all.values())
        total_ctx = decode_context(samples, outs)
        per_length = {}
        for n, c in c_all.items():
            g = [s for s in samples if s.meta.get("requested_length", s.length) == n]
            tc = decode_context(g, outs)
            r, x = c.get("sfi.fast_retained_tokens", 0), c.get("sfi.fast_context_tokens", 0)
            per_length[str(n)] = dict(fast_retained_fraction=(r / x) if x else 1.0,
                                      read_fraction=(tc - x + r) / tc if tc else 1.0,
                                      fast_steps=c.get("sfi.fast_steps", 0), slow_steps=c.get("sfi.slow_steps", 0),
                                      dense_rows=c.get("sfi.dense_rows", 0))

        def acc(sel):
            sel = list(sel)
            return sum(r["correct"] for r in sel) / len(sel) if sel else float("nan")

        def agr(sel):
            sel = list(sel)
            return sum(r["agree"] for r in sel) / len(sel) if sel else float("nan")

        cells = {}
        for r in rows:
            cells.setdefault(f"{r['task']}|{r['length']}|{r['depth']}", []).append(r)
        table.append(dict(
            name=name, speedsfi=cfg["speedsfi"],
            accuracy=acc(rows), agreement_with_dense=agr(rows),
            fast_retained_fraction=(ret / ctx) if ctx else 1.0,
            read_fraction=(total_ctx - ctx + ret) / total_ctx if total_ctx else 1.0,
            counters={str(n): c for n, c in c_all.items()},
            per_length=per_length,
            per_task={t: dict(accuracy=acc(r for r in rows if r["task"] == t),
                              agreement_with_dense=agr(r for r in rows if r["task"] == t))
                      for t in dict.fromkeys(s.task for s in samples)},
            per_task_length={f"{t}|{n}": acc(r for r in rows if r["task"] == t and r["length"] == n)
                             for t in dict.fromkeys(s.task for s in samples)
                             for n in sorted({r["length"] for r in rows})},
            cells={k: dict(accuracy=acc(v), agreement_with_dense=agr(v), n=len(v)) for k, v in cells.items()},
            samples=rows,
            startup_s=results[name]["startup_s"], wall_s=results[name]["wall_s"],
        ))
    return table


def plot(path_stem, table, samples, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(dict.fromkeys(s.task for s in samples))
    lengths = sorted({s.meta.get("requested_length", s.length) for s in samples})
    depths = sorted({s.depth for s in samples})
    # accuracy vs retained fraction
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sorted(table, key=fast_step_read_all)
    xs = [fast_step_read_all(c) for c in pts]
    for t in tasks:
        ax.plot(xs, [c["per_task"][t]["accuracy"] for c in pts], "o", label=t, alpha=0.8)
    ax.plot(xs, [c["accuracy"] for c in pts], "k*", ms=10, label="all tasks")
    for x, c in zip(xs, pts):
        ax.annotate(c["name"], (x, c["accuracy"]), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes a fast decode step reads / a dense step's (selected + recent KV, page table, "
                  "candidates' K)", fontsize=8)
    ax.set_ylabel("score (exact match; passage_copy: ROUGE-L)" if samples and samples[0].prompt else
                  "exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_stem + "_acc_vs_retained.png", dpi=120)
    plt.close(fig)
    # depth x length heat maps: rows = configs, columns = tasks
    fig, axes = plt.subplots(len(table), len(tasks), figsize=(2.6 * len(tasks) + 1, 1.9 * len(table) + 0.6),
                             squeeze=False)
    for i, c in enumerate(table):
        for j, t in enumerate(tasks):
            m = np.full((len(depths), len(lengths)), np.nan)
            for a, d in enumerate(depths):
                for b, n in enumerate(lengths):
                    cell = c["cells"].get(f"{t}|{n}|{d}")
                    if cell:
                        m[a, b] = cell["accuracy"]
            ax = axes[i][j]
            ax.imshow(m, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for a in range(len(depths)):
                for b in range(len(lengths)):
                    if not np.isnan(m[a, b]):
                        ax.text(b, a, f"{m[a, b]:.2f}", ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=6)
            if i == 0:
                ax.set_title(t, fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{c['name']}\ndepth", fontsize=7)
            if i == len(table) - 1:
                ax.set_xlabel("length", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))      # room for the title
    fig.savefig(path_stem + "_heatmaps.png", dpi=110)
    plt.close(fig)


def markdown_table(table, tasks, lengths=None) -> str:
    """All lengths together, then one table per length (the budget means most at the longest)."""
    head = ("| config | read fraction | fast-step retained | fast-step read, all counted | prefill keys read | "
            + " | ".join(tasks) + " | all | agree w/ dense |")
    sep = "|---" * (len(tasks) + 7) + "|"

    def pct(rows, key):
        return f"{100.0 * sum(r[key] for r in rows) / len(rows):.1f}" if rows else "-"

    blocks = [[head, sep]]
    for c in table:
        blocks[0].append(f"| {c['name']} | {c['read_fraction']:.3f} | {c['fast_retained_fraction']:.3f} | "
                         f"{fast_step_read_all(c):.3f} | {prefill_keys_read(c.get('counters', {}))} | "
                         + " | ".join(f"{c['per_task'][t]['accuracy'] * 100:.1f}" for t in tasks)
                         + f" | **{c['accuracy'] * 100:.1f}** | {c['agreement_with_dense'] * 100:.1f} |")
    for n in (lengths or []) if len(lengths or []) > 1 else []:
        lines = [f"\nLength {n}:\n", head, sep]
        for c in table:
            rows = [r for r in c["samples"] if r["length"] == n]
            pl = c["per_length"].get(str(n), {})
            lines.append(f"| {c['name']} | {pl.get('read_fraction', 1.0):.3f} | "
                         f"{pl.get('fast_retained_fraction', 1.0):.3f} | "
                         f"{fast_step_read_all(c, str(n)):.3f} | "
                         f"{prefill_keys_read({str(n): c.get('counters', {}).get(str(n), {})})} | "
                         + " | ".join(pct([r for r in rows if r["task"] == t], "correct") for t in tasks)
                         + f" | **{pct(rows, 'correct')}** | {pct(rows, 'agree')} |")
        blocks.append(lines)
    notes = [line for c in table if (line := page_table_note(c))]
    if notes:
        blocks.append(["\nNot in the read fraction: each Quest selection also reads the page table (max and min "
                       "of K per page: 2 vectors per `page_size` keys = 1/page_size of the KV bytes) and, with "
                       "`quest_rerank` r, the K half of r x (k - keep_prefill) candidate rows:", ""]
                      + notes)
    return "\n".join("\n".join(b) for b in blocks)


def prefill_keys_read(counters: dict) -> str:
    """CritiPrefill: the key blocks its sparse segments read over the candidates (causal blocks)."""
    read = sum(v.get("critiprefill.key_blocks_read", 0) for v in counters.values())
    cand = sum(v.get("critiprefill.key_blocks_candidate", 0) for v in counters.values())
    return f"{read / cand:.3f}" if cand else "-"


def fast_step_read_all(c, length: str | None = None) -> float:
    """Bytes a fast step reads over a dense step's, counting all of it: the retained KV, and with
    selector quest the page table (max and min of K per page: 1/page_size of the KV bytes per
    selection) and with quest_rerank r the K half of r x (k - keep_prefill) candidates."""
    from vllm_ext.methods.sfi.config import SfiConfig

    pl = c["per_length"] if length is None else {length: c["per_length"].get(length, {})}
    counters = c["counters"] if length is None else {length: c["counters"].get(length, {})}
    retained = sum(v.get("sfi.fast_retained_tokens", 0) for v in counters.values())
    ctx = sum(v.get("sfi.fast_context_tokens", 0) for v in counters.values())
    if not ctx:
        return 1.0
    sfi = c.get("speedsfi", {}).get("sfi", {})
    extra = 0.0
    if sfi.get("selector") == "quest":
        slow = sum(v.get("slow_steps", 0) for v in pl.values())
        fast = sum(v.get("fast_steps", 0) for v in pl.values())
        extra += slow / max(fast, 1) / sfi.get("page_size", 16)
        rerank = sfi.get("quest_rerank", 0)
        if rerank:
            extra += slow * rerank * (sfi.get("k", SfiConfig.k) - sfi.get("keep_prefill", 0)) / 2 / ctx
    return retained / ctx + extra


def page_table_note(c) -> str | None:
    """Selector quest: the page-table read as a fraction of the fast steps' context (selections /
    fast steps / page_size; in quest mode every sparse row is a fast row), and with
    quest_rerank the candidates' K."""
    from vllm_ext.methods.sfi.config import SfiConfig

    sfi = c.get("speedsfi", {}).get("sfi", {})
    if sfi.get("selector") != "quest":
        return None
    page = sfi.get("page_size", 16)
    slow = sum(v.get("slow_steps", 0) for v in c["per_length"].values())
    fast = sum(v.get("fast_steps", 0) for v in c["per_length"].values())
    if not fast:
        return None
    extra = slow / fast / page
    note = f"- {c['name']}: page {page}, {slow} selections / {fast} fast steps: +{extra:.3f}"
    rerank = sfi.get("quest_rerank", 0)
    ctx = sum(v.get("sfi.fast_context_tokens", 0) for v in c["counters"].values())
    if rerank and ctx:
        # K of each candidate row: half its KV bytes (exact at 2048 tokens, where the allowed set
        # holds more than r x (k - keep_prefill) positions)
        cand = slow * rerank * (sfi.get("k", SfiConfig.k) - sfi.get("keep_prefill", 0)) / 2 / ctx
        note += f" page table, +{cand:.3f} candidates' K"
        extra += cand
    return note + f" (fast-step read incl. these {c['fast_retained_fraction'] + extra:.3f})"


def write_report(path, meta, table) -> str:
    md = markdown_table(table, meta["tasks"], meta["lengths"])
    with open(path + ".md", "w") as f:
        f.write(f"{md}\n\n`{meta['command']}` on {meta['device_desc']}; {meta['n_samples']} samples per "
                f"configuration; {meta['wall_s'] / 60:.1f} min.\n")
    return md


def main(argv=None):
    args = parse(argv)
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        stem = os.path.splitext(args.report)[0]
        md = write_report(stem, data["meta"], data["configs"])
        if not args.no_plots:
            from types import SimpleNamespace

            text = str(data["meta"].get("prompts", "")).startswith("text")
            rows = data["configs"][0]["samples"]
            samples = [SimpleNamespace(task=r["task"], depth=r["depth"], length=r["length"],
                                       meta={"requested_length": r["length"]}, prompt="x" if text else "")
                       for r in rows]
            model = os.path.basename(os.path.normpath(data["meta"]["model"]))
            plot(stem, data["configs"], samples, f"{model} on {data['meta']['device']} ({len(rows)} samples; "
                                                 f"lengths {data['meta']['lengths']})")
        print(md)
        return data["configs"]
    t_start = time.time()
    commit = _commit()                   # the code this run imports, before anything is committed during it
    import torch

    on_cuda = torch.cuda.is_available()
    device, device_desc = device_name()
    tokenizer = None
    if args.text:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    samples = build_samples(args, tokenizer)
    configs = load_configs(args)
    model_name = os.path.basename(os.path.normpath(args.model))
    stem = args.name or f"quality_{device}_{model_name}"
    log(f"{len(samples)} samples x {len(configs)} configurations on {device} ({device_desc}); "
        f"model {args.model}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, stem)

    def write(done: list[dict], complete: bool):
        # after every configuration (a long run leaves its tables so far: "complete": false), and
        # at the end
        import vllm

        table = summarise(args, done, samples, results)
        meta = dict(
            command="python scripts/eval_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
            model=args.model if not args.model.startswith(ROOT) else os.path.relpath(args.model, ROOT),
            device=device, device_desc=device_desc, vllm=vllm.__version__, torch=torch.__version__,
            python=platform.python_version(), date=dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
            commit=commit, load_average=list(os.getloadavg()),
            prompts=("text, chat template" if args.chat else "text") if args.text else "token ids (tiny vocabulary)",
            filler=None if args.text else args.filler,
            tasks=list(dict.fromkeys(s.task for s in samples)),
            lengths=sorted({s.meta.get("requested_length", s.length) for s in samples}),
            depths=sorted({s.depth for s in samples}), per_cell=args.per_cell, seed=args.seed,
            n_samples=len(samples), wall_s=time.time() - t_start, complete=complete,
            configs_run=[c["name"] for c in done],
            metric=("RULER string-match-all (a sample counts when every value is in the output); "
                    "passage_copy: mean ROUGE-L F of the output against the passage" if args.text
                    else "exact match of the greedy answer (all answer tokens and the final '.')"),
            retained_fraction=("fast_retained_fraction = sfi.fast_retained_tokens / sfi.fast_context_tokens "
                               "(fast steps only); read_fraction = KV read over all decode steps, slow and "
                               "dense steps counting as 1"),
        )
        with open(path + ".json", "w") as f:
            json.dump(dict(meta=meta, configs=table), f, indent=1)
        return table, meta, write_report(path, meta, table)

    results = {}
    earlier = resumed_results(args.resume, samples) if args.resume else {}
    for i, cfg in enumerate(configs):
        log(f"[{i + 1}/{len(configs)}] {cfg['name']}: {json.dumps(cfg['speedsfi'])}")
        if cfg["name"] in earlier and earlier[cfg["name"]]["speedsfi"] == cfg["speedsfi"]:
            results[cfg["name"]] = earlier[cfg["name"]]
            log(f"[{i + 1}/{len(configs)}] {cfg['name']}: taken from --resume")
            continue
        outputs, counters, startup, wall = run_config(args, cfg, samples, on_cuda)
        results[cfg["name"]] = dict(outputs=outputs, counters=counters, startup_s=startup, wall_s=wall)
        n_ok = sum(T.sample_score(s, outputs[s.key]) if args.text else T.exact_match(s, outputs[s.key])
                   for s in samples)
        log(f"[{i + 1}/{len(configs)}] {cfg['name']}: score {n_ok:.2f}/{len(samples)} "
            f"({wall:.0f} s, {time.time() - t_start:.0f} s so far)")
        if i + 1 < len(configs):
            write(configs[:i + 1], complete=False)
    table, meta, md = write(configs, complete=True)
    if not args.no_plots:
        title = f"{model_name} on {device} ({len(samples)} samples; lengths {meta['lengths']})"
        plot(path, table, samples, title)
    print(md)
    log(f"wrote {path}.json/.md{'' if args.no_plots else ' + plots'} in {(time.time() - t_start) / 60:.1f} min")
    return table


if __name__ == "__main__":
    main()
