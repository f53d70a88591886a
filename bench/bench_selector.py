#!/usr/bin/env python3
"""(e) Slow-step maintenance per layer: evidence, selector and gather time.

    python bench/bench_selector.py --out bench/results          # CUDA
    python bench/bench_selector.py --out /tmp/b --smoke         # CPU, tiny, PyTorch twins

Per layer, batch 16, 8 KV heads (32 query heads), head 128, bf16, page 16, K = 2048, ctx 16K..128K:

- ``dense_decode`` / ``dense_with_evidence``: the slow step's attention without / with the evidence
  (the difference is the evidence's cost on the main stream);
- ``selector``: ``vllm_ext.kernels.sfi_selector.select`` on the pooled log-evidence
  ``[B, Hkv, ctx]`` and key norms (skipped, with the reason in the JSON, when that module is absent);
  ``selector_span4``: the same with ``sfi.select_span = 4`` (bench/QUALITY.md);
- ``gather``: ``gather_compact`` of sink + 2048 selected entries per (row, KV head).

``maintenance_ms`` = selector + gather (what the side stream runs per layer);
``slow_step_overhead_ms`` = evidence extra + selector + gather. Writes ``selector.json`` /
``selector.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (BASELINE_NOTE, DecodeProblem, device_for, env_info, parse_args, plot,  # noqa: E402
                    time_op, write_json)


SPAN = 4                               # sfi.select_span timed beside the paper's selector


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(batch=2, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32,
                    ctxs=[256, 512], k=32, n_recent=16, n_sink=4)
    return dict(batch=16, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16,
                ctxs=[16384, 32768, 65536, 131072], k=2048, n_recent=256, n_sink=4)


def load_selector():
    try:
        from vllm_ext.config import SfiConfig
        from vllm_ext.kernels import sfi_selector
    except Exception as exc:
        return None, None, f"vllm_ext.kernels.sfi_selector not importable: {type(exc).__name__}: {exc}"
    if not hasattr(sfi_selector, "select"):
        return None, None, "vllm_ext.kernels.sfi_selector has no select()"
    return sfi_selector.select, SfiConfig, None


def main(argv=None):
    from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence,
                                                        dense_decode_workspace, paged_decode)
    from vllm_ext.kernels.gather_compact import gather_compact
    from vllm_ext.kernels.two_segment_decode import dense_num_splits

    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    sh = shapes(args.smoke)
    env = env_info(dev)
    select, SfiConfig, why = load_selector()
    rows = []
    for ctx in sh["ctxs"]:
        prob = DecodeProblem(batch=sh["batch"], ctx=ctx, hq=sh["hq"], hkv=sh["hkv"], d=sh["d"],
                             block_size=sh["block_size"], dtype=sh["dtype"], device=dev)
        b, hkv = prob.batch, prob.hkv
        ns = dense_num_splits(b, hkv, ctx, dev)
        ws = dense_decode_workspace(b, prob.hq, prob.d, ns, dev, max_len=ctx)
        out = torch.empty_like(prob.query)
        ev = torch.empty(b, hkv, ctx, dtype=torch.float32, device=dev)
        lo = torch.full((b,), sh["n_sink"], dtype=torch.int32, device=dev)
        hi = prob.seq_lens - sh["n_recent"]
        row = dict(ctx=ctx)
        row["dense_ms"] = time_op(lambda: paged_decode(
            prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, prob.scale, out,
            num_splits=ns, workspace=ws), dev)["ms"]
        row["dense_with_evidence_ms"] = time_op(lambda: dense_decode_with_evidence(
            prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, lo, hi, prob.scale, out,
            ev, num_splits=ns, workspace=ws), dev)["ms"]
        row["evidence_extra_ms"] = row["dense_with_evidence_ms"] - row["dense_ms"]

        sel = torch.full((b, hkv, sh["k"]), -1, dtype=torch.int32, device=dev)
        n_sel = torch.full((b,), sh["k"], dtype=torch.int32, device=dev)
        if select is not None:
            cfg = SfiConfig(k=sh["k"])
            key_norms = torch.linalg.vector_norm(prob.kv_cache[..., :prob.d], dim=-1,
                                                dtype=torch.float32)         # [nb, H, bs]
            kn = key_norms[prob.block_table.long()].permute(0, 2, 1, 3).reshape(b, hkv, -1)[..., :ctx]
            kn = kn.contiguous()
            res = {}

            def run_select():
                res["out"] = select(ev, kn, lo, hi, cfg, sh["k"])
            try:
                t = time_op(run_select, dev)
                row["selector_ms"] = t["ms"]
                row["selector_ms_eager"] = t["ms_eager"]
                if "graph_error" in t:
                    row["selector_graph_error"] = t["graph_error"]
                s_out, s_n = res["out"]
                sel[:, :, :s_out.shape[-1]] = s_out[..., :sh["k"]]
                n_sel.copy_(s_n)
            except Exception as exc:   # report, keep the rest of the bench
                row["selector_error"] = f"{type(exc).__name__}: {exc}"[:400]
            if "selector_ms" in row:       # the opt-in select_span: its extra top-K loads
                span_cfg = SfiConfig(k=sh["k"], select_span=SPAN)
                try:
                    row[f"selector_span{SPAN}_ms"] = time_op(
                        lambda: select(ev, kn, lo, hi, span_cfg, sh["k"]), dev)["ms"]
                except Exception as exc:
                    row["selector_span_error"] = f"{type(exc).__name__}: {exc}"[:400]
        if "selector_ms" not in row:
            # random selection for the gather timing
            g = torch.Generator(device="cpu").manual_seed(0)
            for r in range(b):
                for h in range(hkv):
                    p = torch.randperm(ctx - sh["n_recent"] - sh["n_sink"], generator=g)[:sh["k"]]
                    sel[r, h] = (p.sort().values + sh["n_sink"]).to(torch.int32).to(dev)
        cap = sh["n_sink"] + sh["k"]
        compact = torch.empty(b, hkv, cap, 2 * prob.d, dtype=prob.dtype, device=dev)
        clen = torch.zeros(b, dtype=torch.int32, device=dev)
        slot = torch.arange(b, dtype=torch.int32, device=dev)
        row["gather_ms"] = time_op(lambda: gather_compact(
            prob.kv_cache, prob.block_table, slot, sel, n_sel, sh["n_sink"], compact, clen,
            seq_lens=prob.seq_lens), dev)["ms"]
        if "selector_ms" in row:
            row["maintenance_ms"] = row["selector_ms"] + row["gather_ms"]
            row["slow_step_overhead_ms"] = row["evidence_extra_ms"] + row["maintenance_ms"]
        rows.append(row)
        print(f"[e] ctx {ctx:6d}: " + "  ".join(f"{k}={v:.4f}" for k, v in row.items()
                                                if isinstance(v, float)), flush=True)
        del prob, ws, ev
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    payload = dict(bench="selector", env=env, smoke=args.smoke, baseline=BASELINE_NOTE,
                   selector_available=select is not None, selector_skip_reason=why,
                   shapes=dict(batch=sh["batch"], q_heads=sh["hq"], kv_heads=sh["hkv"],
                               head_size=sh["d"], k=sh["k"], dtype=str(sh["dtype"])),
                   timing="CUDA-graph replay median, per layer", rows=rows)
    write_json(args.out, "selector", payload)
    series = {"gather_compact": ([r["ctx"] for r in rows], [r["gather_ms"] * 1e3 for r in rows]),
              "evidence extra": ([r["ctx"] for r in rows],
                                 [max(r["evidence_extra_ms"], 1e-6) * 1e3 for r in rows]),
              "dense decode": ([r["ctx"] for r in rows], [r["dense_ms"] * 1e3 for r in rows])}
    if all("selector_ms" in r for r in rows):
        series["selector"] = ([r["ctx"] for r in rows], [r["selector_ms"] * 1e3 for r in rows])
    plot(args.out, "selector", f"slow-step maintenance per layer ({env['gpu']})", "context (tokens)",
         "time per layer (us)", series, logx=True, logy=True)
    return payload


if __name__ == "__main__":
    main()
