#!/usr/bin/env python3
"""Decode on vLLM's CPU build where SFI matters: B requests of L prompt tokens decoding together.

    python bench/bench_cpu_decode_batch.py --threads 1     # thread CPU time, one OpenMP thread
    python bench/bench_cpu_decode_batch.py --threads 0     # wall time with every core
    python bench/bench_cpu_decode_batch.py --lengths 8000 --batches 8 --configs cpu_attn,sfi  # one point

For every configuration (``bench_cpu_vllm.CONFIGS``: ``CPU_ATTN``, every method off, the ``sfi``
preset, Quest with re-ranking) one in-process engine (the real model, bf16 unless ``--kv-dtype``
says otherwise for the cache, prefix caching on) runs, for each length, the batches from the
largest down: the largest batch prefills its B distinct prompts (different haystacks, same
length), the smaller ones reuse the first of them from vLLM's prefix cache (SFI recomputes its
prompt tail itself). Prefill runs with every core; then the decode steps in which every row of the
batch decodes are timed: whole engine steps (scheduler, plan, every layer, maintenance, sampling),
thread CPU time (``time.thread_time``: with ``--threads 1`` every op runs on the calling thread)
and wall time, mean (slow steps included) and median per step.

Bytes a step reads: the weights (the checkpoint's bytes) plus K and V of the tokens each row's
attention reads: a dense row its whole context, a fast SFI row its retained tokens (the
``sfi.fast_retained_tokens`` counter), a slow row its context once (the compiled evidence pass
attends and scores from one read of K and V; without the compiled kernels, ``CPU_ATTN`` attends
and the twin reads K once more for the evidence: 1.5 times the context). The achieved rate
(bytes / mean step time) stands beside the machine's measured read rate (a 256 MiB copy on one
thread and on every core). Writes ``bench/results/<name>.json`` and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# SPEEDSFI's counters are read in-process (metrics.snapshot); their trace file is written as a server
# writes it (at most once a second, off the step): an interval of 0 would write it in the step
# after every counter bump, a cost only SPEEDSFI's configurations would pay
for _k, _v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_k, _v)

DEFAULT_CONFIGS = "cpu_attn,all_off,sfi,quest_rerank"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".cache/real_model/SmolLM2-135M-Instruct"))
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--lengths", default="2048,4096,8000")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per point")
    p.add_argument("--steady-after", type=int, default=0,
                   help="also report the timed steps from this one on apart (SFI's refresh warm-up puts "
                        "slow steps at a request's decode steps 1, 3, 7, 15, 31: the later steps show a "
                        "long generation's steady state)")
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP threads while decoding (0: every core); prefill always uses every core")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the model's dtype (bf16: the real model's; on a CPU without bf16 arithmetic, "
                        "AVX2 only, its prefill is ~6x slower than fp32's)")
    p.add_argument("--kv-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, ...)")
    p.add_argument("--kv-gib", type=float, default=6.0, help="kv_cache_memory_bytes, GiB")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="vLLM's --max-num-seqs (0: the largest batch; a server keeps vLLM's default, "
                        "and SFI sizes its per-request tables and slow-step scratch by it)")
    p.add_argument("--profile", default=None, metavar="CONFIG",
                   help="cProfile (thread time) a slow and a fast step of this configuration at the "
                        "largest point and print the top functions")
    p.add_argument("--note", default="", help="the machine's state while it ran, kept in the JSON")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--name", default=None)
    return p.parse_args(argv)


def read_rate(threads: int) -> dict:
    """GB/s of a 256 MiB copy (read + written, and read only) with ``threads`` threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(1 << 28, dtype=torch.uint8)
        y = torch.empty_like(x)
        y.copy_(x)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
        s = min(times)
        return {"threads": threads, "copy_read_gbps": round(x.numel() / s / 1e9, 2),
                "copy_rw_gbps": round(2 * x.numel() / s / 1e9, 2)}
    finally:
        torch.set_num_threads(old)


