#!/usr/bin/env python3
"""Writes the measured figures of README.md and docs/*.md from the committed result files.

Each figure block sits between ``<!-- figures: NAME -->`` and ``<!-- /figures -->`` and is rewritten
from its ``bench/results/`` file, with the machine, the date, the commit and the command that
produced it. ``--check`` writes nothing and exits 1 when a block differs from its file
(``tests/test_figures.py`` runs the same check).

A measured figure (a number with a unit of time, speed or size, a ratio or a percentage) anywhere
else in those pages is an error, except in a paragraph that starts with one of these marks, on a line
of its own directly above it (the mark covers the lines up to the next blank line):

* ``<!-- not measured: WHY -->``: the numbers are not measurements of ours (a paper's reported
  figures, a specification's constant, a limit of a machine, arithmetic on a configuration);
* ``<!-- historical: WHY -->``: a measurement of ours that no committed result file holds.

``--check`` lists such figures too; ``tests/test_figures.py`` lists every mark it accepts.

    python scripts/write_figures.py           # rewrite the blocks
    python scripts/write_figures.py --check   # fail on drift
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
# result files that do not record the commit they were measured at
UNRECORDED_COMMIT = {
    name: f"results committed at {commit} (the file records no commit)" for name, commit in (
        ("vllm_e2e_h200.json", "7477d12"),
        ("cpu_prefill_smollm2_fp32.json", "0952731"),
        ("load_cpu.json", "38c4c94"),
        ("load_cpu_passes6.json", "87b63e0"),
        ("quality_cpu_smollm2_2k.json", "62a9199"),
        ("quality_cpu_retrieval-llama.json", "8c2f28d"),
        ("quality_cpu_retrieval-llama_keep_prefill.json", "e5118dc"),
        ("quality_cpu_retrieval-qwen3.json", "6765dfd"),
        ("fast_step.json", "1e4df02"),
        ("critiprefill_bench.json", "f38df37"),
        ("quality_cpu_smollm2_4k8k.json", "fa84261"),
        ("quality_cpu_smollm2_4k8k_default_packed.json", "f9acf9a"),
        *((f"quality_cpu_smollm2_4k8k_{run}.json", "3cdc749") for run in (
            "warmup", "sparse_decode", "dense_decode", "warmup_seed200", "default_seed200")),
        ("quality_cpu_retrieval-qwen3_keep_prefill.json", "edf7bac"),
        ("quality_cpu_retrieval-llama_quest_keep.json", "cc31445"),
        ("quality_cpu_retrieval-qwen3_quest_keep.json", "bcbf2b4"),
        ("quality_cpu_retrieval-llama_quest_rerank.json", "c20029c"),
        ("quality_cpu_retrieval-qwen3_quest_rerank.json", "c20029c"),
        ("quality_cpu_retrieval-llama_critiprefill.json", "3fd8c60"),
        ("quality_cpu_smollm2_user_needles_4k.json", "4e5c21a"),
    )}
# result files that do not record their date: the date of the commit they were measured at
UNRECORDED_DATE = {"document_question_smollm2.json": "2026-11-25", "critiprefill_bench.json": "2026-11-22",
                   "cpu_prefill_smollm2_fp32.json": "2026-11-28"}


def _result_text(name: str) -> str:
    """A committed result file's text: every figure block reads its files through here."""
    return (ROOT / RESULTS / name).read_text()


def _load(name: str) -> dict:
    return json.loads(_result_text(name))


def _source(name: str) -> str:
    return f"source: `{RESULTS}/{name}`"


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s} s" if s and m < 10 else f"{round(seconds / 60)} min"


def _found(names: dict, right: list, wrong: list) -> str:
    """Which methods found the locker number, in words."""
    def said(ms):
        return " and ".join(names[m] for m in ms)

    if not right:
        return "None of them finds the locker number."
    found = f"{'All of them' if not wrong and len(right) > 1 else said(right)} " \
            f"{'find' if len(right) > 1 else 'finds'} the locker number"
    return f"{found}; {said(wrong)} at its budget {'do' if len(wrong) > 1 else 'does'} not." if wrong else f"{found}."


def first_hour() -> str:
    d = _load("first_hour.json")
    demo, tests = d["demo"], d["tests"]
    right = [m for m, ok in demo["correct"].items() if ok]
    wrong = [m for m, ok in demo["correct"].items() if not ok]
    names = {"dense": "Dense", "sfi": "SFI", "critiprefill": "CritiPrefill"}
    batch = ""
    if "batch" in demo:                         # the demo's speed section, where the file has it
        bt = demo["batch"]
        off, sfi = bt["runs"]["SFI off"]["tokens_s"], bt["runs"]["sfi preset"]["tokens_s"]
        batch = (f" Then it times {bt['requests']} requests of {bt['prompt_tokens']:,} prompt tokens decoding "
                 f"together ({bt['timed_by']}, {bt['dtype']}): SFI off {off:.1f} tokens/s, the preset "
                 f"{sfi:.1f} ({sfi / off:.2f}x).")
    counts = f"{tests['passed']} passed, {tests['skipped']} skipped for want of a GPU, {tests['failed']} failed"
    if tests.get("skipped_for"):                # the skips grouped by their reasons, where the file has them
        counts = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped: " + "; ".join(
            f"{n} for other reasons" if what == "other" else f"{n} for {what}" if what.startswith("this CPU")
            else f"{n} for want of {what}"
            for what, n in tests["skipped_for"].items())
    return (
        f"- `scripts/demo.sh` took **{_minutes(demo['wall_s'])}** with set-up. It serves "
        f"SmolLM2-135M-Instruct with `vllm serve --attention-backend speedsfi` {_served_as(demo)}, asks each "
        f"about a {demo['document_tokens']:,}-token logbook and "
        "prints each answer, whether it is right, the share of the KV each method read, and a summary "
        f"table. {_found(names, right, wrong)}{batch}\n"
        f"- `scripts/run_tests.sh` took **{_minutes(tests['wall_s'])}** ({counts}). "
        "`scripts/run_tests.sh -m \"not slow\"` runs the unit tests only (no engines).\n\n"
        f"Machine: {d['machine']}; {d['date']}; commit {d['commit']} (a trial of a fresh clone); "
        f"{_source('first_hour.json')}.\n")


def _served_as(demo: dict) -> str:
    """How the measured demo served its methods (a file from before the count: three servers)."""
    if demo.get("servers", 3) == 3:
        return "three times (dense, the `sfi` preset, CritiPrefill)"
    return ("twice (the `sfi` preset, asked also with SFI off for the request: dense; then CritiPrefill's "
            "preset)")


def gpu_h200() -> str:
    name = "vllm_e2e_h200.json"
    d = _load(name)
    rows = {(r["config"], r["input_len"], r["batch"]): r for r in d["rows"]}
    lines = ["| input x batch | vLLM default (FA3) TPOT / TTFT | SFI preset TPOT / TTFT | decode speed-up |",
             "| --- | --- | --- | --- |"]
    for (config, n, b), sfi in rows.items():
        base = rows.get(("vllm_default", n, b))
        if config != "speedsfi_sfi" or sfi.get("error") or base is None or base.get("error"):
            continue
        lines.append(f"| {n // 1024}K x {b} | {base['tpot_ms']:.2f} ms / {base['ttft_ms'] / 1e3:.1f} s | "
                     f"{sfi['tpot_ms']:.2f} ms / {sfi['ttft_ms'] / 1e3:.1f} s | "
                     f"{base['tpot_ms'] / sfi['tpot_ms']:.2f}x |")
    env = d["env"]
    return ("\n".join(lines) + "\n\n"
            f"{env['gpu']}, vLLM {env['vllm']}, Qwen3-4B shape with random weights, bf16, CUDA graphs, "
            f"256 tokens out; {d['started_utc'][:10]}; {UNRECORDED_COMMIT[name]}; "
            f"`scripts/gpu_e2e.sh call1`; {_source(name)}.\n")


def h200_decode_kernels() -> str:
    name = "vllm_e2e_h200.json"
    d = _load(name)
    lines = ["| context x batch | `paged_decode` µs / TB/s | TRITON_ATTN unified (delegate) µs / TB/s | delegate's time / ours |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {k['context'] // 1024}K x {k['batch']} | {k['paged_decode_us']:.0f} / {k['paged_decode_gbps'] / 1e3:.1f} | "
              f"{k['delegate_us']:.0f} / {k['delegate_gbps'] / 1e3:.1f} | {k['delegate_us'] / k['paged_decode_us']:.1f}x |"
              for k in d["kernels"]]
    k = d["kernels"][0]
    return ("\n".join(lines) + "\n\n"
            f"{d['env']['gpu']}, one layer in CUDA graphs, {k['heads']}/{k['kv_heads']} heads, d {k['head_dim']}, "
            f"{k['dtype'].replace('bfloat16', 'bf16')}; {d['started_utc'][:10]}; {UNRECORDED_COMMIT[name]}; "
            f"`scripts/gpu_e2e.sh call1` (its `kernels` job); {_source(name)}.\n")


_DOCUMENT_ROWS = (("dense", "dense"), ("default", "the `sfi` preset (default)"),
                  ("default_no_warmup", "the preset without `refresh_warmup`"),
                  ("sfi_paper", "SFI as published (`sfi-paper`)"),
                  ("critiprefill", "CritiPrefill, an earlier setting: 1024 keys per 128-query segment"))
CRITIPREFILL_DEFAULTS = "document_question_smollm2_critiprefill_defaults_fp32.json"


def _critiprefill_defaults_line() -> str:
    """CritiPrefill's preset (its authors' defaults) on the same logbooks, with its own dense run."""
    d = _load(CRITIPREFILL_DEFAULTS)
    res = d["results"]
    right = {k: sum(a["correct"] for a in v["answers"]) for k, v in res.items()}
    same = sum(a["answer"] == b["answer"] for a, b in zip(res["dense"]["answers"], res["critiprefill"]["answers"]))
    return (f" CritiPrefill's preset (its authors' defaults) on the same {len(d['seeds'])} logbooks in "
            f"{d['dtype'].replace('float32', 'fp32')}: {right['critiprefill']}, dense {right['dense']}, "
            f"{same} answers word for word the same; commit {d['commit']}; "
            f"`{d['command'].split(' --configs')[0]} --configs ...`; {_source(CRITIPREFILL_DEFAULTS)}.")


def document_question() -> str:
    name = "document_question_smollm2.json"
    d = _load(name)
    lines = [f"| config | logbooks answered (of {len(d['seeds'])}) |", "| --- | --- |"]
    lines += [f"| {label} | {d['results'][key]['correct']} |" for key, label in _DOCUMENT_ROWS]
    return ("\n".join(lines) + "\n\n"
            f"{d['model']}, {d['dtype'].replace('bfloat16', 'bf16')}, greedy, a {d['length']:,}-token "
            f"logbook with one locker number at depth {d['depth']}, {len(d['seeds'])} seeds; "
            f"{d['machine']}; {d.get('date') or UNRECORDED_DATE[name]}; commit {d['commit']}; "
            f"`{d['command'].split(' --configs')[0]} --configs ...` (the whole command is in the file); "
            f"{_source(name)}.{_critiprefill_defaults_line()}\n")


