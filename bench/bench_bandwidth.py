#!/usr/bin/env python3
"""(c) Achieved bandwidth of every SFI decode kernel vs the measured copy bandwidth.

    python bench/bench_bandwidth.py --out bench/results          # CUDA
    python bench/bench_bandwidth.py --out /tmp/b --smoke         # CPU, tiny, PyTorch twins

Physics of decode: the floor of a kernel is the bytes it must move divided by the measured
bandwidth of a ``torch`` copy of a 1 GiB tensor (bytes read + written per second). For every kernel
this reports time (CUDA-graph replay), bytes, achieved GB/s and ``fraction_of_floor`` =
floor time / measured time (1.0 = as fast as a copy moving the same bytes).

Kernels (batch 16, 32/8 heads, head 128, bf16, page 16): dense ``paged_decode`` at 16K and 64K,
``two_segment_decode`` at the SFI budget (2308 tokens) and at 50 % of 16K,
``dense_decode_with_evidence`` at 16K (bytes: KV + score scratch written and read + evidence
written), ``gather_compact`` (2052 entries per row and KV head read + written) and
``merge_states`` (16 partial states). Writes ``bandwidth.json`` and ``bandwidth.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (BASELINE_NOTE, DecodeProblem, copy_bandwidth, device_for, env_info, gbps,  # noqa: E402
                    bar_plot, parse_args, time_op, write_json)


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(batch=2, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32,
                    ctxs=[256, 512], k=32, n_recent=16, n_sink=4)
    return dict(batch=16, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16,
                ctxs=[16384, 65536], k=2048, n_recent=256, n_sink=4)


def main(argv=None):
    from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence,
                                                        dense_decode_workspace, paged_decode)
    from vllm_ext.kernels.gather_compact import gather_compact
    from vllm_ext.kernels.merge_state import merge_states
    from vllm_ext.kernels.two_segment_decode import (dense_num_splits, two_segment_decode,
                                                     two_segment_num_splits,
                                                     two_segment_workspace)

    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    sh = shapes(args.smoke)
    env = env_info(dev)
    bw = copy_bandwidth(dev)
    rate = bw["copy_gbps_rw"]
    rows = []

    def record(name, nbytes, t, **extra):
        floor_ms = nbytes / rate / 1e6
        row = dict(kernel=name, bytes=int(nbytes), ms=t["ms"], ms_eager=t["ms_eager"],
                   gbps=gbps(nbytes, t["ms"]), floor_ms=floor_ms, fraction_of_floor=floor_ms / t["ms"],
                   **extra)
        rows.append(row)
        print(f"[c] {name:38s} {t['ms'] * 1e3:9.1f} us  {row['gbps']:7.0f} GB/s  "
              f"{100 * row['fraction_of_floor']:5.1f}% of copy floor", flush=True)

    for i, ctx in enumerate(sh["ctxs"]):
        prob = DecodeProblem(batch=sh["batch"], ctx=ctx, hq=sh["hq"], hkv=sh["hkv"], d=sh["d"],
                             block_size=sh["block_size"], dtype=sh["dtype"], device=dev)
        b, hq, d, hkv = prob.batch, prob.hq, prob.d, prob.hkv
        esz = prob.query.element_size()
        qo_bytes = 2 * b * hq * d * esz
        ns = dense_num_splits(b, hkv, ctx, dev)
        ws = dense_decode_workspace(b, hq, d, ns, dev, max_len=ctx)
        out = torch.empty_like(prob.query)
        t = time_op(lambda: paged_decode(prob.query, prob.kv_cache, prob.block_table, prob.seq_lens,
                                         prob.scale, out, num_splits=ns, workspace=ws), dev)
        record(f"paged_decode ctx={ctx}", prob.kv_bytes(ctx) + qo_bytes, t, ctx=ctx, num_splits=ns)

        budget = sh["n_sink"] + sh["k"] + sh["n_recent"]
        plans = [("SFI budget", sh["n_sink"], sh["k"], sh["n_recent"])]
        if i == 0:
            plans.append(("50%", sh["n_sink"], ctx // 2 - sh["n_sink"] - sh["n_recent"], sh["n_recent"]))
        for label, sink, sel, rec in plans:
            st = prob.sfi_state(n_sink=sink, n_sel=sel, n_recent=rec)
            ns2 = two_segment_num_splits(b, hkv, sink + sel + rec, dev)
            ws2 = two_segment_workspace(b, hq, d, ns2, dev)
            t = time_op(lambda: two_segment_decode(
                prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, st["recent_start"],
                st["compact_kv"], st["compact_len"], st["slot_idx"], prob.scale, out,
                num_splits=ns2, max_recent=rec, workspace=ws2), dev)
            record(f"two_segment_decode ctx={ctx} {label}", prob.kv_bytes(sink + sel + rec) + qo_bytes,
                   t, ctx=ctx, retained=sink + sel + rec, num_splits=ns2)
            if label == "SFI budget":
                # gather_compact: read + write every compact entry
                cap = st["compact_kv"].shape[2]
                t = time_op(lambda: gather_compact(prob.kv_cache, prob.block_table, st["slot_idx"],
                                                   st["selected"], st["n_sel"], sink,
                                                   st["compact_kv"], st["compact_len"],
                                                   seq_lens=prob.seq_lens), dev)
                record(f"gather_compact ctx={ctx} entries={cap}", 2 * prob.kv_bytes(cap), t,
                       ctx=ctx, entries=cap)
            del st

        if i == 0:
            ev = torch.empty(b, hkv, ctx, dtype=torch.float32, device=dev)
            lo = torch.full((b,), sh["n_sink"], dtype=torch.int32, device=dev)
            hi = prob.seq_lens - sh["n_recent"]
            t = time_op(lambda: dense_decode_with_evidence(
                prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, lo, hi, prob.scale,
                out, ev, num_splits=ns, workspace=ws), dev)
            scratch = 2 * b * hq * ctx * 4 + b * hkv * ctx * 4
            record(f"dense_decode_with_evidence ctx={ctx}", prob.kv_bytes(ctx) + qo_bytes + scratch,
                   t, ctx=ctx, num_splits=ns, kv_only_fraction_of_floor=(
                       (prob.kv_bytes(ctx) + qo_bytes) / rate / 1e6) / t["ms"])
            # merge of 16 fp32 partial states
            v = torch.randn(b, 16, hq, d, device=dev)
            s = torch.randn(b, 16, hq, device=dev)
            mo = torch.empty(b, hq, d, dtype=prob.dtype, device=dev)
            ml = torch.empty(b, hq, device=dev)
            t = time_op(lambda: merge_states(v, s, out=mo, out_lse=ml), dev)
            record("merge_states 16 states", v.numel() * 4 + s.numel() * 4 + mo.numel() * esz
                   + ml.numel() * 4, t)
        del prob, ws
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    payload = dict(bench="bandwidth", env=env, smoke=args.smoke, baseline=BASELINE_NOTE,
                   copy_bandwidth=bw, floor="bytes / copy_gbps_rw (torch copy of 1 GiB, read+write)",
                   timing="CUDA-graph replay median", rows=rows)
    write_json(args.out, "bandwidth", payload)
    bar_plot(args.out, "bandwidth", f"decode kernels vs copy bandwidth ({env['gpu']})",
             [r["kernel"] for r in rows], [r["fraction_of_floor"] for r in rows],
             "fraction of the copy floor (floor time / time)", ref=1.0)
    return payload


if __name__ == "__main__":
    main()
