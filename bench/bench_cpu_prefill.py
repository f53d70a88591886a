#!/usr/bin/env python3
"""Whole-engine prefill on the CPU build: ``CPU_ATTN`` against the ``critiprefill`` preset, real model,
real vLLM, one prompt at a time.

    OMP_NUM_THREADS=1 python bench/bench_cpu_prefill.py --threads 1 --lengths 4096,8192,16384
    OMP_NUM_THREADS=2 python bench/bench_cpu_prefill.py --threads 2 --lengths 4096,8192,16384
    python bench/bench_cpu_prefill.py --plot-only
    OMP_NUM_THREADS=1 python bench/bench_cpu_prefill.py --layer --lengths 4096,8192,16384

Each run adds its rows to ``--out`` as they are measured (JSON; rows of other configurations and
thread counts are kept) and redraws the plot beside it. Per (configuration, length, repeat): one request of ``max_tokens=1`` (every engine step is
a prefill step), the sum over its steps of the calling thread's CPU time (``time.thread_time``: with
one thread every op runs on it, and other jobs on a shared machine do not inflate it) and of the wall
time. Also per length: the fraction of the attention work (query x key pairs, summed over layers)
that CritiPrefill's plan skips (from the preset's rules, checked against the engine's
``critiprefill.key_blocks_*`` counters), and the achieved FLOP/s (the model's matmuls plus the
attention pairs each configuration computes, 4 D Hq FLOPs per pair, over the prefill's time).

``--layer``: one attention layer of the model's shape (random q/k/v in ``CPU_ATTN``'s vec pages, one
request, thread CPU time, best of 3): ``CPU_ATTN``'s prefill op against the compiled block-sparse
pass with an all-dense plan and with the preset's plan (the choice of kernel for dense segments);
rows into ``--out`` with the suffix ``_layer``.

fp32 (bf16 is emulated on CPUs without bf16 arithmetic, which would time the emulation). A longer
``max_model_len`` than the model's training length is allowed for timing
(``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "real_model" / "SmolLM2-135M-Instruct"
CONFIGS = {
    "cpu_attn": ("CPU_ATTN", {}),
    "critiprefill": ("SPEEDSFI", {"preset": "critiprefill"}),
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (set OMP_NUM_THREADS too)")
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--configs", default="cpu_attn,critiprefill")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096, help="--max-num-batched-tokens (prefill chunk)")
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_prefill_smollm2_fp32.json"))
    p.add_argument("--note", default="", help="the machine's state while it ran, stored with the rows")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--layer", action="store_true", help="one attention layer, kernels only")
    return p.parse_args(argv)


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return f"{name}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


def _model_shape(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    return dict(hidden=h, heads=hq, kv_heads=hkv, head_size=d, layers=cfg["num_hidden_layers"],
                intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"])


def attention_pairs(n: int, cp: dict | None, layers: int) -> float:
    """Query x key pairs the prefill of ``n`` tokens attends, summed over layers: causal for dense,
    CritiPrefill's plan (``cp``: its resolved section) otherwise."""
    dense = n * (n + 1) / 2
    if cp is None:
        return dense * layers
    sq, bk, budget, min_len = cp["segment_size"], cp["block_size"], cp["budget"], cp["min_len"]
    final = (n - 1) // sq
    sparse = 0.0
    for j in range(final + 1):
        s0, s1 = j * sq, min(n, (j + 1) * sq)
        m = s1 - s0
        before = s0
        if s0 >= min_len and j < final and s0 // bk > budget // bk:
            before = budget
        sparse += m * before + m * (m + 1) / 2
    n_dense = len([i for i in range(layers) if i in cp["dense_layers"]])
    return dense * n_dense + sparse * (layers - n_dense)