def cpu_steps() -> str:
    name = "cpu_steps_smollm2_native.json"
    d = _load(name)
    final = [r for r in d["rows"] if r["run"].startswith("final")]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in final:
        groups.setdefault((r["config"], r["length"]), []).append(r)
    base = {n: min(r["decode_cpu_ms_mean"] for r in rs) for (c, n), rs in groups.items() if c == "cpu_attn"}
    lines = ["| config | prompt | decode ms per token (mean) | vs `CPU_ATTN` | slow steps | prefill s |",
             "| --- | --- | --- | --- | --- | --- |"]

    def span(values, fmt):
        lo, hi = min(values), max(values)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"

    for (config, n), rs in groups.items():
        means = [r["decode_cpu_ms_mean"] for r in rs]
        ratio = span([m / base[n] for m in means], "{:.2f}x")
        slow = span([r.get("slow_steps") or 0 for r in rs], "{}")
        lines.append(f"| {config} | {n} | {span(means, '{:.1f}')} | {ratio} | {slow} | "
                     f"{span([r['prefill_cpu_s'] for r in rs], '{:.1f}')} |")
    return ("\n".join(lines) + "\n\n"
            f"{d['machine']}, {d['software']}; thread CPU time, `OMP_NUM_THREADS=1`, bf16, two requests "
            f"per row; {d['date']}; commit {d['commit'].split(' ')[0]}; "
            f"`{d['commands'][0]}` (and the file's other commands); {_source(name)}.\n")


def sfi_path() -> str:
    name = "sfi_path.json"
    d = _load(name)
    lines = ["| ctx | batch | dense ms/step | SFI ms/step (whole run) | speed-up | fast steps only |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['ctx'] // 1024}K | {r['batch']} | {r['dense_ms']:.1f} | {r['sfi_ms']:.1f} | "
              f"{r['speedup']:.2f}x | {r['speedup_fast_only']:.2f}x |" for r in d["rows"]]
    env = d["env"]
    return ("\n".join(lines) + "\n\n"
            f"{env['gpu']}, torch {env['torch']}, Triton {env['triton']}; {d['rows'][0]['model']} shape, "
            f"random weights, {d['rows'][0]['steps']} decode steps; {d['timing']}; {env['time_utc'][:10]}; "
            f"{d['code_state']}; `{d['reproduce']}`; {_source(name)}.\n")


def gpu_kernels() -> str:
    fast, cp = _load("fast_step.json"), _load("critiprefill_bench.json")
    sweep, ctx = fast["retention_sweep"], fast["context_sweep"]
    shape = fast["shapes"]
    budget = ctx["budget"]
    retained = ", ".join(f"{r['speedup']:.1f}x at {r['retained_pct']:.1f} %" for r in sweep["rows"])
    by_ctx = ", ".join(f"{r['speedup']:.1f}x at {r['ctx'] // 1024}K" for r in ctx["rows"])
    prefill = ", ".join(f"{r['speedup_vs_sdpa']:.1f}x at {r['n'] // 1024}K" for r in cp["results"])
    lines = ["| what | result |", "| --- | --- |",
             f"| SFI fast step vs our dense paged decode, {sweep['ctx'] // 1024}K KV, batch {shape['batch']}, "
             f"{shape['q_heads']}/{shape['kv_heads']} heads, d {shape['head_size']}, bf16 | {retained} |",
             f"| SFI fast step at the budget {budget['sink']} + {budget['k']} + {budget['recent']} | {by_ctx} |",
             f"| CritiPrefill plan + block-sparse prefill vs torch SDPA flash, one request, budget "
             f"{cp['config']['budget']} | {prefill} ({cp['timing']['iters']} timing iterations: indicative) |"]
    return ("\n".join(lines) + "\n\n"
            f"{fast['env']['gpu']}, torch {fast['env']['torch']}, Triton {fast['env']['triton']}; {fast['timing']}; "
            f"{fast['env']['time_utc'][:10]}; {UNRECORDED_COMMIT['fast_step.json']}; "
            f"`python bench/bench_fast_step.py --out bench/results`; {_source('fast_step.json')}.\n"
            f"{cp['device']}, {cp['dense_kernel']}; {UNRECORDED_DATE['critiprefill_bench.json']} (the commit's "
            f"date); {UNRECORDED_COMMIT['critiprefill_bench.json']}; `python bench/bench_critiprefill.py --out bench/results`; "
            f"{_source('critiprefill_bench.json')}.\n")


_LOAD_NAMES = {"cpu_attn": "vLLM `CPU_ATTN`", "dense": "SPEEDSFI dense", "sfi": "SPEEDSFI SFI (k 64, recent 64)",
               "speed": "SPEEDSFI SPEED (adapted model)"}


def _load_footer(name: str, d: dict) -> str:
    m = d["machine"]
    load = ", ".join(f"{x:.1f}" for x in m["load_average_at_start"])
    return (f"{m['description']}, load average {load} at the start (other jobs shared the cores); "
            f"{d['model']}, {d['workload']['concurrency']} concurrent streams; {d['date'][:10]}; "
            f"{UNRECORDED_COMMIT[name]}; `{d['command']}` (per-config serve commands in the file); "
            f"{_source(name)}.\n")


def load_cpu() -> str:
    name = "load_cpu.json"
    d = _load(name)
    lines = ["| config (serve) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | output tok/s | exact match | errors "
             "| fast-step retained | RSS ready → end MiB |", "|---|---|---|---|---|---|---|---|"]
    for c in d["configs"]:
        kept = c["speedsfi"].get("sfi_fast_retained_fraction")
        lines.append(f"| {_LOAD_NAMES[c['name']]} | {c['ttft_ms']['p50']:.1f} / {c['ttft_ms']['p99']:.1f} | "
                     f"{c['tpot_ms']['p50']:.1f} / {c['tpot_ms']['p99']:.1f} | {c['output_tokens_per_s']:.1f} | "
                     f"{100 * c['exact_match']:.1f} % | {c['errors']} | {'-' if kept is None else f'{kept:.3f}'} | "
                     f"{c['rss_ready']['total_mib']:.0f} → {c['rss_end']['total_mib']:.0f} |")
    return "\n".join(lines) + "\n\n" + _load_footer(name, d)


def load_passes() -> str:
    name = "load_cpu_passes6.json"
    d = _load(name)
    passes = d["workload"]["passes"]
    lines = ["| MiB after each pass of 200 requests | ready | " + " | ".join(str(i + 1) for i in range(passes)) + " |",
             "|---" * (passes + 2) + "|"]

    def rss(snapshot, role):
        return next(v for k, v in snapshot["per_process_mib"].items() if role in k)

    for c in d["configs"]:
        label = _LOAD_NAMES[c["name"]].replace("recent 64)", "recent 64, span 4)")
        for role, what in (("Worker", "worker"), ("EngineCore", "engine core")):
            row = [rss(c["rss_ready"], role)] + [rss(p["rss_end"], role) for p in c["passes"]]
            lines.append(f"| {label}, {what} | " + " | ".join(f"{v:.0f}" for v in row) + " |")
    return "\n".join(lines) + "\n\n" + _load_footer(name, d)


_SOAK_NAMES = {"cpu_attn": "vLLM `CPU_ATTN`", "sfi": "the `sfi` preset", "all_on": "SFI + SPEED + CritiPrefill",
               "sfi_critiprefill_pc": "SFI + CritiPrefill, prefix caching"}


