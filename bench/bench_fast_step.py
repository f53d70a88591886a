#!/usr/bin/env python3
"""(a) SFI fast-step speed-up over dense paged decode vs retained fraction, (b) context sweep.

    python bench/bench_fast_step.py --out bench/results          # CUDA
    python bench/bench_fast_step.py --out /tmp/b --smoke         # CPU, tiny, PyTorch twins

One attention layer, batch 16, 32 query / 8 KV heads, head 128, bf16, page 16 (vLLM NHD layout,
pages shuffled). Dense = our split-K paged decode over all ``ctx`` positions. Fast step =
``two_segment_decode`` over the compact segment (sink + selected, built by ``gather_compact``) and
the recent window read in place.

(a) ctx 16K, retained fraction 1.6 .. 100 %: recent window min(256, retained), sink 4, the rest
    selected. Anchor: SFI paper kernel table, 10.67x @ 1.6 %, 3.96x @ 25 %, 2.10x @ 50 %,
    1.10x @ 98.4 % (DESIGN.md target 7.2x @ 12.5 %).
(b) ctx 8K .. 128K at the SFI default budget (sink 4 + K 2048 + recent 256 = 2308 tokens).

Times are CUDA-graph replays (``ms``; eager ``ms_eager`` beside them); GB/s = KV bytes read / time.
Every point also times the fast step with the compact segment paged as vLLM holds it (SFI's own
KV-cache group, read through a per-slot block table: ``sparse_paged_ms``, and
``paged_over_contiguous``, the check that paging costs under 5 %).
Writes ``fast_step.json``, ``fast_step_retention.png``, ``fast_step_context.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (BASELINE_NOTE, DecodeProblem, copy_bandwidth, device_for, env_info, gbps,  # noqa: E402
                    paged_compact, parse_args, plot, split_budget, time_op, write_json)

PAPER_KERNEL_SPEEDUP = {"1.6": 10.67, "25": 3.96, "50": 2.10, "98.4": 1.10}
DESIGN_TARGET = {"1.6": 10.7, "12.5": 7.2, "25": 4.0, "50": 2.1}
FRACTIONS = [1.6, 3.1, 6.25, 12.5, 25.0, 50.0, 100.0]


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(batch=2, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32, ctx_a=512,
                    ctxs_b=[256, 512], k=32, n_recent=16, n_sink=4, split_grid=[1, 2])
    return dict(batch=16, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, ctx_a=16384,
                ctxs_b=[8192, 16384, 32768, 65536, 131072], k=2048, n_recent=256, n_sink=4,
                split_grid=[1, 2, 4, 8])


def measure_point(prob: DecodeProblem, sink: int, sel: int, recent: int, split_grid, dense_t):
    from vllm_ext.kernels.two_segment_decode import (two_segment_decode, two_segment_num_splits,
                                                     two_segment_workspace)
    st = prob.sfi_state(n_sink=sink, n_sel=sel, n_recent=recent)
    dev = prob.device
    default = two_segment_num_splits(prob.batch, prob.hkv, st["compact_kv"].shape[2] + recent,
                                     dev)
    ws = two_segment_workspace(prob.batch, prob.hq, prob.d, max(split_grid + [default]), dev)
    out = torch.empty_like(prob.query)

    def run(ns):
        return lambda: two_segment_decode(prob.query, prob.kv_cache, prob.block_table,
                                          prob.seq_lens, st["recent_start"], st["compact_kv"],
                                          st["compact_len"], st["slot_idx"], prob.scale, out,
                                          num_splits=ns, max_recent=recent, workspace=ws)
    t_default = time_op(run(default), dev)
    pages, table = paged_compact(st["compact_kv"], prob.block_size)
    out_paged = torch.empty_like(prob.query)
    t_paged = time_op(lambda: two_segment_decode(
        prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, st["recent_start"], pages,
        st["compact_len"], st["slot_idx"], prob.scale, out_paged, num_splits=default, max_recent=recent,
        workspace=ws, compact_table=table), dev)
    by_split = {}
    for ns in split_grid:
        by_split[str(ns)] = time_op(run(ns), dev)["ms"]
    best_ns = min(by_split, key=by_split.get)
    retained = sink + sel + recent
    nbytes = prob.kv_bytes(retained)
    res = dict(retained_tokens=retained, sink=sink, selected=sel, recent=recent,
               retained_pct=100.0 * retained / prob.ctx,
               sparse_ms=t_default["ms"], sparse_ms_eager=t_default["ms_eager"],
               sparse_paged_ms=t_paged["ms"], paged_over_contiguous=t_paged["ms"] / t_default["ms"],
               sparse_num_splits=default, sparse_ms_by_splits=by_split,
               sparse_best_ms=by_split[best_ns], sparse_best_splits=int(best_ns),
               sparse_kv_bytes=nbytes, sparse_gbps=gbps(nbytes, t_default["ms"]),
               dense_ms=dense_t["ms"], dense_ms_eager=dense_t["ms_eager"],
               speedup=dense_t["ms"] / t_default["ms"],
               speedup_best_splits=dense_t["ms"] / by_split[best_ns],
               speedup_eager=dense_t["ms_eager"] / t_default["ms_eager"])
    run(default)()
    res["paged_max_abs_diff"] = float((out_paged.float() - out.float()).abs().max())
    return res, out, st


def dense_time(prob: DecodeProblem):
    from vllm_ext.kernels.dense_decode_evidence import (dense_decode_workspace, paged_decode)
    from vllm_ext.kernels.two_segment_decode import dense_num_splits
    ns = dense_num_splits(prob.batch, prob.hkv, prob.ctx, prob.device)
    ws = dense_decode_workspace(prob.batch, prob.hq, prob.d, ns, prob.device)
    out = torch.empty_like(prob.query)
    fn = lambda: paged_decode(prob.query, prob.kv_cache, prob.block_table, prob.seq_lens,  # noqa: E731
                              prob.scale, out, num_splits=ns, workspace=ws)
    t = time_op(fn, prob.device)
    fn()
    nbytes = prob.kv_bytes(prob.ctx)
    t.update(num_splits=ns, kv_bytes=nbytes, gbps=gbps(nbytes, t["ms"]))
    return t, out


def main(argv=None):
    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    sh = shapes(args.smoke)
    env = env_info(dev)
    bw = copy_bandwidth(dev)
    common = dict(batch=sh["batch"], q_heads=sh["hq"], kv_heads=sh["hkv"], head_size=sh["d"],
                  block_size=sh["block_size"], dtype=str(sh["dtype"]), layout="NHD (LBNHC view)")

    # (a) retention sweep
    prob = DecodeProblem(batch=sh["batch"], ctx=sh["ctx_a"], hq=sh["hq"], hkv=sh["hkv"],
                         d=sh["d"], block_size=sh["block_size"], dtype=sh["dtype"], device=dev)
    dense_t, dense_out = dense_time(prob)
    ret_rows = []
    for frac in FRACTIONS:
        retained = max(1, round(prob.ctx * frac / 100.0))
        sink, sel, recent = split_budget(prob.ctx, retained, sh["n_sink"], sh["n_recent"])
        row, out, _ = measure_point(prob, sink, sel, recent, sh["split_grid"], dense_t)
        row["fraction_pct"] = frac
        if sink + sel + recent >= prob.ctx:      # full retention: must equal dense attention
            row["max_abs_err_vs_dense"] = float((out.float() - dense_out.float()).abs().max())
        ret_rows.append(row)
        print(f"[a] {frac:6.2f}% retained={row['retained_tokens']:6d} "
              f"sparse {row['sparse_ms'] * 1e3:8.1f} us ({row['sparse_gbps']:.0f} GB/s) "
              f"dense {dense_t['ms'] * 1e3:8.1f} us  speed-up {row['speedup']:.2f}x "
              f"(best splits {row['speedup_best_splits']:.2f}x); paged compact "
              f"{row['paged_over_contiguous']:.3f}x the contiguous time", flush=True)
    del prob
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # (b) context sweep at the default budget
    ctx_rows = []
    for ctx in sh["ctxs_b"]:
        prob = DecodeProblem(batch=sh["batch"], ctx=ctx, hq=sh["hq"], hkv=sh["hkv"], d=sh["d"],
                             block_size=sh["block_size"], dtype=sh["dtype"], device=dev)
        dt, _ = dense_time(prob)
        sink, sel, recent = split_budget(ctx, sh["n_sink"] + sh["k"] + sh["n_recent"],
                                         sh["n_sink"], sh["n_recent"])
        row, _, _ = measure_point(prob, sink, sel, recent, sh["split_grid"], dt)
        row.update(ctx=ctx, dense_gbps=dt["gbps"], dense_num_splits=dt["num_splits"],
                   dense_fraction_of_copy_bw=dt["gbps"] / bw["copy_gbps_rw"])
        ctx_rows.append(row)
        print(f"[b] ctx {ctx:6d}: dense {dt['ms'] * 1e3:8.1f} us ({dt['gbps']:.0f} GB/s) "
              f"sparse {row['sparse_ms'] * 1e3:7.1f} us  speed-up {row['speedup']:.2f}x", flush=True)
        del prob
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    payload = dict(
        bench="fast_step", env=env, smoke=args.smoke, baseline=BASELINE_NOTE, shapes=common,
        timing="CUDA-graph replay median (ms); ms_eager = triton do_bench eager median",
        copy_bandwidth=bw,
        retention_sweep=dict(ctx=sh["ctx_a"], dense=dense_t, rows=ret_rows,
                             anchor_paper_kernel_speedup=PAPER_KERNEL_SPEEDUP,
                             design_target_speedup=DESIGN_TARGET),
        context_sweep=dict(budget=dict(sink=sh["n_sink"], k=sh["k"], recent=sh["n_recent"]),
                           rows=ctx_rows))
    write_json(args.out, "fast_step", payload)
    plot(args.out, "fast_step_retention",
         f"SFI fast step vs dense, ctx {sh['ctx_a']}, B{sh['batch']} ({env['gpu']})",
         "retained fraction (%)", "speed-up over dense (x)",
         {"two_segment (default splits)": ([r["fraction_pct"] for r in ret_rows],
                                           [r["speedup"] for r in ret_rows]),
          "two_segment (best splits)": ([r["fraction_pct"] for r in ret_rows],
                                        [r["speedup_best_splits"] for r in ret_rows])},
         logx=True, logy=True,
         anchors={"SFI paper": ([float(k) for k in PAPER_KERNEL_SPEEDUP],
                                list(PAPER_KERNEL_SPEEDUP.values()))})
    plot(args.out, "fast_step_context",
         f"SFI fast step (budget {sh['n_sink'] + sh['k'] + sh['n_recent']}) vs dense ({env['gpu']})",
         "context (tokens)", "time per layer (us)",
         {"dense paged decode": ([r["ctx"] for r in ctx_rows], [r["dense_ms"] * 1e3 for r in ctx_rows]),
          "SFI fast step": ([r["ctx"] for r in ctx_rows], [r["sparse_ms"] * 1e3 for r in ctx_rows])},
         logx=True, logy=True)
    return payload


if __name__ == "__main__":
    main()