def model_flops(n: int, shape: dict) -> float:
    """The prefill's matmul FLOPs outside attention (projections, MLP; the LM head for one token)."""
    h, d = shape["hidden"], shape["head_size"]
    per_layer = 2 * h * d * (2 * shape["heads"] + 2 * shape["kv_heads"]) + 2 * 3 * h * shape["intermediate"]
    return n * per_layer * shape["layers"] + 2 * h * shape["vocab"]


def _run(args, save) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(ROOT))
    import torch

    torch._C.set_num_threads(args.threads)           # vLLM's CPU worker makes torch.set_num_threads a no-op
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics
    from vllm_ext.config import SpeedSfiConfig

    lengths = [int(x) for x in args.lengths.split(",")]
    shape = _model_shape(args.model)
    cp_section = dataclasses.asdict(SpeedSfiConfig.from_dict(CONFIGS["critiprefill"][1]).critiprefill)
    rows = []
    for name in args.configs.split(","):
        backend, section = CONFIGS[name]
        settings = dict(enforce_eager=True, dtype="float32", max_num_seqs=2, max_model_len=max(lengths) + 64,
                        max_num_batched_tokens=args.chunk, block_size=32,
                        kv_cache_memory_bytes=(max(lengths) + 64) * shape["layers"] * shape["kv_heads"]
                        * shape["head_size"] * 2 * 4 * 3, enable_prefix_caching=False, attention_backend=backend,
                        seed=0)
        if section:
            settings["additional_config"] = {"speedsfi": section}
        llm = LLM(model=args.model, **settings)
        eng = llm.llm_engine
        torch._C.set_num_threads(args.threads)
        gen = torch.Generator().manual_seed(0)
        for n in [1024] + lengths:                               # the first prompt warms up
            ids = torch.randint(100, shape["vocab"] - 100, (n,), generator=gen).tolist()
            for rep in range(1, args.repeats + 1) if n in lengths else [0]:
                before = metrics.snapshot()
                eng.add_request(f"{name}-{n}-{rep}", {"prompt_token_ids": ids},
                                SamplingParams(temperature=0, max_tokens=1))
                cpu = wall = 0.0
                steps = 0
                while eng.has_unfinished_requests():
                    t0, w0 = time.thread_time(), time.perf_counter()
                    eng.step()
                    cpu += time.thread_time() - t0
                    wall += time.perf_counter() - w0
                    steps += 1
                after = metrics.snapshot()
                counters = {k: after[k] - before.get(k, 0) for k in after
                            if k.startswith(("critiprefill.", "fallback."))}
                if rep == 0:
                    continue
                pairs = attention_pairs(n, cp_section if name == "critiprefill" else None, shape["layers"])
                flops = model_flops(n, shape) + 4 * shape["head_size"] * shape["heads"] * pairs
                row = dict(config=name, length=n, rep=rep, threads=args.threads, steps=steps,
                           prefill_cpu_s=round(cpu, 3), prefill_wall_s=round(wall, 3),
                           attention_pairs=pairs,
                           attention_skipped=1 - pairs / attention_pairs(n, None, shape["layers"]),
                           gflops=round(flops / 1e9, 1), achieved_gflop_s_cpu=round(flops / cpu / 1e9, 2),
                           counters=counters, note=args.note, date=time.strftime("%Y-%m-%d", time.gmtime()),
                           commit=_commit())
                print(json.dumps(row), flush=True)
                rows.append(row)
                save(rows)                                       # each row kept as soon as measured
        del llm, eng
        cleanup_dist_env_and_memory()
    return rows