def soak() -> str:
    lines = ["| config | requests | aborted by the client | failed | RSS growth after warm-up → end, MiB: "
             "API server / engine core / worker / total |", "|---|---|---|---|---|"]
    notes = []
    for name in ("soak_cpu.json", "soak_cpu_5000.json"):
        d = _load(name)
        for c in d["configs"]:
            g = c["soak"]["rss_growth_mib"]
            lines.append(f"| {_SOAK_NAMES[c['name']]} | {c['soak']['requests']:,} | {c['soak']['aborted']} | "
                         f"{c['soak']['failures']} | {g['api_server']:.1f} / {g['engine_core']:.1f} / "
                         f"{g['worker']:.1f} / {g['total']:.1f} |")
        load = ", ".join(f"{x:.1f}" for x in d["machine"]["load_average_at_start"])
        notes.append(f"{d['machine']['description']}, load average {load} at the start; {d['date'][:10]}; "
                     f"commit {d['code']['commit'][:7]}; `{d['command'].split(' --out')[0].replace('/work/main/', '')}`; {_source(name)}.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def soak_tight_kv() -> str:
    """The soak with a KV cache small enough to preempt."""
    name = "soak_cpu_tight_kv.json"
    d = _load(name)
    lines = ["| config | requests | aborted by the client | failed | preemptions | at the end: slots / queue / KV usage |",
             "|---|---|---|---|---|---|"]
    for c in d["configs"]:
        sk, end = c["soak"], c["soak"]["end"]
        zero = sk["back_to_zero"]
        lines.append(f"| {_SOAK_NAMES.get(c['name'], c['name'])} | {sk['requests']} | {sk['aborted']} | "
                     f"{sk['failures']} | {end['preemptions']} | "
                     f"{'0' if zero['slots'] else 'left'} / {'0' if zero['queue'] else 'left'} / "
                     f"{'0' if zero['kv_cache_usage'] else 'left'} |")
    load = ", ".join(f"{x:.1f}" for x in d["machine"]["load_average_at_start"])
    note = (f"{d['machine']['description']}, load average {load} at the start; {d['date'][:10]}; "
            f"commit {d['code']['commit'][:7]}; `{d['command'].split(' --out')[0]}`; {_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def concurrency_cpu() -> str:
    """Requests at once under a KV cache that limits them, all off vs SFI on."""
    name = "concurrency_cpu.json"
    d = _load(name)
    lines = ["| | start-up \"Maximum concurrency\" | most requests in one step |", "|---|---|---|"]
    for r in d["runs"]:
        lines.append(f"| SPEEDSFI, {r['config']} | {r['startup_concurrency']:.3f}x | {r['peak_requests_in_a_step']} |")
    note = (f"{d['machine']}; {d['workload']}; {d['date']}; commit {d['commit'][:7]}; `{d['command']}`; "
            f"{_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def concurrency_critiprefill_cpu() -> str:
    """CritiPrefill prompts in a sparse prefill at once under a small KV cache."""
    name = "concurrency_critiprefill_cpu.json"
    d = _load(name)
    lines = ["| | start-up \"Maximum concurrency\" | most prompts prefilling sparsely in one step |",
             "|---|---|---|"]
    for r in d["runs"]:
        lines.append(f"| SPEEDSFI, {r['config']} | {r['startup_concurrency']:.3f}x | "
                     f"{r['peak_sparse_prefills_in_a_step']} |")
    note = (f"{d['machine']}; {d['workload']}; {d['date']}; commit {d['commit'][:7]}; `{d['command']}`; "
            f"{_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


CPU_PREFILL = "cpu_prefill_smollm2_fp32_avx512.json"


def _cpu_prefill_when() -> str:
    """Date and commit of the prefill rows (recorded per row)."""
    rows = _load(CPU_PREFILL)["rows"]
    dates = sorted({r["date"] for r in rows})
    commits = sorted({r["commit"] for r in rows})
    return f"{' to '.join(dict.fromkeys([dates[0], dates[-1]]))}; commit {', '.join(commits)}"


def _cpu_prefill_rows(threads: int = 1) -> list[tuple[int, dict, list[dict]]]:
    """(prompt length, CPU_ATTN's row, CritiPrefill's rows) per length, at ``threads``."""
    rows = [r for r in _load(CPU_PREFILL)["rows"] if r["threads"] == threads]
    out = []
    for n in sorted({r["length"] for r in rows}):
        dense = next(r for r in rows if r["length"] == n and r["config"] == "cpu_attn")
        crit = sorted((r for r in rows if r["length"] == n and r["config"] == "critiprefill"), key=lambda r: r["rep"])
        out.append((n, dense, crit))
    return out


def cpu_prefill() -> str:
    """One prompt's prefill on the CPU build in whole engine steps, CPU_ATTN against the
    critiprefill preset (bench/bench_cpu_prefill.py): thread CPU time, the ratio, the attention
    pairs the plan skipped and the achieved GFLOP/s."""
    d = _load(CPU_PREFILL)
    wall = {n: (dense, crit) for n, dense, crit in _cpu_prefill_rows(threads=2)}
    lines = ["| prompt | `CPU_ATTN` | `critiprefill` | ratio | attention pairs skipped | "
             "achieved GFLOP/s (`CPU_ATTN` / `critiprefill`) | wall, 2 threads: `CPU_ATTN` / `critiprefill` |",
             "|---|---|---|---|---|---|---|"]
    for n, dense, crit in _cpu_prefill_rows():
        times = ", ".join(f"{r['prefill_cpu_s']:.1f} s" for r in crit)
        ratios = ", ".join(f"{r['prefill_cpu_s'] / dense['prefill_cpu_s']:.2f}x" for r in crit)
        skipped = crit[0]["attention_skipped"]
        what = f"{100 * skipped:.0f} %" if skipped else "0 % (no sparse segment: the same `CPU_ATTN` rows)"
        crit_gflops = sum(r["achieved_gflop_s_cpu"] for r in crit) / len(crit)
        gflops = f"{dense['achieved_gflop_s_cpu']:.1f} / {crit_gflops:.1f}"
        w = wall.get(n)
        w = (f"{w[0]['prefill_wall_s']:.1f} s / {sum(r['prefill_wall_s'] for r in w[1]) / len(w[1]):.1f} s "
             f"({sum(r['prefill_wall_s'] for r in w[1]) / len(w[1]) / w[0]['prefill_wall_s']:.2f}x)" if w else "-")
        lines.append(f"| {n // 1024}K | {dense['prefill_cpu_s']:.1f} s | {times} | {ratios} | {what} | {gflops} | {w} |")
    notes = sorted({r["note"] for r in d["rows"] if r.get("note")})
    long = [f"{n // 1024}K" for n in sorted({r["length"] for r in d["rows"]}) if n > 8192]
    long_ones = (" and ".join(long) + (" are" if len(long) > 1 else " is")) if long else "No prompt is"
    note = (f"{d['model']}, {d['dtype']}, thread CPU time of every engine step of one prompt's prefill with one "
            f"thread, and its wall time with two (chunks of {d['chunk']:,} tokens); {d['machine']}; "
            f"{_cpu_prefill_when()}; {'; '.join(notes)}; commands: "
            + "; ".join(f"`{c}`" for c in d["commands"]) + f". {long_ones} past the model's 8,192 positions "
            f"(`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`: a timing, not an answer); {_source(CPU_PREFILL)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


CPU_PREFILL_LAYER = "cpu_prefill_smollm2_fp32_avx512_layer.json"


def cpu_prefill_layer() -> str:
    """One attention layer, kernels only (bench/bench_cpu_prefill.py --layer): CPU_ATTN's prefill op
    on the whole prompt, the compiled block-sparse pass (all-dense plan and the preset's plan), and the
    preset's plan through CPU_ATTN's kernel (the engine's route)."""
    d = _load(CPU_PREFILL_LAYER)
    lines = ["| prompt | `CPU_ATTN`, dense | compiled pass, dense plan | compiled pass, preset's plan | "
             "`CPU_ATTN` route, preset's plan | plan | attention pairs skipped | GFLOP/s (`CPU_ATTN` / route) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['length'] // 1024}K | {r['cpu_attn_s']:.3f} s | {r['ours_dense_s']:.3f} s | "
                     f"{r['ours_preset_s']:.3f} s | {r['cpu_attn_route_s']:.3f} s | {r['plan_s']:.3f} s | "
                     f"{100 * r['attention_skipped']:.0f} % | {r['cpu_attn_gflop_s']:.0f} / "
                     f"{r['cpu_attn_route_gflop_s']:.0f} |")
    note = (f"Kernel-only, one attention layer of {d['model']}'s shape ({d['shape']['heads']} query heads, "
            f"{d['shape']['kv_heads']} KV heads, head size {d['shape']['head_size']}), random q/k/v in "
            f"`CPU_ATTN`'s vec pages of {d['shape']['page']} tokens, one request, {d['dtype']}, thread CPU time "
            f"with {d['rows'][0]['threads']} thread, best of 3; {d['machine']}; {d.get('date', '')}; "
            f"commit {d.get('commit', '')[:7]}; {d['note']}; `{d['command']}`; {_source(CPU_PREFILL_LAYER)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def cpu_prefill_headline() -> str:
    """The README's CritiPrefill line: its prefill against CPU_ATTN's at every length measured (the
    mean of CritiPrefill's runs), the longest's times spelled out."""
    rows = _cpu_prefill_rows()

    def ratio(n, dense, crit):
        return sum(r["prefill_cpu_s"] for r in crit) / len(crit) / dense["prefill_cpu_s"]

    n, dense, crit = rows[-1]
    mean_s = sum(r["prefill_cpu_s"] for r in crit) / len(crit)
    others = ", ".join(f"{m // 1024}K {ratio(m, d_, c_):.2f}x" for m, d_, c_ in rows[:-1])
    past = " (past 8K: timings, beyond the model's positions)" if n > 8192 else ""
    return ("- **CritiPrefill**: block-sparse prefill ([docs/critiprefill.md](docs/critiprefill.md)). On the CPU "
            f"build its preset's prefill of a {n // 1024}K-token prompt took {ratio(*rows[-1]):.2f}x "
            f"`CPU_ATTN`'s thread CPU time ({mean_s:.0f} s against {dense['prefill_cpu_s']:.0f} s); {others}{past} "
            f"(SmolLM2-135M, fp32, one thread, {_load(CPU_PREFILL)['machine']}; {_cpu_prefill_when()}; "
            f"`bench/bench_cpu_prefill.py`; {_source(CPU_PREFILL)}).\n")


_QUALITY_HEAD = re.compile(r"^\| config \|.*$", re.M)


def _quality_rows(name: str, section: str | None) -> dict[str, dict[str, str]]:
    """The rows of a table that scripts/eval_quality.py wrote: the first, or the one after ``section``."""
    text = _result_text(f"{name}.md")
    if section:
        text = text[text.index(section):]
    head = _QUALITY_HEAD.search(text)
    columns = [c.strip() for c in head.group(0).strip("|").split("|")]
    rows = {}
    for line in text[head.end():].strip().split("\n")[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(columns, cells))
    return rows


def _quality(rows: list[tuple[str, str | None, str, str]], columns: dict[str, str]) -> str:
    """A table of (result name, section, config, label) rows and the given columns (file's name: shown
    name), then one line per result file: model, machine, date, commit, command, source."""
    lines = ["| config | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, section, config, label in rows:
        row = _quality_rows(name, section)[config]
        lines.append(f"| {label} | " + " | ".join(row[c] for c in columns) + " |")
    notes = [_quality_note(name) for name in dict.fromkeys(r[0] for r in rows)]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def _quality_note(name: str) -> str:
    meta = _load(f"{name}.json")["meta"]
    filler = f", {meta['filler']} filler" if meta.get("filler") else ""
    return (f"{meta['model']} ({meta['prompts']}{filler}), {meta['per_cell']} per cell; {meta['device_desc']}, "
            f"vLLM {meta['vllm']}, torch {meta['torch']}; {meta['date'][:10]}; "
            f"{UNRECORDED_COMMIT[name + '.json']}; `{meta['command']}`; {_source(name + '.md')}.")


_TASKS = {"niah_single": "single", "niah_multikey": "multi-key", "niah_multivalue": "multi-value",
          "kv_lookup": "key-value", "all": "all", "agree w/ dense": "agreement with dense"}


def quality_real_2k() -> str:
    name = "quality_cpu_smollm2_2k"
    labels = (("dense", "dense"), ("sfi_k256_published", "SFI as published, k 256"),
              ("sfi_k320_keep192", "SFI k 320, `keep_prefill` 192, spans 6 / 6"),
              ("quest_k320_page16_rerank4", "Quest + `quest_rerank` 4, k 320"),
              ("critiprefill_b128", "CritiPrefill, 128 keys per segment"),
              ("critiprefill_b512", "CritiPrefill, 512 keys per segment"),
              ("speed_default", "SPEED (model not SPEED-adapted)"), ("all_on", "all three on"))
    return _quality([(name, None, c, label) for c, label in labels],
                    {"fast-step read, all counted": "fast-step read, all counted",
                     "prefill keys read": "prefill keys read", "niah_single": "single needle (%)",
                     "passage_copy": "copy (ROUGE-L, %)", "all": "score"})


_REAL_4K8K = (("warmup", "default_refresh_warmup", "the `sfi` preset (default)"),
              ("default_packed", "default", "the preset without `refresh_warmup`"),
              ("warmup_seed200", "default_refresh_warmup", "the preset, 20 more prompts (seed 200)"),
              ("default_seed200", "default", "the preset without `refresh_warmup`, seed 200"),
              ("", "quest_k336_rerank4", "Quest + `quest_rerank` 4, k 336"),
              ("sparse_decode", "sfi_k256_published", "SFI as published, k 256"),
              ("sparse_decode", "quest_k336_page16", "Quest alone, k 336"),
              ("dense_decode", "critiprefill_b512", "CritiPrefill, 512 keys per segment"),
              ("dense_decode", "speed_default", "SPEED (model not SPEED-adapted)"),
              ("sparse_decode", "all_on", "all three on"))


def quality_real_4k8k() -> str:
    """Each config's score as a share of dense's in the same run, at 4K and 8K."""
    lines = ["| config | score, % of dense, 4K / 8K | single needle, % 4K / 8K | fast-step read, all counted, 4K / 8K |",
             "|---|---|---|---|"]
    names = []
    for run, config, label in _REAL_4K8K:
        name = "quality_cpu_smollm2_4k8k" + (f"_{run}" if run else "")
        names.append(name)
        at = [_quality_rows(name, f"Length {n}:") for n in (4096, 8000)]
        share = " / ".join(f"{100 * float(t[config]['all']) / float(t['dense']['all']):.0f}" for t in at)
        lines.append(f"| {label} | {share} | {' / '.join(t[config]['niah_single'] for t in at)} | "
                     f"{' / '.join(t[config]['fast-step read, all counted'] for t in at)} |")
    return "\n".join(lines) + "\n\n" + "\n".join(_quality_note(n) for n in dict.fromkeys(names)) + "\n"


def quality_retrieval_sfi() -> str:
    rows = [("quality_cpu_retrieval-llama", "Length 2048:", "dense", "dense"),
            ("quality_cpu_retrieval-llama", "Length 2048:", "sfi_k256", "SFI k 256, n_recent 64 (the paper's selector)"),
            ("quality_cpu_retrieval-llama", "Length 2048:", "sfi_k1536", "SFI k 1536, n_recent 64"),
            ("quality_cpu_retrieval-llama_keep_prefill", None, "sfi_k256_span4",
             "SFI k 256, n_recent 64, `select_span` 4")]
    return _quality(rows, {"fast-step retained": "fast-step retained", **_TASKS})


def quality_qwen3() -> str:
    rows = [("quality_cpu_retrieval-qwen3", None, c, label) for c, label in (
        ("dense", "dense"), ("sfi_k256", "SFI k 256 (the paper's selector)"),
        ("sfi_k256_span4", "SFI k 256, `select_span` 4"),
        ("sfi_k256_span4_preset_schedule", "the same with the `sfi-paper` preset's schedule"))]
    return _quality(rows, {"read fraction": "read fraction", **_TASKS})


def _both_models(suffix: str, configs: tuple[tuple[str, str], ...]) -> str:
    rows = [(f"quality_cpu_retrieval-{model}_{suffix}", None, c, f"{label} ({model.capitalize()})")
            for model in ("llama", "qwen3") for c, label in configs]
    return _quality(rows, {"read fraction": "read fraction", **_TASKS})


def quality_keep_prefill() -> str:
    return _both_models("keep_prefill", (("dense", "dense"), ("sfi_k320_span6_back6_keep192",
                                          "SFI k 320, spans 6 / 6, `keep_prefill` 192")))


def quality_quest_keep() -> str:
    return _both_models("quest_keep", (("dense", "dense"), ("quest_k320_page8_keep192_span6_back6",
                                        "Quest page 8 + `keep_prefill` 192, spans 6 / 6, k 320")))


def quality_quest_rerank() -> str:
    return _both_models("quest_rerank", (("dense", "dense"),
                                         ("quest_k320_page16_rerank4", "Quest page 16, `quest_rerank` 4, k 320"),
                                         ("quest_k320_page8_rerank4", "Quest page 8, `quest_rerank` 4, k 320")))


def quality_critiprefill() -> str:
    rows = [("quality_cpu_retrieval-llama_critiprefill", None, c, label) for c, label in (
        ("dense", "dense"), ("cp_b128", "CritiPrefill, 128 keys per segment"),
        ("cp_b256", "CritiPrefill, 256 keys"), ("cp_b512", "CritiPrefill, 512 keys"),
        ("cp_b1024", "CritiPrefill, 1024 keys"))]
    return _quality(rows, _TASKS)


_USER_NEEDLE_SETS = (("quality_cpu_smollm2_user_needles_4k_copy_once", "reproduction (settings chosen here)"),
                     ("quality_cpu_smollm2_user_needles_test_4k", "held out"),
                     ("quality_cpu_smollm2_user_needles_test_8k", "held out"),
                     ("quality_cpu_smollm2_user_needles_heldout2", "held out, second"))
_USER_NEEDLE_SETS += (("quality_cpu_smollm2_user_needles_heldout2_default", "held out, second"),
                      ("quality_cpu_smollm2_user_needles_heldout3_4k", "held out, third"),
                      ("quality_cpu_smollm2_user_needles_heldout3_8k", "held out, third"),
                      ("quality_cpu_smollm2_user_needles_heldout4_8k", "held out, fourth (8K only)"))
# the held-out runs of the default as shipped, pooled per length
_USER_NEEDLE_POOLED = ("quality_cpu_smollm2_user_needles_heldout2_default",
                       "quality_cpu_smollm2_user_needles_heldout3_4k",
                       "quality_cpu_smollm2_user_needles_heldout3_8k",
                       "quality_cpu_smollm2_user_needles_heldout4_8k")
# runs whose dense rows are an earlier file's (--resume): shown once, with that file
_USER_NEEDLE_RESUMED = {"quality_cpu_smollm2_user_needles_heldout2_default"}
# "sfi_preset" in these files is the preset as it was when they ran: the copy trigger off
_USER_NEEDLE_LABELS = {"dense": "dense", "sfi_preset": "the `sfi` preset, trigger off (until 2026-11-27)",
                       "sfi_copy_once": "preset + `copy_ngram` 2, `copy_once` (the default's settings)",
                       "sfi_default": "**the default** (`sfi` preset, trigger on, prefix hits backfilled)"}


def _binomial_cdf(k: int, n: int, p: float) -> float:
    from math import comb

    return sum(comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) two-sided interval of a binomial proportion k / n."""
    if n <= 0:
        return 0.0, 1.0
    k = min(max(k, 0), n)
    a = (1 - level) / 2

    def solve(f) -> float:              # f falls from True to False on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1 - _binomial_cdf(k - 1, n, p) < a)
    upper = 1.0 if k == n else solve(lambda p: _binomial_cdf(k, n, p) > a)
    return lower, upper


def _paired_with_dense(rows: list[dict], dense: list[dict], n_dense: int) -> tuple[int, int, float, float]:
    """A config's right answers, how many of dense's right ones it kept (the same prompts, in order)
    and the exact 95 % interval of that share."""
    right = round(sum(r["correct"] for r in rows))
    kept = round(sum(r["correct"] for r, q in zip(rows, dense) if q["correct"]))
    return (right, kept, *clopper_pearson(kept, n_dense))


def quality_user_needles() -> str:
    """User-written single needles (vllm_ext.quality.user_needles), dense vs the preset
    and the copy trigger, per set and length: right answers, how many of dense's right ones it kept
    (with the exact 95 % interval of that share: the paired measure, since both run the same
    prompts), and what the fast steps read."""
    lines = ["| set | length | config | right | % of dense | of dense's right (95 % interval) "
             "| fast-step read | decode read | slow / fast steps |", "|---" * 9 + "|"]
    notes = []
    for name, label in _USER_NEEDLE_SETS:
        if not (ROOT / RESULTS / f"{name}.json").exists():
            continue
        d = _load(f"{name}.json")
        lengths = [str(n) for n in d["meta"]["lengths"]]
        groups = [(n, {n}) for n in lengths] + ([("both", set(lengths))] if len(lengths) > 1 else [])
        dense_all = d["configs"][0]["samples"]
        for group, members in groups:
            dense = [r for r in dense_all if str(r["length"]) in members]
            n_dense = round(sum(r["correct"] for r in dense))
            for c in d["configs"]:
                if c["name"] == "dense" and name in _USER_NEEDLE_RESUMED:
                    continue
                rows = [r for r in c["samples"] if str(r["length"]) in members]
                right, kept, lo, hi = _paired_with_dense(rows, dense, n_dense)
                pls = [c["per_length"][n] for n in sorted(members) if n in c["per_length"]]
                if group == "both" or not pls:
                    fast, read = c["fast_retained_fraction"], c["read_fraction"]
                else:
                    fast, read = pls[0]["fast_retained_fraction"], pls[0]["read_fraction"]
                steps = (f"{sum(p['slow_steps'] for p in pls)} / {sum(p['fast_steps'] for p in pls)}"
                         if c["name"] != "dense" else "-")
                lines.append(f"| {label} | {group} | {_USER_NEEDLE_LABELS.get(c['name'], c['name'])} | "
                             f"{right} / {len(rows)} | {100 * right / n_dense:.0f} | {kept} / {n_dense} "
                             f"({100 * lo:.0f}-{100 * hi:.0f} %) | {fast:.3f} | {read:.3f} | {steps} |")
        meta = d["meta"]
        commit = meta.get("commit") or UNRECORDED_COMMIT[name + ".json"].split()[3]
        notes.append(f"{meta['model']} ({meta['n_samples']} prompts); {meta['device_desc']}, vLLM {meta['vllm']}, "
                     f"torch {meta['torch']}; {meta['date'][:10]}; commit {commit}; `{meta['command']}`; "
                     f"{_source(name + '.json')}.")
    return "\n".join(lines) + "\n\n" + _user_needles_pooled() + "\n".join(notes) + "\n"


CRITIPREFILL_NEEDLES = "quality_cpu_smollm2_critiprefill_needles_8k.json"


def quality_critiprefill_needles(name: str = "") -> str:
    """User-written single needles (vllm_ext.quality.user_needles) at a length where the preset's
    prefill is sparse: dense against the critiprefill preset on the same prompts."""
    name = name or CRITIPREFILL_NEEDLES
    d = _load(name)
    dense = d["configs"][0]["samples"]
    n_dense = round(sum(r["correct"] for r in dense))
    lines = ["| config | right | of dense's right (95 % interval) | same answer as dense | sparse segments "
             "| key blocks read in them |", "|---" * 6 + "|"]
    for c in d["configs"]:
        rows = c["samples"]
        right, kept, lo, hi = _paired_with_dense(rows, dense, n_dense)
        same = sum(r["output_ids"] == q["output_ids"] for r, q in zip(rows, dense))
        counters = {}
        for per_length in c.get("counters", {}).values():
            for k, v in per_length.items():
                counters[k] = counters.get(k, 0) + v
        segs = counters.get("critiprefill.sparse_segments", 0)
        cand = counters.get("critiprefill.key_blocks_candidate", 0)
        read = f"{100 * counters['critiprefill.key_blocks_read'] / cand:.1f} %" if cand else "-"
        lines.append(f"| {c['name']} | {right} / {len(rows)} | {kept} / {n_dense} ({100 * lo:.0f}-{100 * hi:.0f} %) "
                     f"| {same} / {len(rows)} | {segs or '-'} | {read} |")
    meta = d["meta"]
    note = (f"{meta['model']} ({meta['n_samples']} prompts: forms {', '.join(sorted({r['wording'] for r in dense}))}; "
            f"{', '.join(str(n) for n in meta['lengths'])} tokens; depths {', '.join(str(x) for x in meta['depths'])}); "
            f"{meta['device_desc']}, vLLM {meta['vllm']}, torch {meta['torch']}; {meta['date'][:10]}; "
            f"commit {meta['commit']}; `{meta['command']}`; {_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


CPU_DECODE_GRID = ("cpu_decode_grid_bf16_avx512.json", "cpu_decode_grid_bf16_avx512_rerun.json",
                   "cpu_decode_grid_bf16_avx512_rerun_8k.json", "cpu_decode_grid_bf16_avx512_prefetch_8k.json",
                   "cpu_decode_grid_bf16_avx512_prefetch_4k.json", "cpu_decode_grid_bf16_avx512_prefetch_8k_b1.json",
                   "cpu_decode_grid_bf16_avx512_fastprefetch_8k.json", "cpu_decode_batch_bf16_avx512_long.json")
CPU_DECODE_GRID_2THREADS = ("cpu_decode_grid_bf16_avx512_2threads.json",
                            "cpu_decode_grid_bf16_avx512_2threads_prefetch.json",
                            "cpu_decode_grid_bf16_avx512_2threads_rest.json")
CPU_DECODE_GRID_2THREADS_LONG = ("cpu_decode_grid_bf16_avx512_2threads_long.json",
                                 "cpu_decode_grid_bf16_avx512_2threads_idle.json")
CPU_DECODE_FP8 = "cpu_decode_batch_bf16_fp8kv_avx512_long.json"


def _pooled(runs: list[dict]) -> dict:
    """One point measured several times in one file (configurations interleaved, so that the
    machine's drift falls on each alike): the runs' steps pooled, means and rates recomputed."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    steps = [len(r["cpu_ms"]) for r in runs]
    for unit in ("cpu", "wall"):
        xs = [x for r in runs for x in r[f"{unit}_ms"]]
        out[f"{unit}_ms"] = xs
        out[f"{unit}_ms_mean"] = round(statistics.mean(xs), 2)
        out[f"{unit}_ms_median"] = round(statistics.median(xs), 2)
    for k in ("fast_row_steps", "dense_row_steps", "slow_row_steps", "fast_retained_tokens", "fast_context_tokens"):
        out[k] = sum(r[k] for r in runs)
    for k in ("bytes_per_step", "kv_bytes_per_step"):
        out[k] = int(sum(r[k] * n for r, n in zip(runs, steps)) / sum(steps))
    for unit in ("cpu", "wall"):
        out[f"achieved_gbps_{unit}"] = round(out["bytes_per_step"] / out[f"{unit}_ms_mean"] / 1e6, 2)
    if out["fast_context_tokens"]:
        out["retained_fraction"] = round(out["fast_retained_tokens"] / out["fast_context_tokens"], 4)
    if all("steady" in r for r in runs):
        after = runs[0]["steady"]["after"]
        st = dict(runs[0]["steady"])
        for unit in ("cpu", "wall"):
            xs = [x for r in runs for x in r[f"{unit}_ms"][after:]]
            st[f"{unit}_ms_mean"] = round(statistics.mean(xs), 2)
            st[f"{unit}_ms_median"] = round(statistics.median(xs), 2)
        for k in ("steps", "slow_row_steps", "row_steps"):
            st[k] = sum(r["steady"][k] for r in runs)
        out["steady"] = st
    out["repeats"] = len(runs)
    return out


def _decode_rows(names: tuple[str, ...]) -> tuple[list, dict]:
    """The files of ``names`` that exist and their rows by (config, length, batch): a later file's row
    replaces an earlier one's for the same point (measured again after a change); a point measured
    more than once in one file is pooled (``_pooled``)."""
    files = [(n, _load(n)) for n in names if (ROOT / RESULTS / n).exists()]
    rows: dict = {}
    for n, f in files:
        by: dict = {}
        for r in f["rows"]:
            by.setdefault((r["config"], r["length"], r["batch"]), []).append(r)
        for key, runs in by.items():
            rows[key] = (n, _pooled(runs))
    kept_files = {n for n, _ in rows.values()}
    return [(n, f) for n, f in files if n in kept_files], {k: r for k, (_, r) in rows.items()}


def cpu_decode_headline(grid: tuple[str, ...] = CPU_DECODE_GRID,
                        fp8: str = CPU_DECODE_FP8) -> str:
    """The README's line on the CPU build's batch decode, from the grid (batches x prompt lengths, bf16):
    the preset's mean step against CPU_ATTN's at the longest prompts, its range over the points where
    the preset's fast steps read under half the context, and the fp8 point."""
    files, by = _decode_rows(grid)
    d = files[0][1]
    unit, env = d["unit"], d["env"]
    longest = max(k[1] for k in by)

    def ratio(length, batch):
        return by[("cpu_attn", length, batch)][unit + "_ms_mean"] / by[("sfi", length, batch)][unit + "_ms_mean"]

    sparse = sorted((ratio(l, b), l, b) for (c, l, b), r in by.items()
                    if c == "sfi" and r.get("retained_fraction") is not None and r["retained_fraction"] < 0.5)
    def off(length, batch):
        r = by.get(("all_off", length, batch))
        return f"; every method off {r[unit + '_ms_mean']:.0f}" if r else ""

    at_longest = ", ".join(
        f"{by[('sfi', longest, b)][unit + '_ms_mean']:.0f} ms against {by[('cpu_attn', longest, b)][unit + '_ms_mean']:.0f} "
        f"({ratio(longest, b):.2f}x{off(longest, b)}) at {b} request{'s' if b > 1 else ''}"
        for b in sorted({b for (c, l, b) in by if c == "sfi" and l == longest}, reverse=True))
    span = (f"; over the {len(sparse)} points of prompts and batches where its fast steps read under half the "
            f"context, {sparse[0][0]:.2f}x ({sparse[0][1]:,} x {sparse[0][2]}) to {sparse[-1][0]:.2f}x "
            f"({sparse[-1][1]:,} x {sparse[-1][2]})" if sparse else "")
    f = _load(fp8)
    fb = {k[0]: r for k, r in _decode_rows((fp8,))[1].items()}
    fp8_part = (f"; on an fp8 KV cache, {fb['sfi']['batch']} x {fb['sfi']['length']:,}: "
                f"{fb['sfi'][unit + '_ms_mean']:.0f} ms against {fb['cpu_attn'][unit + '_ms_mean']:.0f} "
                f"({fb['cpu_attn'][unit + '_ms_mean'] / fb['sfi'][unit + '_ms_mean']:.2f}x)")
    return (f"On the CPU build, requests of {longest:,} prompt tokens decoding together, the `sfi` preset's mean "
            f"step (every step counted) took {at_longest} (`CPU_ATTN`'s){span}{fp8_part}: "
            f"SmolLM2-135M-Instruct, {d['dtype']}, thread CPU time on one thread, {env['cpu']} ({env['cores']} "
            f"cores, {env['isa']}); {env['time_utc'][:10]}; commit "
            + ", ".join(dict.fromkeys([x["commit"] for _, x in files] + [f["commit"]]))
            + "; `bench/bench_cpu_decode_batch.py`; source: "
            + ", ".join(_source(n).replace("source: ", "") for n in [x for x, _ in files] + [fp8]) + ".\n")


QUALITY_FP8 = ("quality_cpu_smollm2_fp8_heldout_bf16kv.json", "quality_cpu_smollm2_fp8_heldout_fp8kv.json")


QUALITY_FP8_HELDOUT3 = ("quality_cpu_smollm2_user_needles_heldout3_8k.json",
                        "quality_cpu_smollm2_user_needles_heldout3_8k_fp8kv.json")


def quality_fp8(files: tuple[str, str] = QUALITY_FP8, preset: str = "sfi_preset") -> str:
    """The real model on an fp8 KV cache: dense and the sfi preset (config ``preset`` in the files),
    each on a bf16 and an fp8 cache, the same held-out prompts; each sparse run paired with the dense
    run on its own cache, dense fp8 paired with dense bf16 (what fp8 itself costs)."""
    runs = {}
    for name, kv in zip(files, ("bf16", "fp8")):
        d = _load(name)
        for c in d["configs"]:
            runs[(c["name"], kv)] = c
    metas = [_load(n)["meta"] for n in files]
    lines = ["| config | KV cache | right | paired with | of its right (95 % interval) | same answer | "
             "fast-step read |", "|---" * 7 + "|"]
    pairs = [(("dense", "bf16"), None), (("dense", "fp8"), ("dense", "bf16")),
             ((preset, "bf16"), ("dense", "bf16")), ((preset, "fp8"), ("dense", "fp8"))]
    for key, ref in pairs:
        rows = runs[key]["samples"]
        by_len = {}
        for r in rows:
            by_len.setdefault(r["length"], [0, 0])
            by_len[r["length"]][0] += round(r["correct"])
            by_len[r["length"]][1] += 1
        right = " + ".join(f"{a} / {n}" for _, (a, n) in sorted(by_len.items()))
        read = runs[key].get("fast_retained_fraction")
        read = f"{read:.3f}" if key[0] != "dense" and read is not None else "-"
        if ref is None:
            lines.append(f"| {key[0]} | {key[1]} | {right} | - | - | - | {read} |")
            continue
        base = runs[ref]["samples"]
        n_ref = round(sum(q["correct"] for q in base))
        _, kept, lo, hi = _paired_with_dense(rows, base, n_ref)
        same = sum(r["output_ids"] == q["output_ids"] for r, q in zip(rows, base))
        lines.append(f"| {key[0]} | {key[1]} | {right} | {ref[0]} {ref[1]} | {kept} / {n_ref} "
                     f"({100 * lo:.0f}-{100 * hi:.0f} %) | {same} / {len(rows)} | {read} |")
    m = metas[1]
    note = (f"{m['model']} ({m['n_samples']} prompts a run, right counted at "
            f"{' + '.join(str(n) for n in m['lengths'])} tokens; forms "
            f"{', '.join(sorted({r['wording'] for r in runs[('dense', 'fp8')]['samples']}))}; depths "
            f"{', '.join(str(x) for x in m['depths'])}; seed {m['seed']}, a set no setting was chosen on); "
            f"{m['device_desc']}, vLLM {m['vllm']}, torch {m['torch']}; {m['date'][:10]}; commit "
            f"{', '.join(dict.fromkeys(x['commit'] for x in metas))}; "
            + "; ".join(f"`{x['command']}`" for x in metas) + "; source: "
            + ", ".join(f"`bench/results/{n}`" for n in files) + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


# The answer-level precision noise beside each method's paired loss: dense in fp32 asked the same
# prompts as dense in bf16 changes no algorithm, only rounding, so the share of dense bf16's right
# answers it keeps is what greedy answers on these sets lose to any perturbation of that size.
# Each set: (label, {alias: (file, config)}); each row: (label, config alias, reference alias).
def _runs_in(file: str, **configs: str) -> dict[str, tuple[str, str]]:
    """{alias: (file, config name)} for configurations of one result file."""
    return {alias: (file, name) for alias, name in configs.items()}


def _critiprefill_set(file: str, **more: str) -> dict[str, tuple[str, str]]:
    return _runs_in(file, dense="dense", method="critiprefill_preset", fp32="dense_fp32", **more)


NOISE_CONTROL_CRITIPREFILL = (
    ("seed 9100 (48)", _critiprefill_set("quality_cpu_smollm2_critiprefill_needles_heldout_fp32.json")),
    ("seed 9300 (144)", _critiprefill_set("quality_cpu_smollm2_critiprefill_needles_heldout2_fp32.json")),
    ("seed 9700 (144)", _critiprefill_set("quality_cpu_smollm2_critiprefill_needles_heldout3_fp32.json")),
)
NOISE_CONTROL_CRITIPREFILL_ROWS = (("`critiprefill` preset (bf16)", "method", "dense"),
                                   ("dense fp32: the precision noise", "fp32", "dense"))
NOISE_CONTROL_CRITIPREFILL_BUDGET = tuple(
    (label, _critiprefill_set(f"quality_cpu_smollm2_critiprefill_needles_heldout{n}_budget3072.json", budget="budget3072"))
    for label, n in (("seed 9300 (144)", 2), ("seed 9700 (144)", 3)))
NOISE_CONTROL_CRITIPREFILL_BUDGET_ROWS = (("`critiprefill` preset: budget 2,048 (the authors')", "method", "dense"),
                                          ("budget 3,072", "budget", "dense"),
                                          ("dense fp32: the precision noise", "fp32", "dense"))
NOISE_CONTROL_FP8 = tuple(
    (label, {**_runs_in(controls, dense="dense", sfi=preset, fp32="dense_fp32", fp32_fp8="dense_fp32_fp8kv"),
             **_runs_in(fp8, dense_fp8="dense", sfi_fp8=preset)})
    for label, controls, fp8, preset in (
        ("seed 5800 (48, 4K + 8K)", "quality_cpu_smollm2_fp8_heldout_fp32.json",
         "quality_cpu_smollm2_fp8_heldout_fp8kv.json", "sfi_preset"),
        ("seed 6700 (63, 8K)", "quality_cpu_smollm2_user_needles_heldout3_8k_fp32.json",
         "quality_cpu_smollm2_user_needles_heldout3_8k_fp8kv.json", "sfi_default")))
NOISE_CONTROL_FP8_ROWS = (("`sfi` preset, bf16 cache", "sfi", "dense"),
                          ("dense fp32: the precision noise on bf16", "fp32", "dense"),
                          ("`sfi` preset, fp8 cache", "sfi_fp8", "dense_fp8"),
                          ("dense fp32 on an fp8 cache: the precision noise on fp8", "fp32_fp8", "dense_fp8"),
                          ("dense, fp8 cache: what fp8 costs", "dense_fp8", "dense"))


_NOISE_REFERENCE = {"dense": "dense, bf16", "dense_fp8": "dense, fp8 cache"}


def _prompt_key(r: dict) -> tuple:
    return r["task"], r["length"], r["depth"], r["seed"], r["wording"], r["expected"]


def quality_noise_control(sets=NOISE_CONTROL_CRITIPREFILL, rows=NOISE_CONTROL_CRITIPREFILL_ROWS) -> str:
    """Each configuration's share of its reference's right answers kept (paired: the same prompts),
    per held-out set and pooled, beside dense fp32's share of dense bf16's (the same prompts with
    only the rounding changed)."""
    present = [(label, refs) for label, refs in sets
               if all((ROOT / RESULTS / f).exists() for f, _ in refs.values())]
    if not present:
        return "(no runs yet)\n"
    header = " | ".join(label for label, _ in present)
    lines = [f"| config | reference | {header} | pooled (95 % interval) | same answer, pooled | right, pooled |",
             "|---" * (len(present) + 5) + "|"]
    files = set()
    for row_label, alias, ref_alias in rows:
        cells, kept_all, n_all, same_all, total, right_all = [], 0, 0, 0, 0, 0
        for _, refs in present:
            def samples(a):
                f, name = refs[a]
                files.add(f)
                return {c["name"]: c["samples"] for c in _load(f)["configs"]}[name]
            got, ref = samples(alias), samples(ref_alias)
            assert [_prompt_key(r) for r in got] == [_prompt_key(r) for r in ref], (alias, ref_alias)
            n_ref = round(sum(q["correct"] for q in ref))
            _, kept, _, _ = _paired_with_dense(got, ref, n_ref)
            cells.append(f"{kept} / {n_ref}")
            kept_all, n_all = kept_all + kept, n_all + n_ref
            same_all += sum(r["output_ids"] == q["output_ids"] for r, q in zip(got, ref))
            total += len(got)
            right_all += round(sum(r["correct"] for r in got))
        lo, hi = clopper_pearson(kept_all, n_all)
        lines.append(f"| {row_label} | {_NOISE_REFERENCE[ref_alias]} | {' | '.join(cells)} | "
                     f"{kept_all} / {n_all}: {100 * kept_all / n_all:.1f} % ({100 * lo:.1f}-{100 * hi:.1f} %) | "
                     f"{same_all} / {total} | {right_all} / {total} |")
    metas = [_load(f)["meta"] for f in sorted(files)]
    resumed, todo = [], list(metas)
    while todo:                                   # a resumed file may itself have resumed runs
        if (found := re.search(r"--resume (\S+)", todo.pop(0)["command"])):
            for path in found.group(1).split(","):
                meta = _load(pathlib.Path(path).name)["meta"]
                if (entry := f"`{path}` (commit {meta['commit']})") not in resumed:
                    resumed.append(entry)
                    todo.append(meta)
    note = (f"{metas[0]['model']}, greedy; {metas[0]['device_desc']}, vLLM {metas[0]['vllm']}, torch {metas[0]['torch']}; "
            f"{', '.join(sorted({m['date'][:10] for m in metas}))}; commit "
            f"{', '.join(sorted({m['commit'] for m in metas if m.get('commit')}))}"
            + (f"; the runs a command takes by `--resume` come from {', '.join(resumed)}" if resumed else "") + "; "
            + "; ".join(f"`{m['command']}`" for m in metas) + "; source: "
            + ", ".join(f"`bench/results/{f}`" for f in sorted(files)) + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


def _user_needles_pooled() -> str:
    """The default's rows of the held-out sets pooled per length: dense's right values it kept."""
    per: dict[str, list[int]] = {}
    names = []
    for name in _USER_NEEDLE_POOLED:
        if not (ROOT / RESULTS / f"{name}.json").exists():
            continue
        d = _load(f"{name}.json")
        by = {c["name"]: c["samples"] for c in d["configs"]}
        if "sfi_default" not in by:
            continue
        names.append(name.rsplit("user_needles_", 1)[1])
        for r, q in zip(by["sfi_default"], by["dense"]):
            acc = per.setdefault(str(r["length"]), [0, 0, 0, 0])
            acc[0] += round(q["correct"])
            acc[1] += round(r["correct"] * q["correct"])
            acc[2] += 1
            acc[3] += round(r["correct"])
    if not per:
        return ""
    lines = [f"The default pooled over the held-out runs ({', '.join(names)}):", "",
             "| length | prompts | dense right | the default right (% of dense) "
             "| of dense's right, the default kept (95 % interval) |", "|---|---|---|---|---|"]
    for n in sorted(per, key=int):
        n_dense, kept, total, right = per[n]
        lo, hi = clopper_pearson(kept, n_dense)
        lines.append(f"| {n} | {total} | {n_dense} | {right} ({100 * right / n_dense:.0f}) | {kept} / {n_dense}: "
                     f"{100 * kept / n_dense:.1f} % ({100 * lo:.1f}-{100 * hi:.1f} %) |")
    return "\n".join(lines) + "\n\n"


def long_answers() -> str:
    """ROUGE-L F of the preset's 256-token answers against dense bf16's, and of dense
    bf16's against dense fp32's (the precision noise floor)."""
    name = "long_answers_cpu_smollm2.json"
    d = _load(name)
    lines = ["| documents | n | preset vs dense bf16 | dense bf16 vs dense fp32 | preset vs dense fp32 "
             "| identical: preset = dense bf16 / bf16 = fp32 |", "|---|---|---|---|---|---|"]
    for group, s in d["summary"].items():
        label = "all" if group == "all" else group.replace("|", ", ")
        lines.append(f"| {label} | {s['n']} | {s['config_vs_dense_bf16']:.3f} | {s['dense_bf16_vs_dense_fp32']:.3f} | "
                     f"{s['config_vs_dense_fp32']:.3f} | {s['identical_config_dense_bf16']} / "
                     f"{s['identical_dense_bf16_fp32']} |")
    m = d["meta"]
    note = (f"{m['model']}, greedy, {m['max_tokens']} tokens; the preset's fast steps read "
            f"{m['fast_retained_fraction']:.3f} of their context ({m['slow_steps']} slow / {m['fast_steps']} fast "
            f"steps); {m['device_desc']} (load {m['load_average'][0]:.1f} at the end), vLLM {m['vllm']}, torch "
            f"{m['torch']}; {m['date'][:10]}; commit {m['commit']}; `{m['command']}`; {_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def long_answers_summary() -> str:
    """The README's line of :func:`long_answers`: the mean over every document."""
    name = "long_answers_cpu_smollm2.json"
    d = _load(name)
    s, m = d["summary"]["all"], d["meta"]
    return (f"On {s['n']} long answers ({m['max_tokens']} tokens, summaries and continuations of 4K-8K "
            f"logbooks) the preset's text agrees with dense bf16's at ROUGE-L {s['config_vs_dense_bf16']:.3f}, "
            f"dense bf16 with dense fp32 at {s['dense_bf16_vs_dense_fp32']:.3f}: the preset falls short of "
            f"dense's own precision noise. {m['model']}; {m['device_desc']}; {m['date'][:10]}; commit "
            f"{m['commit']}; `{m['command']}`; {_source(name)}.\n")


def _speed_adapt_table(d: dict, by_task: bool) -> list[str]:
    """The rows of bench/speed_adapt_report.py's JSON: right answers (per task, then) per length, in
    all, and agreement with each model's dense run."""
    tasks = list(d["rows"][0]["per_task"]) if by_task else []
    cols = [f"`{t}`" for t in tasks] + [f"{n} tokens" for n in d["meta"]["lengths"]]
    lines = ["| model, attention | " + " | ".join(cols) + " | all | same tokens as its dense |",
             "|---" * (len(cols) + 3) + "|"]
    for r in d["rows"]:
        counts = (*(r["per_task"].values() if by_task else ()), *r["per_length"].values())
        cells = " | ".join(f"{a:g} / {b}" for a, b in counts)
        lines.append(f"| {r['label']} | {cells} | **{r['correct']:g} / {r['n']}** | "
                     f"{round(r['agreement_with_dense'] * r['n'])} / {r['n']} |")
    return lines


def speed_adapt_cpu() -> str:
    """SPEED on the self-distilled real model (scripts/adapt_speed.py, bench/speed_adapt_report.py)."""
    name = "speed_adapt_eval_cpu_smollm2.json"
    d = _load(name)
    m, t, cap = d["meta"], d["training"], d["concurrency"]
    lines = _speed_adapt_table(d, by_task=False)
    hb, ha, dr, w = t["heldout_before"], t["heldout_after"], t["dense_drift_heldout"], t["wall_s"]
    train = (f"Adaptation: {t['training_prompts']} prompts ({t['teacher_prompt_tokens']:,} prompt tokens, "
             f"{t['teacher_generated_tokens']:,} generated by the dense model), {t['training_records']} records, "
             f"{t['steps']} steps of {t['records_per_step']} records, LoRA rank {t['lora']['lora_rank']} on layers "
             f"{t['l_cut']}-{t['num_layers'] - 1} ({t['trainable_params']:,} parameters); the run took "
             f"{_minutes(w['total'])} of wall time, {_minutes(w['teacher'])} of it the dense model's passes and "
             f"{_minutes(w['train'])} training. On "
             f"{hb['records']} held-out records, KL(dense || SPEED) {hb['kl']:.3f} before, {ha['kl']:.3f} "
             f"after; top-1 agreement with dense {hb['top1_agreement']:.3f} before, {ha['top1_agreement']:.3f} "
             f"after; the adapted model run dense against the original: KL {dr['kl']:.4f}, top-1 "
             f"{dr['top1_agreement']:.3f}.")
    conc = (f" vLLM's start-up \"Maximum concurrency\" for {cap['max_model_len']}-token requests on the same "
            f"{cap['kv_cache_bytes'] >> 20} MiB KV cache: {cap['dense']:.2f}x dense, {cap['speed']:.2f}x SPEED "
            f"({cap['ratio']:.2f}x as many requests)." if cap else "")
    note = (f"{m['n_samples']} held-out prompts per row ({', '.join(m['tasks'])} through the chat template, "
            f"depths {', '.join(str(x) for x in m['depths'])}, seed {m['seed']}; training seeds start at "
            f"1,000,000); {_speed_eval_run(m)}; `{m['commands']['original']}`; `{m['commands']['adapted']}`; "
            f"`{m['commands']['report']}`; {_source(name)}.")
    return "\n".join(lines) + "\n\n" + train + conc + "\n\n" + note + "\n"


def _speed_adapt_by_task(name: str, prompts: str) -> str:
    """The SPEED-adapted real model on a held-out set (bench/speed_adapt_report.py --by-task): right
    answers per task and per length, and agreement with each model's dense run."""
    d = _load(name)
    m = d["meta"]
    lines = _speed_adapt_table(d, by_task=True)
    note = (f"{m['n_samples']} held-out prompts per row ({prompts}; depths {', '.join(str(x) for x in m['depths'])}, "
            f"seed {m['seed']}; an answer is right when it gives every expected value); {_speed_eval_run(m)}; "
            f"`{m['commands']['original']}`; `{m['commands']['adapted']}`; `{m['commands']['report']}`; "
            f"{_source(name)}.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def speed_adapt_cpu_tasks() -> str:
    """RULER's multi-needle tasks (the adaptation drew its prompts from the same generators, other seeds)."""
    return _speed_adapt_by_task("speed_adapt_eval_cpu_smollm2_tasks.json",
                                "RULER's multi-key and multi-value needles through the chat template; the "
                                "adaptation's prompts come from the same generators at seeds from 1,000,000")


def _speed_right(d: dict, model: str, config: str) -> str:
    """Right answers of ``model`` ("original" / "adapted") under ``config`` in a
    bench/speed_adapt_report.py JSON ("-": not run)."""
    r = next((x for x in d["rows"] if x["label"].startswith(model + ",") and x["config"] == config), None)
    return "-" if r is None else f"{r['correct']:g}"


def _speed_eval_run(m: dict) -> str:
    """Where and how a bench/speed_adapt_report.py JSON's evaluations ran (its ``meta``)."""
    return f"{m['device_desc']} (shared), vLLM {m['vllm']}, fp32, greedy; {m['date'][:10]}; commit {m['commit']}"


def _adaptation_summary(t: dict) -> str:
    """An adaptation run (its report's ``training``): command, size, time, held-out KL, dense drift."""
    hb, ha, dr = t["heldout_before"], t["heldout_after"], t["dense_drift_heldout"]
    return (f"`{t['command']}`: {t['training_prompts']} prompts, {t['training_records']} records, {t['steps']} "
            f"steps, {_minutes(t['wall_s']['total'])} of wall time; held-out KL(dense || SPEED) {hb['kl']:.3f} "
            f"before, {ha['kl']:.3f} after; its dense run against the original's: KL {dr['kl']:.4f}, top-1 "
            f"{dr['top1_agreement']:.3f}")


def speed_adapt_cpu_dense_kept() -> str:
    """The second adaptation (KL plus the term that keeps the adapted model's own dense run) beside the
    first, on the three held-out sets (bench/speed_adapt_report.py of each)."""
    sets = (("`niah_single` (10)", "speed_adapt_eval_cpu_smollm2.json", "speed_adapt_eval_cpu_smollm2_dense_kept.json"),
            ("needles as a user writes them (12)", "speed_adapt_eval_cpu_smollm2_needles.json",
             "speed_adapt_eval_cpu_smollm2_needles_dense_kept.json"),
            ("RULER multi-key / multi-value (12)", "speed_adapt_eval_cpu_smollm2_tasks.json",
             "speed_adapt_eval_cpu_smollm2_tasks_dense_kept.json"))

    right = _speed_right
    lines = ["| held-out set | original: dense | original: SPEED | adapted, KL only: SPEED / dense | "
             "adapted, KL + dense kept: SPEED / dense |", "|---|---|---|---|---|"]
    for what, first, second in sets:
        a, b = _load(first), _load(second)
        lines.append(f"| {what} | {right(a, 'original', 'dense')} | {right(a, 'original', 'speed')} | "
                     f"{right(a, 'adapted', 'speed')} / {right(a, 'adapted', 'dense')} | "
                     f"**{right(b, 'adapted', 'speed')} / {right(b, 'adapted', 'dense')}** |")
    d = _load(sets[0][2])
    t, m, t1 = d["training"], d["meta"], _load(sets[0][1])["training"]
    note = (f"The second adaptation: {_adaptation_summary(t)} (the first adaptation, "
            f"{t1['training_prompts']} prompts and the KL term alone: {t1['heldout_after']['kl']:.3f} after; "
            f"its dense run KL {t1['dense_drift_heldout']['kl']:.4f}, top-1 "
            f"{t1['dense_drift_heldout']['top1_agreement']:.3f}). The held-out prompts and "
            f"commands of each set as in the tables above, the adapted model "
            f"`{t['out']}`; {_speed_eval_run(m)}; {_source(sets[0][2])}, " + ", ".join(f"`{RESULTS}/{x[2]}`" for x in sets[1:]) + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


SPEED_ADAPT_8K = (("`niah_single` (5)", "speed_adapt_eval_cpu_smollm2_8k_dense_kept.json"),
                  ("needles as a user writes them (6)", "speed_adapt_eval_cpu_smollm2_needles_8k_dense_kept.json"),
                  ("RULER multi-key / multi-value (6)", "speed_adapt_eval_cpu_smollm2_tasks_8k_dense_kept.json"))


def speed_adapt_cpu_8k() -> str:
    """The checkpoint that keeps its dense run (the second adaptation, rebuilt by its command) at 8K,
    beside the original model, on the three held-out sets' designs (bench/speed_adapt_report.py of each)."""
    right = _speed_right
    lines = ["| held-out set, 8K | original: dense | original: SPEED | adapted: SPEED | adapted: dense | "
             "adapted: SPEED + `sfi` preset |", "|---|---|---|---|---|---|"]
    for what, name in SPEED_ADAPT_8K:
        d = _load(name)
        lines.append(f"| {what} | {right(d, 'original', 'dense')} | {right(d, 'original', 'speed')} | "
                     f"**{right(d, 'adapted', 'speed')}** | {right(d, 'adapted', 'dense')} | "
                     f"{right(d, 'adapted', 'speed_sfi')} |")
    d = _load(SPEED_ADAPT_8K[0][1])
    t, m = d["training"], d["meta"]
    note = (f"The adaptation: {_adaptation_summary(t)}. The prompts: the designs of the tables above at "
            f"8,000 tokens (the model's context is 8,192); {_speed_eval_run(m)}; "
            + "; ".join(f"`{_load(n)['meta']['commands']['original']}`; `{_load(n)['meta']['commands']['adapted']}`"
                        for _, n in SPEED_ADAPT_8K)
            + "; source: " + ", ".join(f"`{RESULTS}/{n}`" for _, n in SPEED_ADAPT_8K) + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


SPEED_ADAPT_USER = (("`niah_single`, 2K + 4K (10)", "speed_adapt_eval_cpu_smollm2_dense_kept.json",
                      "speed_adapt_eval_cpu_smollm2_dense_kept_user.json"),
                     ("needles as a user writes them, 2K + 4K (12)", "speed_adapt_eval_cpu_smollm2_needles_dense_kept.json",
                      "speed_adapt_eval_cpu_smollm2_needles_dense_kept_user.json"),
                     ("needles as a user writes them, 8K (6)", "speed_adapt_eval_cpu_smollm2_needles_8k_dense_kept.json",
                      "speed_adapt_eval_cpu_smollm2_needles_8k_dense_kept_user.json"))


def speed_adapt_cpu_user() -> str:
    """The checkpoint that keeps its dense run, adapted once more on prompts of the user-written forms
    and the logbook question only (the recipe run again from it), beside it on the held-out sets."""
    right = _speed_right
    lines = ["| held-out set | original: dense | original: SPEED | adapted, dense kept: SPEED / dense | "
             "then user-form prompts: SPEED / dense |", "|---|---|---|---|---|"]
    present = [x for x in SPEED_ADAPT_USER if (ROOT / RESULTS / x[2]).exists()]
    if not present:
        return "(no runs yet)\n"
    for what, before, after in present:
        a, b = _load(before), _load(after)
        lines.append(f"| {what} | {right(a, 'original', 'dense')} | {right(a, 'original', 'speed')} | "
                     f"{right(a, 'adapted', 'speed')} / {right(a, 'adapted', 'dense')} | "
                     f"**{right(b, 'adapted', 'speed')} / {right(b, 'adapted', 'dense')}** |")
    d = _load(present[0][2])
    t, m = d["training"], d["meta"]
    note = (f"The second pass, from the checkpoint that keeps its dense run (its own dense run the teacher; "
            f"\"its dense run\" below is against that checkpoint's): {_adaptation_summary(t)}. The held-out "
            f"prompts and commands of each set as in the tables above, the adapted model `{t['out']}`; "
            f"{_speed_eval_run(m)}; "
            + "; ".join(f"`{_load(x[2])['meta']['commands']['adapted']}`" for x in present)
            + "; source: " + ", ".join(f"`{RESULTS}/{x[2]}`" for x in present) + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


def speed_adapt_cpu_needles() -> str:
    """Needles as a user writes them (vllm_ext.quality.user_needles)."""
    return _speed_adapt_by_task("speed_adapt_eval_cpu_smollm2_needles.json",
                                "a 6-digit value in a support ticket, a text message or a quoted e-mail in a "
                                "logbook, asked as a user asks; the adaptation's prompts come from the same "
                                "generators at seeds from 1,000,000")


# a number with a unit of time, speed or size, a ratio or a percentage: a measurement
MEASURED = re.compile(r"\b\d+(?:[.,]\d+)?(?:K\s?(?:tokens/s|tok/s)|\s?(?:TB/s|GB/s|tokens/s|tok/s|ms|us|µs|min|s|x|%"
                      r"|GiB|MiB|GB|MB))(?![\w-])")
EXEMPT = re.compile(r"^<!-- (not measured|historical): (\S.*?) -->$")
_FENCE = re.compile(r"```.*?```", re.S)


def _blanked(text: str) -> list[str]:
    """The page's lines with figure blocks and code fences (commands, not figures) emptied."""
    def blank(m: re.Match) -> str:
        return "\n" * m.group(0).count("\n")

    return _FENCE.sub(blank, BLOCK.sub(blank, text)).split("\n")


def scan(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str, list[str]]]]:
    """(stray, exempt): each measured figure outside a block, fence or marked paragraph as
    (line, figure); each mark as (line, kind, why, the figures its paragraph holds)."""
    stray, exempt, mark = [], [], None
    for number, line in enumerate(_blanked(text), 1):
        m = EXEMPT.match(line.strip())
        if m:
            mark = (number, m.group(1), m.group(2), [])
            exempt.append(mark)
            continue
        if not line.strip():
            mark = None
            continue
        found = MEASURED.findall(line)
        if mark:
            mark[3].extend(found)
        else:
            stray += [(number, f) for f in found]
    return stray, exempt


def _steady_note(f: dict) -> str:
    after = next((r["steady"]["after"] for r in f["rows"] if "steady" in r), None)
    repeats = max(sum(1 for x in f["rows"] if (x["config"], x["length"], x["batch"]) == (r["config"], r["length"], r["batch"]))
                  for r in f["rows"])
    return ((f" (steady state from step {after})" if after is not None else "")
            + (f", each configuration {repeats} times interleaved, pooled" if repeats > 1 else ""))


def cpu_decode_batch(names: tuple[str, ...] = ("cpu_decode_batch_bf16_avx512.json",)) -> str:
    """B requests of L prompt tokens decoding together on the CPU build: mean step, SFI's speed-up and
    how close each config's step comes to the bytes it reads. A later file's row replaces an earlier
    one's at the same point (measured again after a change)."""
    files, rows = _decode_rows(names)
    d = files[0][1]
    unit = d["unit"]
    points = sorted({(k[1], k[2]) for k in rows})
    names_ = {"cpu_attn": "`CPU_ATTN`", "all_off": "all off", "sfi": "`sfi` preset", "quest_rerank": "Quest",
              "sfi_gap16": "`sfi` + gap 16"}
    configs = [c for c in names_ if any(k[0] == c for k in rows)]
    has_steady = any("steady" in r for r in rows.values())
    gap = "sfi_gap16" in configs
    lines = ["| prompt x batch | " + " | ".join(f"{names_[c]} ms" for c in configs) + " | `sfi` speed-up | "
             + ("`sfi` + gap 16 speed-up, slow row-steps | " if gap else "")
             + "`sfi` median ms | `sfi` slow row-steps |" + (" `sfi` steady state: ms, speed-up, slow |" if has_steady
                                                            else "") + " GB/s read: `CPU_ATTN` / `sfi` |",
             "|" + " --- |" * (len(configs) + 5 + has_steady + gap)]
    for length, batch in points:
        got = {c: rows.get((c, length, batch)) for c in configs}
        base, sfi = got.get("cpu_attn"), got.get("sfi")
        cells = [f"{got[c][unit + '_ms_mean']:.0f}" if got[c] else "-" for c in configs]
        speed = f"{base[unit + '_ms_mean'] / sfi[unit + '_ms_mean']:.2f}x" if base and sfi else "-"
        rate = (f"{base['achieved_gbps_' + unit]:.1f} / {sfi['achieved_gbps_' + unit]:.1f}"
                if base and sfi else "-")
        med = f"{sfi[unit + '_ms_median']:.0f}" if sfi else "-"
        slow = f"{sfi['slow_row_steps']:.0f} of {len(sfi['cpu_ms']) * batch}" if sfi else "-"
        later = ""
        if has_steady:
            st = sfi.get("steady") if sfi else None
            later = (f" {st[unit + '_ms_mean']:.0f}, {base[unit + '_ms_mean'] / st[unit + '_ms_mean']:.2f}x, "
                     f"{st['slow_row_steps']:.0f} of {st['row_steps']} |" if st and base else " - |")
        extra = ""
        if gap:
            g = got.get("sfi_gap16")
            extra = (f" {base[unit + '_ms_mean'] / g[unit + '_ms_mean']:.2f}x, {g['slow_row_steps']:.0f} |"
                     if base and g else " - |")
        lines.append(f"| {length} x {batch} | " + " | ".join(cells) + f" | {speed} |{extra} {med} | {slow} |{later} {rate} |")
    env, reads = d["env"], {r["threads"]: r["copy_read_gbps"] for r in d["read_rate"]}
    timing = ("thread CPU time, one OpenMP thread" if unit == "cpu"
              else f"wall time, {env['cores']} threads")
    runs = "; ".join(f"{', '.join(sorted({r['config'] for r in f['rows']}))} at "
                     f"{', '.join(str(x) for x in sorted({r['length'] for r in f['rows']}))}: {f['env']['time_utc'][:10]}, commit "
                     f"{f['commit']}, {f['rows'][0].get('steps') or len(f['rows'][0]['cpu_ms'])} timed steps"
                     f"{_steady_note(f)}, `{f['command']}`, "
                     f"{f['note']}, "
                     f"{_source(n)}" for n, f in files)
    return ("\n".join(lines) + "\n\n"
            f"{env['cpu']} ({env['cores']} cores, {env['isa']}), vLLM 0.32.0 CPU build, torch {env['torch']}; "
            f"SmolLM2-135M-Instruct, {d['dtype']}, KV cache {d.get('kv_cache_dtype', 'auto')}; whole engine steps "
            f"in which every row decodes, {timing}, mean "
            f"(slow steps included); the machine read {reads.get(1, float('nan')):.1f} GB/s on one thread (a 256 "
            f"MiB copy, at the first run's start). Runs: {runs}.\n")


FIGURES = {"cpu_decode_batch": cpu_decode_batch,
           "cpu_decode_grid": lambda: cpu_decode_batch(CPU_DECODE_GRID),
           "cpu_decode_grid_2threads": lambda: cpu_decode_batch(CPU_DECODE_GRID_2THREADS),
           "cpu_decode_grid_2threads_long": lambda: cpu_decode_batch(CPU_DECODE_GRID_2THREADS_LONG),
           "speed_adapt_cpu_8k": speed_adapt_cpu_8k,
           "cpu_decode_batch_fp8": lambda: cpu_decode_batch((CPU_DECODE_FP8,)),
           "cpu_decode_gap16": lambda: cpu_decode_batch(("cpu_decode_batch_bf16_avx512_gap16_fastprefetch.json",)),
           "cpu_decode_batch_2threads": lambda: cpu_decode_batch(("cpu_decode_batch_bf16_avx512_2threads.json",)),
           "quality_fp8": quality_fp8,
           "quality_noise_critiprefill": quality_noise_control,
           "quality_noise_critiprefill_budget": lambda: quality_noise_control(
               NOISE_CONTROL_CRITIPREFILL_BUDGET, NOISE_CONTROL_CRITIPREFILL_BUDGET_ROWS),
           "quality_noise_fp8": lambda: quality_noise_control(NOISE_CONTROL_FP8, NOISE_CONTROL_FP8_ROWS),
           "quality_fp8_heldout3": lambda: quality_fp8(QUALITY_FP8_HELDOUT3, "sfi_default"), "cpu_decode_headline": cpu_decode_headline, "first_hour": first_hour, "gpu_h200": gpu_h200, "h200_decode_kernels": h200_decode_kernels, "document_question": document_question,
           "cpu_steps": cpu_steps, "sfi_path": sfi_path, "gpu_kernels": gpu_kernels, "load_cpu": load_cpu, "load_passes": load_passes, "soak": soak,
           "soak_tight_kv": soak_tight_kv, "concurrency_cpu": concurrency_cpu,
           "concurrency_critiprefill_cpu": concurrency_critiprefill_cpu,
           "cpu_prefill": cpu_prefill, "cpu_prefill_headline": cpu_prefill_headline,
           "cpu_prefill_layer": cpu_prefill_layer,
           "quality_critiprefill_needles": quality_critiprefill_needles,
           "quality_critiprefill_heldout": lambda: quality_critiprefill_needles(
               "quality_cpu_smollm2_critiprefill_needles_heldout.json"),
           "quality_critiprefill_heldout2": lambda: quality_critiprefill_needles(
               "quality_cpu_smollm2_critiprefill_needles_heldout2.json"),
           "quality_critiprefill_heldout3": lambda: quality_critiprefill_needles(
               "quality_cpu_smollm2_critiprefill_needles_heldout3.json"),
           "quality_critiprefill_budget_tuning": lambda: quality_critiprefill_needles(
               "quality_cpu_smollm2_critiprefill_budget_tuning.json"),
           "quality_real_2k": quality_real_2k, "quality_real_4k8k": quality_real_4k8k, "quality_retrieval_sfi": quality_retrieval_sfi,
           "quality_qwen3": quality_qwen3, "quality_keep_prefill": quality_keep_prefill, "quality_quest_keep": quality_quest_keep,
           "quality_quest_rerank": quality_quest_rerank, "quality_critiprefill": quality_critiprefill,
           "quality_user_needles": quality_user_needles, "long_answers": long_answers,
           "long_answers_summary": long_answers_summary, "speed_adapt_cpu": speed_adapt_cpu,
           "speed_adapt_cpu_tasks": speed_adapt_cpu_tasks, "speed_adapt_cpu_needles": speed_adapt_cpu_needles,
           "speed_adapt_cpu_dense_kept": speed_adapt_cpu_dense_kept, "speed_adapt_cpu_user": speed_adapt_cpu_user}


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(text: str) -> str:
    def block(m: re.Match) -> str:
        name = m.group(2)
        if name not in FIGURES:
            raise KeyError(f"unknown figure block {name!r} (scripts/write_figures.py FIGURES)")
        return m.group(1) + FIGURES[name]() + m.group(4)

    return BLOCK.sub(block, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    args = ap.parse_args()
    drifted = []
    for path in documents():
        text = path.read_text()
        new = render(text)
        if new != text:
            drifted.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    verb = "differ from their files" if args.check else "rewritten"
    print(f"figure blocks {verb}: {', '.join(drifted) or 'none'}")
    stray = [f"{path.relative_to(ROOT)}:{line}: {figure}"
             for path in documents() for line, figure in scan(path.read_text())[0]]
    if stray:
        print("measured figures outside a figure block (generate them, drop them or mark the paragraph):")
        print("\n".join(f"  {s}" for s in stray))
    return 1 if args.check and (drifted or stray) else 0


if __name__ == "__main__":
    sys.exit(main())
