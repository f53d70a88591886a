#!/usr/bin/env python
"""SPEED on a self-distilled checkpoint (scripts/adapt_speed.py): one JSON and a markdown table from
the adaptation run and two ``scripts/eval_quality.py`` runs (the original model: dense + SPEED; the
adapted one: dense + SPEED [+ SPEED with the ``sfi`` preset]), plus vLLM's own start-up capacity
("Maximum concurrency") of the adapted model dense and under SPEED on the evaluation's KV budget.

    .venv/bin/python bench/speed_adapt_report.py --adapt bench/results/speed_adapt_cpu_smollm2_l22.json \\
        --original bench/results/speed_adapt_eval_cpu_smollm2_original.json \\
        --adapted bench/results/speed_adapt_eval_cpu_smollm2_adapted.json \\
        --out bench/results/speed_adapt_eval_cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapt", required=True, help="scripts/adapt_speed.py --results JSON")
    p.add_argument("--original", required=True, help="eval_quality JSON of the original model")
    p.add_argument("--adapted", required=True, help="eval_quality JSON of the adapted model")
    p.add_argument("--speed-config", default="speed", help="the SPEED configuration's name in both")
    p.add_argument("--sfi-config", default="speed_sfi", help="SPEED + the sfi preset, in --adapted")
    p.add_argument("--no-concurrency", action="store_true", help="skip the two engine start-ups")
    p.add_argument("--by-task", action="store_true", help="the markdown table per task, then per length")
    p.add_argument("--out", required=True, help="the JSON to write (and a .md beside it)")
    return p.parse_args(argv)


def _kind(sample: dict) -> str:
    """A sample's task, or for a needle written as a user writes it its form (``user_ticket``, ...)."""
    wording = str(sample.get("wording") or "")
    return wording if wording.startswith("user_") else sample["task"]


def row(run: dict, name: str, label: str) -> dict | None:
    c = next((x for x in run["configs"] if x["name"] == name), None)
    if c is None:
        return None
    s = c["samples"]
    lengths = sorted({x["length"] for x in s})
    tasks = sorted({_kind(x) for x in s})
    return dict(label=label, config=name, speedsfi=c["speedsfi"], n=len(s),
                correct=sum(x["correct"] for x in s),
                per_length={str(n): [sum(x["correct"] for x in s if x["length"] == n),
                                     sum(1 for x in s if x["length"] == n)] for n in lengths},
                per_task={t: [sum(x["correct"] for x in s if _kind(x) == t),
                              sum(1 for x in s if _kind(x) == t)] for t in tasks},
                agreement_with_dense=c["agreement_with_dense"],
                upper_tokens_skipped=sum(v.get("speed.upper_tokens_skipped", 0) for v in c["counters"].values()),
                fallbacks={k: v for cnt in c["counters"].values() for k, v in cnt.items()
                           if k.startswith("fallback.") and v},
                wall_s=c["wall_s"])


def concurrency(model: str, max_model_len: int, kv_bytes: int, speed: dict | None) -> float:
    """vLLM's start-up "Maximum concurrency" for ``max_model_len`` on a ``kv_bytes`` KV cache, the
    eval harness's CPU engine settings."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
              kv_cache_memory_bytes=kv_bytes, attention_backend="SPEEDSFI", block_size=32,
              max_num_batched_tokens=2048, max_num_seqs=8, enable_prefix_caching=False,
              additional_config={"speedsfi": {"speed": speed}} if speed else {})
    try:
        return float(llm.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()


def main(argv=None):
    args = parse(argv)
    with open(args.adapt) as f:
        adapt = json.load(f)
    with open(args.original) as f:
        original = json.load(f)
    with open(args.adapted) as f:
        adapted = json.load(f)
    l_cut = adapt["l_cut"]
    rows = [r for r in (row(original, "dense", "original, dense"),
                        row(original, args.speed_config, f"original, SPEED `l_cut` {l_cut}"),
                        row(adapted, args.speed_config, f"adapted, SPEED `l_cut` {l_cut}"),
                        row(adapted, "dense", "adapted, dense"),
                        row(adapted, args.sfi_config, f"adapted, SPEED `l_cut` {l_cut} + `sfi` preset"))
            if r is not None]
    meta = adapted["meta"]
    max_len = max(meta["lengths"]) + 128            # eval_quality's max_model_len
    kv_bytes = 512 << 20                             # eval_quality's default --kv-cache-bytes
    cap = None
    if not args.no_concurrency:
        model = os.path.join(ROOT, adapt["out"]) if not os.path.isabs(adapt["out"]) else adapt["out"]
        dense = concurrency(model, max_len, kv_bytes, None)
        speed = concurrency(model, max_len, kv_bytes, {"enabled": True, "l_cut": l_cut})
        cap = dict(max_model_len=max_len, kv_cache_bytes=kv_bytes, dense=dense, speed=speed, ratio=speed / dense)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    training = {k: adapt[k] for k in ("command", "base_model", "out", "l_cut", "num_layers", "training_prompts",
                                      "training_records", "heldout_prompts", "teacher_prompt_tokens",
                                      "teacher_generated_tokens", "decode_rows_trained", "steps",
                                      "records_per_step", "trainable_params", "heldout_before", "heldout_after",
                                      "dense_drift_heldout", "wall_s", "machine", "finished")}
    training["lora"] = {k: adapt["spec"][k] for k in ("lora_layers", "lora_rank", "lora_alpha", "targets", "lr")}
    out = dict(meta=dict(device_desc=meta["device_desc"], vllm=meta["vllm"], torch=meta["torch"], date=meta["date"],
                         commit=commit, tasks=meta["tasks"], lengths=meta["lengths"], depths=meta["depths"],
                         per_cell=meta["per_cell"], seed=meta["seed"], n_samples=meta["n_samples"],
                         metric=meta["metric"],
                         commands=dict(original=original["meta"]["command"], adapted=meta["command"],
                                       report=".venv/bin/python bench/speed_adapt_report.py "
                                              + " ".join(argv if argv is not None else sys.argv[1:]))),
               training=training, rows=rows, concurrency=cap)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    cols = [*(rows[0]["per_task"] if args.by_task else []), *(str(n) for n in meta["lengths"])]
    lines = ["| model, attention | " + " | ".join(cols) + " | all | same tokens as its dense |",
             "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        cells = " | ".join(f"{a:g} / {b}" for a, b in (*(r["per_task"].values() if args.by_task else ()),
                                                        *r["per_length"].values()))
        lines.append(f"| {r['label']} | {cells} | **{r['correct']:g} / {r['n']}** | "
                     f"{round(r['agreement_with_dense'] * r['n'])} / {r['n']} |")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if cap:
        print(json.dumps(cap))


if __name__ == "__main__":
    main()
