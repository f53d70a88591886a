#!/usr/bin/env python3
"""Writes the measured figures of README.md and docs/*.md from the committed result files.

Each figure block sits between ``<!-- figures: NAME -->`` and ``<!-- /figures -->`` and is rewritten
from its ``bench/results/`` file, with the machine, the date, the commit and the command that
produced it. ``--check`` writes nothing and exits 1 when a block differs from its file
(``tests/test_figures.py`` runs the same check).

    python scripts/write_figures.py           # rewrite the blocks
    python scripts/write_figures.py --check   # fail on drift
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
# result files that do not record the commit they were measured at
UNRECORDED_COMMIT = {"vllm_e2e_h200.json": "results committed at 7477d12 (the file records no commit)"}
# result files that do not record their date: the date of the commit they were measured at
UNRECORDED_DATE = {"document_question_smollm2.json": "2026-11-25"}


def _load(name: str) -> dict:
    return json.loads((ROOT / RESULTS / name).read_text())


def _source(name: str) -> str:
    return f"source: `{RESULTS}/{name}`"


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s} s" if s and m < 10 else f"{round(seconds / 60)} min"


def first_hour() -> str:
    d = _load("first_hour.json")
    demo, tests = d["demo"], d["tests"]
    right = [m for m, ok in demo["correct"].items() if ok]
    wrong = [m for m, ok in demo["correct"].items() if not ok]
    names = {"dense": "Dense", "sfi": "SFI", "critiprefill": "CritiPrefill"}
    return (
        f"- `scripts/demo.sh` took **{_minutes(demo['wall_s'])}** with set-up. It serves "
        "SmolLM2-135M-Instruct with `vllm serve --attention-backend speedsfi` three times (dense, the "
        f"`sfi` preset, CritiPrefill), asks each about a {demo['document_tokens']:,}-token logbook and "
        "prints each answer, whether it is right, the share of the KV each method read, and a summary "
        f"table. {' and '.join(names[m] for m in right)} find the locker number; "
        f"{' and '.join(names[m] for m in wrong)} at that budget does not.\n"
        f"- `scripts/run_tests.sh` took **{_minutes(tests['wall_s'])}** ({tests['passed']} passed, "
        f"{tests['skipped']} skipped for want of a GPU, {tests['failed']} failed). "
        "`scripts/run_tests.sh -m \"not slow\"` runs the unit tests only (no engines).\n\n"
        f"Machine: {d['machine']}; {d['date']}; commit {d['commit']} (issue 38's trial of a fresh clone); "
        f"{_source('first_hour.json')}.\n")


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


_DOCUMENT_ROWS = (("dense", "dense"), ("default", "the `sfi` preset (default)"),
                  ("default_no_warmup", "the preset without `refresh_warmup`"),
                  ("sfi_paper", "SFI as published (`sfi-paper`)"),
                  ("critiprefill", "CritiPrefill, 1024 keys per 128-query segment"))


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
            f"{_source(name)}.\n")


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


FIGURES = {"first_hour": first_hour, "gpu_h200": gpu_h200, "document_question": document_question,
           "cpu_steps": cpu_steps}


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
    return 1 if args.check and drifted else 0


if __name__ == "__main__":
    sys.exit(main())