def _summary(rows: list[dict]) -> list[dict]:
    """Per (threads, length): each configuration's median prefill times and the ratio."""
    out = []
    keys = sorted({(r["threads"], r["length"]) for r in rows})
    for threads, n in keys:
        sel = {c: [r for r in rows if r["threads"] == threads and r["length"] == n and r["config"] == c]
               for c in CONFIGS}
        if not all(sel.values()):
            continue
        med = {c: {k: round(statistics.median(r[k] for r in rs), 3) for k in ("prefill_cpu_s", "prefill_wall_s")}
               for c, rs in sel.items()}
        cp = sel["critiprefill"][0]
        out.append(dict(threads=threads, length=n, cpu_attn_cpu_s=med["cpu_attn"]["prefill_cpu_s"],
                        critiprefill_cpu_s=med["critiprefill"]["prefill_cpu_s"],
                        ratio_cpu=round(med["critiprefill"]["prefill_cpu_s"] / med["cpu_attn"]["prefill_cpu_s"], 3),
                        cpu_attn_wall_s=med["cpu_attn"]["prefill_wall_s"],
                        critiprefill_wall_s=med["critiprefill"]["prefill_wall_s"],
                        ratio_wall=round(med["critiprefill"]["prefill_wall_s"] / med["cpu_attn"]["prefill_wall_s"],
                                         3),
                        attention_skipped=round(cp["attention_skipped"], 3),
                        cpu_attn_gflop_s=round(statistics.median(r["achieved_gflop_s_cpu"] for r in sel["cpu_attn"]), 1),
                        critiprefill_gflop_s=round(statistics.median(r["achieved_gflop_s_cpu"]
                                                                     for r in sel["critiprefill"]), 1),
                        runs=dict((c, len(v)) for c, v in sel.items())))
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["summary"]
    if not summ:
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for threads in sorted({s["threads"] for s in summ}):
        ss = [s for s in summ if s["threads"] == threads]
        ns = [s["length"] for s in ss]
        clock = "thread CPU" if threads == 1 else "wall"
        key = "cpu_s" if threads == 1 else "wall_s"
        ax.plot(ns, [s[f"cpu_attn_{key}"] for s in ss], "o-", label=f"CPU_ATTN, {threads} thread(s), {clock}")
        ax.plot(ns, [s[f"critiprefill_{key}"] for s in ss], "^-", label=f"critiprefill, {threads} thread(s), {clock}")
        ax2.plot(ns, [s["ratio_cpu" if threads == 1 else "ratio_wall"] for s in ss], "s-",
                 label=f"{threads} thread(s), {clock}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill seconds (median)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax2.axhline(0.6, color="red", linestyle="--", linewidth=1, label="target at 16K: 0.6")
    ax2.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("critiprefill / CPU_ATTN prefill time")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"Engine prefill, {result['model']} fp32, {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layer(args) -> dict:
    """One attention layer: CPU_ATTN's prefill op against the compiled pass (dense plan, preset plan)."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch._C.set_num_threads(args.threads)
    import vllm._custom_ops as ops
    from vllm import envs

    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.kernels import cpu_native
    from vllm_ext.kernels.packed_pages import PackedPages
    from vllm_ext.methods.critiprefill.cpu_attn_prefill import attend_segments
    from vllm_ext.methods.critiprefill.criticality import LayerFusion
    from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan

    shape = _model_shape(args.model)
    hq, hkv, d, bs = shape["heads"], shape["kv_heads"], shape["head_size"], 32
    cfg = SpeedSfiConfig.from_dict(CONFIGS["critiprefill"][1]).critiprefill
    cp = dataclasses.asdict(cfg)
    scale = d ** -0.5
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        gen = torch.Generator().manual_seed(n)
        nb = -(-n // bs) + 1
        pages = PackedPages(torch.zeros(nb, hkv, bs, 2 * d), "vec")
        k, v, q = (torch.randn(n, h, d, generator=gen) for h in (hkv, hkv, hq))
        table = torch.randperm(nb, generator=gen)[:-(-n // bs)].to(torch.int32)
        slots = table.long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        ops.cpu_attn_reshape_and_cache(k, v, pages.key_cache, pages.value_cache, slots, "vec")
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq = torch.tensor([n], dtype=torch.int32)
        bt = table[None]
        out = torch.empty_like(q)

        def cpu_attn():
            sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq, dtype=torch.float32,
                query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec",
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=pages.key_cache, value_cache=pages.value_cache, output=out, query_start_loc=qsl,
                seq_lens=seq, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt,
                softcap=0, scheduler_metadata=sched, s_aux=None)

        def best(fn):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.thread_time()
                fn()
                ts.append(time.thread_time() - t0)
            return min(ts)

        t_cpu_attn = best(cpu_attn)
        ref = out.clone()
        dense = dense_plan(qsl, seq, hkv, cfg, num_tokens=n)
        t_dense = best(lambda: cpu_native.block_sparse_prefill(q, pages, bt, qsl, seq, dense, scale, out))
        err = (out - ref).abs().max().item()
        plan = build_plan(q, pages, bt, qsl, seq, cfg, layer_idx=1, fusion=LayerFusion(), max_seq_len=n,
                          max_query_len=n)
        t_plan = best(lambda: build_plan(q, pages, bt, qsl, seq, cfg, layer_idx=1, fusion=LayerFusion(),
                                         max_seq_len=n, max_query_len=n))
        t_sparse = best(lambda: cpu_native.block_sparse_prefill(q, pages, bt, qsl, seq, plan, scale, out))
        compiled = out.clone()
        t_route = best(lambda: attend_segments(q, pages, bt, qsl, seq, plan, scale, output=out))
        route_err = (out - compiled).abs().max().item()
        pairs_dense = attention_pairs(n, None, 1)
        pairs = attention_pairs(n, {**cp, "dense_layers": ()}, 1)
        flop = 4 * d * hq
        row = dict(length=n, threads=args.threads, cpu_attn_s=round(t_cpu_attn, 4), ours_dense_s=round(t_dense, 4),
                   ours_dense_max_abs_diff=err, plan_s=round(t_plan, 4), ours_preset_s=round(t_sparse, 4),
                   cpu_attn_route_s=round(t_route, 4), cpu_attn_route_max_abs_diff=route_err,
                   attention_skipped=round(1 - pairs / pairs_dense, 3),
                   cpu_attn_gflop_s=round(flop * pairs_dense / t_cpu_attn / 1e9, 1),
                   ours_dense_gflop_s=round(flop * pairs_dense / t_dense / 1e9, 1),
                   ours_preset_gflop_s=round(flop * pairs / t_sparse / 1e9, 1),
                   cpu_attn_route_gflop_s=round(flop * pairs / t_route / 1e9, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return dict(benchmark="cpu_prefill_layer", model=Path(args.model).name, dtype="float32",
                machine=_machine(), date=time.strftime("%Y-%m-%d", time.gmtime()), commit=_commit(),
                shape=dict(heads=hq, kv_heads=hkv, head_size=d, page=bs), config=cp, note=args.note,
                command="bench/bench_cpu_prefill.py " + " ".join(sys.argv[1:]), rows=rows)


def _save(args, rows: list[dict], argv) -> dict:
    """Merge ``rows`` into ``--out`` (read again now: runs of other configurations or thread counts may
    have written it meanwhile), redraw the plot."""
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else dict(
        benchmark="cpu_prefill", model=Path(args.model).name, dtype="float32",
        machine=_machine(), rows=[], commands=[])
    if rows:
        key = lambda r: (r["config"], r["length"], r["threads"], r["rep"])     # noqa: E731
        done = {key(r) for r in rows}
        result["rows"] = [r for r in result["rows"] if key(r) not in done] + rows
        command = "bench/bench_cpu_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv)
        result["commands"] = [c for c in result.get("commands", []) if c != command] + [command]
        result["chunk"] = args.chunk
    result["summary"] = _summary(result["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    return result


def main(argv=None) -> dict:
    args = _parse(argv)
    out = Path(args.out)
    if args.layer:
        result = _layer(args)
        path = out.with_name(out.stem + "_layer.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        return result
    if not args.plot_only:
        _run(args, lambda rows: _save(args, rows, argv))
    result = _save(args, [], argv)
    for s in result["summary"]:
        print(json.dumps(s))
    return result


if __name__ == "__main__":
    main()