def model_bytes(model: str, dtype: str) -> tuple[int, int]:
    """(the weights' bytes in ``dtype``, K+V bytes of one token over every layer at 2 bytes an element)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))    # a bf16 checkpoint
    weights *= 2 if dtype == "float32" else 1
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2
    return weights, per_token


def prompts(tokenizer, length: int, n: int) -> list[list[int]]:
    from vllm_ext.quality import tasks as T

    return [T.make_text_sample("niah_single", length, (i + 0.5) / (n + 1), i, tokenizer).prompt_ids
            for i in range(n)]


def counters() -> dict:
    from vllm_ext import metrics

    return metrics.snapshot()


def delta(a: dict, b: dict, key: str) -> float:
    return b.get(key, 0) - a.get(key, 0)


def set_threads(n: int) -> None:
    """``torch.set_num_threads`` as torch defines it (vLLM's CPU worker replaces the public one with a
    no-op after its thread binding; this benchmark binds nothing)."""
    import torch

    torch._C.set_num_threads(n)


def steady(raw: dict, after: int, batch: int) -> dict:
    """Mean and median of the timed steps from ``after`` on, and their slow row-steps."""
    out = {}
    for unit in ("cpu", "wall"):
        xs = raw[f"{unit}_ms"][after:]
        out[f"{unit}_ms_mean"] = round(statistics.mean(xs), 2)
        out[f"{unit}_ms_median"] = round(statistics.median(xs), 2)
    out.update(after=after, steps=len(raw["cpu_ms"]) - after, slow_row_steps=sum(raw["slow_rows"][after:]),
               row_steps=(len(raw["cpu_ms"]) - after) * batch)
    return out


PROFILE_STEPS = 24      # untimed steps after the timed ones, to profile one slow and one fast step


def run_point(eng, ids: list[list[int]], steps: int, threads: int, profile: bool, tag: str) -> dict:
    """Prefill the batch with every core, then time ``steps`` steps in which every row decodes."""
    from vllm import SamplingParams

    all_cores = os.cpu_count() or 1
    # rows that finish their prefill first decode while the others prefill: room for those tokens too
    budget = eng.vllm_config.scheduler_config.max_num_batched_tokens
    extra = PROFILE_STEPS if profile else 0
    sp = SamplingParams(temperature=0, max_tokens=steps + extra + 8 + sum(len(p) for p in ids) // budget + len(ids),
                        ignore_eos=True)
    names = [f"{tag}-{i}" for i in range(len(ids))]
    for name, p in zip(names, ids):
        eng.add_request(name, {"prompt_token_ids": p}, sp)
    set_threads(all_cores)
    started: set[str] = set()
    t0 = time.perf_counter()
    while len(started) < len(ids):
        for o in eng.step():
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
    prefill_wall = time.perf_counter() - t0
    set_threads(threads or all_cores)
    cpu, wall, slow_rows = [], [], []
    before = counters()
    for _ in range(steps):
        c0 = counters()
        w0, t0 = time.perf_counter(), time.thread_time()
        outs = eng.step()
        cpu.append(time.thread_time() - t0)
        wall.append(time.perf_counter() - w0)
        slow_rows.append(delta(c0, counters(), "sfi.slow_steps"))
        if any(o.finished for o in outs):
            raise RuntimeError("a request finished inside the timed steps")
    after = counters()
    # the profiles come from further steps, after the timed ones: cProfile slows every step it
    # watches (by a fifth to a third here), so no timed step runs under it
    prof = {}
    if profile:
        import cProfile

        for _ in range(PROFILE_STEPS):
            c0 = counters()
            p = cProfile.Profile(time.thread_time)
            p.enable()
            eng.step()
            p.disable()
            kind = "slow" if delta(c0, counters(), "sfi.slow_steps") else "fast"
            prof.setdefault(kind, p)
            if len(prof) == 2:
                break
    eng.abort_request(names)
    while eng.has_unfinished_requests():
        eng.step()
    set_threads(all_cores)
    if prof:
        import pstats

        for kind in ("fast", "slow"):
            if kind in prof:
                print(f"--- profile of one {kind} step ({tag}) ---", flush=True)
                pstats.Stats(prof[kind]).sort_stats("tottime").print_stats(25)
                pstats.Stats(prof[kind]).sort_stats("cumulative").print_stats(45)
    return dict(prefill_wall_s=round(prefill_wall, 2), cpu_ms=[round(1e3 * x, 2) for x in cpu],
                wall_ms=[round(1e3 * x, 2) for x in wall], slow_rows=slow_rows,
                fast_row_steps=delta(before, after, "sfi.fast_steps"),
                dense_row_steps=delta(before, after, "sfi.dense_rows"),
                slow_row_steps=delta(before, after, "sfi.slow_steps"),
                fast_retained_tokens=delta(before, after, "sfi.fast_retained_tokens"),
                fast_context_tokens=delta(before, after, "sfi.fast_context_tokens"))


def summarise(raw: dict, batch: int, length: int, weights: int, per_token: int, kv_elem: float,
              quest: bool, slow_reads: float = 1.0) -> dict:
    """Per-step means and the bytes a step reads (module doc). Quest's selection rows read page
    bounds and candidates, counted as their retained tokens only (a lower bound)."""
    steps = len(raw["cpu_ms"])
    row_steps = steps * batch
    ctx = length + steps // 2                            # the rows' mean context while timed
    fast, slow = raw["fast_row_steps"], raw["slow_row_steps"]
    dense = raw["dense_row_steps"] if fast or slow else row_steps
    tok_bytes = per_token * kv_elem / 2
    kv = tok_bytes * (raw["fast_retained_tokens"] + dense * ctx + (0 if quest else slow * ctx * slow_reads))
    step_bytes = weights + kv / steps
    out = {k: v for k, v in raw.items()}
    for unit in ("cpu", "wall"):
        xs = raw[f"{unit}_ms"]
        out[f"{unit}_ms_mean"] = round(statistics.mean(xs), 2)
        out[f"{unit}_ms_median"] = round(statistics.median(xs), 2)
    out.update(batch=batch, length=length, bytes_per_step=int(step_bytes), kv_bytes_per_step=int(kv / steps),
               achieved_gbps_cpu=round(step_bytes / out["cpu_ms_mean"] / 1e6, 2),
               achieved_gbps_wall=round(step_bytes / out["wall_ms_mean"] / 1e6, 2),
               retained_fraction=(round(raw["fast_retained_tokens"] / raw["fast_context_tokens"], 4)
                                  if raw["fast_context_tokens"] else None))
    return out


def run_config(args, name: str, lengths: list[int], batches: list[int], weights: int,
               per_token: int) -> list[dict]:
    import bench_cpu_vllm as B
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    backend, section = B.CONFIGS[name]
    settings = dict(enforce_eager=True, dtype=args.dtype, max_num_seqs=args.max_num_seqs or max(batches),
                    max_model_len=max(lengths) + args.decode_steps + 64, max_num_batched_tokens=4096,
                    block_size=32, kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
                    enable_prefix_caching=True, attention_backend=backend, seed=0,
                    kv_cache_dtype=args.kv_dtype)
    if section:
        settings["additional_config"] = {"speedsfi": section}
    llm = LLM(model=args.model, **settings)
    eng = llm.llm_engine
    kv_elem = 1.0 if args.kv_dtype.startswith("fp8") else 4.0 if args.dtype == "float32" else 2.0
    from vllm_ext.kernels import cpu_native

    slow_reads = 1.0 if cpu_native.library() is not None else 1.5
    rows = []
    try:
        for length in lengths:
            ids = prompts(llm.get_tokenizer(), length, max(batches))
            for batch in sorted(batches, reverse=True):
                profile = args.profile == name and length == max(lengths) and batch == max(batches)
                raw = run_point(eng, ids[:batch], args.decode_steps, args.threads, profile,
                                f"{name}-{length}-{batch}")
                row = dict(config=name, **summarise(raw, batch, length, weights, per_token, kv_elem,
                                                         quest=name.startswith("quest"), slow_reads=slow_reads))
                if 0 < args.steady_after < args.decode_steps:
                    row["steady"] = steady(raw, args.steady_after, batch)
                print(f"[bench] {name:13s} L={length:5d} B={batch:2d}  cpu mean {row['cpu_ms_mean']:7.1f} ms "
                      f"median {row['cpu_ms_median']:7.1f}  wall mean {row['wall_ms_mean']:7.1f}  "
                      f"slow row-steps {row['slow_row_steps']:4.0f}  {row['achieved_gbps_cpu']:.2f} GB/s "
                      f"(prefill {row['prefill_wall_s']:.0f} s)", flush=True)
                rows.append(row)
    finally:
        eng.engine_core.shutdown()
        del llm, eng
        cleanup_dist_env_and_memory()
    return rows


def commit() -> str:
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain", "--",
                                                                                      "vllm_ext", "csrc") else "")


def plot(rows: list[dict], path: Path, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.8), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for cfg in dict.fromkeys(r["config"] for r in rows):
            pts = sorted((r["batch"], r[f"{unit}_ms_mean"]) for r in rows
                         if r["config"] == cfg and r["length"] == length)
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=cfg)
        ax.set_title(f"{length} prompt tokens")
        ax.set_xlabel("requests decoding together")
        ax.set_ylabel(f"mean decode step, ms ({unit})")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse(argv)
    import platform

    import torch

    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    weights, per_token = model_bytes(args.model, args.dtype)
    rates = [read_rate(1), read_rate(os.cpu_count() or 1)]
    print(f"[bench] read rate {rates}", flush=True)
    unit = "cpu" if args.threads == 1 else "wall"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    name = args.name or f"cpu_decode_batch_{args.dtype}_{'1thread' if args.threads == 1 else 'cores'}" + (
        "" if args.kv_dtype == "auto" else f"_{args.kv_dtype}")
    payload = dict(
        env={"gpu": "none (CPU build)", "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
             "isa": torch.backends.cpu.get_cpu_capability(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")},
        command="python bench/bench_cpu_decode_batch.py " + " ".join(sys.argv[1:] if argv is None else argv),
        note=args.note, commit=commit(), dtype=args.dtype, unit=unit, threads=args.threads, kv_cache_dtype=args.kv_dtype,
        weights_bytes=weights, kv_bytes_per_token=per_token, read_rate=rates, rows=[])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = payload["rows"]
    for config in args.configs.split(","):
        rows += run_config(args, config, lengths, batches, weights, per_token)
        base = {(r["length"], r["batch"]): r for r in rows if r["config"] == "cpu_attn"}
        for r in rows:
            b = base.get((r["length"], r["batch"]))
            if b:
                r["speedup_vs_cpu_attn"] = round(b[f"{unit}_ms_mean"] / r[f"{unit}_ms_mean"], 3)
        (out / f"{name}.json").write_text(json.dumps(payload, indent=1))     # after each config: kept if cut
    plot(rows, out / f"{name}.png", unit)
    print(f"[bench] wrote {out / name}.json and .png", flush=True)
    for r in rows:
        print(f"{r['config']:13s} L={r['length']:5d} B={r['batch']:2d} {unit} mean {r[f'{unit}_ms_mean']:8.1f} "
              f"median {r[f'{unit}_ms_median']:8.1f}  x{r.get('speedup_vs_cpu_attn', float('nan')):.2f}  "
              f"slow {r['slow_row_steps']:.0f}  {r[f'achieved_gbps_{unit}']:.2f} GB/s")


if __name__ == "__main__":
    main()
