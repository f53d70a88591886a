#!/usr/bin/env python
"""SPEED's quality table: two ``scripts/eval_quality.py`` runs (the base model and the SPEED-adapted
one, each dense + SPEED) merged into one JSON, a markdown table (per length, per task) and a plot.

    .venv/bin/python bench/speed_quality_report.py \\
        --base bench/results/quality_cpu_retrieval-llama_speed.json \\
        --adapted bench/results/quality_cpu_retrieval-llama-speed_speed.json \\
        --out bench/results/quality_cpu_speed
"""

from __future__ import annotations

import argparse
import json


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="eval_quality JSON of the base model (dense + SPEED)")
    p.add_argument("--adapted", required=True, help="eval_quality JSON of the adapted model (dense + SPEED)")
    p.add_argument("--speed-config", default="speed_l3", help="the SPEED configuration's name in both")
    p.add_argument("--out", required=True, help="path stem: writes .json, .md, .png")
    return p.parse_args(argv)


def rows_of(run: dict, config: str, label: str) -> dict:
    c = next(x for x in run["configs"] if x["name"] == config)
    samples = c["samples"]
    lengths = sorted({s["length"] for s in samples})
    tasks = list(dict.fromkeys(s["task"] for s in samples))

    def acc(sel):
        return 100.0 * sum(s["correct"] for s in sel) / len(sel) if sel else float("nan")

    return dict(
        label=label, config=config, speedsfi=c["speedsfi"], model=run["meta"]["model"],
        n=len(samples), all=acc(samples),
        per_length={str(n): acc([s for s in samples if s["length"] == n]) for n in lengths},
        per_task_length={f"{t}|{n}": acc([s for s in samples if s["task"] == t and s["length"] == n])
                         for t in tasks for n in lengths},
        agreement_with_dense=100.0 * c["agreement_with_dense"],
        counters=c["counters"], wall_s=c["wall_s"],
    )


def markdown(rows, tasks, lengths) -> str:
    head = "| model, attention | " + " | ".join(str(n) for n in lengths) + " | all |"
    lines = [head, "|---" * (len(lengths) + 2) + "|"]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['per_length'][str(n)]:.1f}" for n in lengths)
                     + f" | **{r['all']:.1f}** |")
    lines += ["", "Per task and length:", "",
              "| model, attention | length | " + " | ".join(tasks) + " |",
              "|---" * (len(tasks) + 2) + "|"]
    for n in lengths:
        for r in rows:
            lines.append(f"| {r['label']} | {n} | "
                         + " | ".join(f"{r['per_task_length'][f'{t}|{n}']:.1f}" for t in tasks) + " |")
    return "\n".join(lines)


def plot(path, rows, lengths, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    w = 0.8 / len(rows)
    colors = ["#4c72b0", "#c44e52", "#55a868", "#8172b2"]
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * w for j in range(len(lengths))]
        ys = [r["per_length"][str(n)] for n in lengths]
        bars = ax.bar(xs, ys, w, label=r["label"], color=colors[i % len(colors)])
        for b, y in zip(bars, ys):
            ax.text(b.get_x() + b.get_width() / 2, y + 1, f"{y:.0f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(0, 125)
    ax.legend(fontsize=8, loc="upper center", ncol=len(rows))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse(argv)
    with open(args.base) as f:
        base = json.load(f)
    with open(args.adapted) as f:
        adapted = json.load(f)
    rows = [rows_of(base, "dense", "base, dense"),
            rows_of(base, args.speed_config, "base, SPEED l_cut 3"),
            rows_of(adapted, args.speed_config, "adapted, SPEED l_cut 3"),
            rows_of(adapted, "dense", "adapted, dense")]
    for r in rows[1:3]:
        r["label"] = r["label"].replace("l_cut 3", f"l_cut {r['speedsfi']['speed']['l_cut']}")
    meta = base["meta"]
    lengths, tasks = meta["lengths"], meta["tasks"]
    md = markdown(rows, tasks, lengths)
    runs = {"base": {k: base["meta"][k] for k in ("command", "model", "wall_s")},
            "adapted": {k: adapted["meta"][k] for k in ("command", "model", "wall_s")}}
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta={k: meta[k] for k in ("device", "device_desc", "vllm", "torch", "python", "date",
                                                   "tasks", "lengths", "depths", "per_cell", "seed",
                                                   "n_samples", "metric")},
                           runs=runs, rows=rows), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(md + f"\n\n{meta['n_samples']} samples per row ({meta['per_cell']} per task, length and depth); "
                f"{meta['device_desc']}, vllm {meta['vllm']}, torch {meta['torch']}.\n")
    plot(args.out + ".png", rows, lengths,
         f"SPEED through vLLM ({meta['vllm']}, CPU): exact match by prompt length, "
         f"{meta['n_samples'] // len(lengths)} samples per bar")
    print(md)


if __name__ == "__main__":
    main()
