#!/usr/bin/env python3
"""CritiPrefill block-sparse prefill vs a dense FlashAttention-class prefill, one attention layer.

    python bench/bench_critiprefill.py --out bench/results/critiprefill            # CUDA, 16K..128K
    python bench/bench_critiprefill.py --out /tmp/cp --smoke                        # CPU, tiny, torch twins

One request, one layer, single-chunk prefill of ``n`` tokens (Llama-3-8B head shape by default:
32 query heads, 8 KV heads, head size 128, bf16), K/V in a vLLM-style paged cache (page size 16,
pages shuffled). Timed (CUDA events, median):

- ``dense_sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` restricted to
  ``SDPBackend.FLASH_ATTENTION`` on contiguous Q/K/V (FlashAttention-2 inside PyTorch; the GPU machine
  has no ``flash_attn``/FlashInfer package). This baseline does not pay for paging: it is the
  "FlashAttention-class" dense prefill the ≥3x target is measured against.
- ``dense_ours``: our block-sparse kernel with an all-dense plan (paged, same code path) for reference.
- ``critiprefill``: ``build_plan`` (block representatives + criticality + top-k, all on the device)
  plus ``block_sparse_prefill``; reported separately and as a total. ``speedup = dense_sdpa / total``.

Writes ``critiprefill_bench.json`` and ``critiprefill_bench.png`` into ``--out`` with the device name.
``--smoke`` runs tiny sizes on the CPU with the PyTorch twins (dense baseline: SDPA's CPU kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (JSON + PNG)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU with the torch twins")
    p.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 16K,32K,64K,128K)")
    p.add_argument("--hq", type=int, default=None)
    p.add_argument("--hkv", type=int, default=None)
    p.add_argument("--head-size", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    p.add_argument("--segment-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--score", default="code", choices=["paper", "code"])
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--no-dense-ours", action="store_true", help="skip the all-dense run of our kernel")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of the plan (last length)")
    p.add_argument("--block-n", type=int, default=64, help="keys per inner step of the Triton kernel")
    p.add_argument("--tile-rows", type=int, default=128, help="query rows (queries x group heads) per program")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.smoke:
        os.environ["SPEEDSFI_FORCE_TORCH_KERNELS"] = "1"      # the PyTorch twins (read at call time)
    import torch

    from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
    from vllm_ext.methods.critiprefill.criticality import LayerFusion
    from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan
    from vllm_ext.kernels import block_sparse_prefill as bsp

    smoke = args.smoke
    if smoke:
        block_sparse_prefill = bsp.block_sparse_prefill
    else:
        def block_sparse_prefill(*a, **kw):
            return bsp.block_sparse_prefill_triton(*a, block_n=args.block_n, tile_rows=args.tile_rows, **kw)
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU smoke mode")
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("fp32" if smoke else "bf16")]
    hq = args.hq or (4 if smoke else 32)
    hkv = args.hkv or (2 if smoke else 8)
    d = args.head_size or (64 if smoke else 128)
    page = args.page_size
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
               ([512, 1024] if smoke else [16384, 32768, 65536, 131072]))
    cfg = CritiPrefillConfig(
        enabled=True,
        segment_size=args.segment_size or (128 if smoke else 512),
        block_size=args.block_size or 32,
        budget=args.budget or (128 if smoke else 1024),
        score=args.score, min_len=0, dense_layers=())
    cfg.validate()
    iters = args.iters or (2 if smoke else 5)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    scale = 1.0 / math.sqrt(d)

    def timeit(fn):
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(iters):
            if smoke:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            else:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.MATH if smoke else SDPBackend.FLASH_ATTENTION
    dense_name = ("torch SDPA, SDPBackend.MATH (CPU smoke)" if smoke else
                  "torch.nn.functional.scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION "
                  "(FlashAttention-2 in PyTorch), contiguous Q/K/V, causal")

    rows = []
    for n in lengths:
        g = torch.Generator(device="cpu").manual_seed(n)
        n_pages = -(-n // page)
        perm = torch.randperm(n_pages, generator=g)
        block_table = perm.to(torch.int32)[None].to(dev)
        k = torch.randn(n, hkv, d, generator=g).to(dtype).to(dev)
        v = torch.randn(n, hkv, d, generator=g).to(dtype).to(dev)
        q = torch.randn(n, hq, d, generator=g).to(dtype).to(dev)
        kv = torch.zeros(n_pages, page, hkv, 2 * d, dtype=dtype, device=dev)          # physical [B, N, H, 2D]
        pad = n_pages * page - n
        kp = torch.cat([k, k.new_zeros(pad, hkv, d)]).view(n_pages, page, hkv, d)
        vp = torch.cat([v, v.new_zeros(pad, hkv, d)]).view(n_pages, page, hkv, d)
        kv[perm.to(dev), :, :, :d] = kp                                              # logical page i -> perm[i]
        kv[perm.to(dev), :, :, d:] = vp
        kv_cache = kv.transpose(1, 2)                                                 # logical [B, H, N, 2D]
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        seq = torch.tensor([n], dtype=torch.int32, device=dev)

        # dense SDPA baseline (contiguous)
        qs = q.transpose(0, 1)[None]
        ks = k.transpose(0, 1)[None]
        vs = v.transpose(0, 1)[None]
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qs[..., :16, :], ks[..., :16, :], vs[..., :16, :],
                                                                 is_causal=True, enable_gqa=True)
            gqa_kw, ks2, vs2, gqa_mode = {"enable_gqa": True}, ks, vs, "enable_gqa"
        except RuntimeError:
            ks2 = ks.repeat_interleave(hq // hkv, dim=1)
            vs2 = vs.repeat_interleave(hq // hkv, dim=1)
            gqa_kw, gqa_mode = {}, "K/V repeated to Hq outside the timing"

        def run_dense():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks2, vs2, is_causal=True, **gqa_kw)

        t_dense = timeit(run_dense)
        ref = run_dense()[0].transpose(0, 1)                                          # [n, Hq, D]

        out = torch.empty_like(q)
        dp = dense_plan(qsl, seq, hkv, cfg, num_tokens=n)
        t_dense_ours = None
        if not args.no_dense_ours:
            t_dense_ours = timeit(lambda: block_sparse_prefill(q, kv_cache, block_table, qsl, seq, dp, scale,
                                                               output=out))
            err_dense_ours = (out.float() - ref.float()).abs().max().item()
        else:
            err_dense_ours = None

        def plan_fn():
            return build_plan(q, kv_cache, block_table, qsl, seq, cfg, layer_idx=1, fusion=LayerFusion(),
                              max_seq_len=n, max_query_len=n)

        plan = plan_fn()
        t_plan = timeit(plan_fn)
        t_sparse = timeit(lambda: block_sparse_prefill(q, kv_cache, block_table, qsl, seq, plan, scale,
                                                       output=out))

        def total_fn():
            p = plan_fn()
            block_sparse_prefill(q, kv_cache, block_table, qsl, seq, p, scale, output=out)

        t_total = timeit(total_fn)
        if args.profile and n == lengths[-1]:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
            with profile(activities=acts) as prof:
                total_fn()
                if not smoke:
                    torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total" if smoke else "self_cuda_time_total",
                                            row_limit=25))
        live = plan.num_sel[0, :plan.num_segments[0].item()].float()
        dense_rows = plan.dense[0, :plan.num_segments[0].item()]
        keys_sparse = (live.mean(-1) * cfg.block_size).tolist()
        # fraction of the causal attention work (query x key pairs) that the sparse plan computes
        sq = cfg.segment_size
        work_dense = n * (n + 1) / 2
        work = 0.0
        for j in range(len(keys_sparse)):
            s0, s1 = j * sq, min(n, (j + 1) * sq)
            m = s1 - s0
            before = s0 if dense_rows[j] else keys_sparse[j]
            work += m * before + m * (m + 1) / 2
        row = dict(n=n, dense_sdpa_ms=t_dense, dense_ours_ms=t_dense_ours, plan_ms=t_plan, sparse_kernel_ms=t_sparse,
                   critiprefill_ms=t_total, speedup_vs_sdpa=t_dense / t_total,
                   speedup_kernel_only=t_dense / t_sparse, attended_fraction=work / work_dense,
                   max_abs_err_dense_ours_vs_sdpa=err_dense_ours)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv, kv_cache, q, k, v, qs, ks, vs, ks2, vs2, ref, out, plan, dp
        if not smoke:
            torch.cuda.empty_cache()

    device_name = "cpu (" + (platform.processor() or platform.machine()) + ")" if smoke else \
        torch.cuda.get_device_name(dev)
    result = dict(
        benchmark="critiprefill_block_sparse_prefill", device=device_name, smoke=smoke,
        torch=torch.__version__, triton=_triton_version(),
        kernels=("PyTorch twins" if smoke else "Triton"),
        dense_kernel=dense_name, dense_gqa=gqa_mode,
        shape=dict(num_q_heads=hq, num_kv_heads=hkv, head_size=d, dtype=str(dtype).replace("torch.", ""),
                   page_size=page, requests=1, chunked=False),
        config=dict(segment_size=cfg.segment_size, block_size=cfg.block_size, budget=cfg.budget,
                    score=cfg.score, fusion=cfg.fusion, alpha=cfg.alpha),
        kernel_params=None if smoke else dict(block_n=args.block_n, tile_rows=args.tile_rows),
        timing=dict(iters=iters, warmup=warmup, statistic="median",
                    clock="perf_counter" if smoke else "CUDA events"),
        results=rows)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "critiprefill_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out_dir / "critiprefill_bench.png")
    print(f"wrote {out_dir / 'critiprefill_bench.json'} and {out_dir / 'critiprefill_bench.png'}")
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    ns = [r["n"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(ns, [r["dense_sdpa_ms"] for r in rows], "o-", label="dense: torch SDPA (flash)" if not result["smoke"]
            else "dense: torch SDPA (math, CPU)")
    if rows[0]["dense_ours_ms"] is not None:
        ax.plot(ns, [r["dense_ours_ms"] for r in rows], "s--", label="dense: our paged kernel")
    ax.plot(ns, [r["critiprefill_ms"] for r in rows], "^-", label="CritiPrefill total (plan + kernel)")
    ax.plot(ns, [r["sparse_kernel_ms"] for r in rows], "v:", label="CritiPrefill sparse kernel only")
    ax.plot(ns, [r["plan_ms"] for r in rows], "x:", label="CritiPrefill plan only")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("ms per layer (median)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax2.bar([str(n) for n in ns], [r["speedup_vs_sdpa"] for r in rows], color="tab:green")
    ax2.axhline(3.0, color="red", linestyle="--", linewidth=1, label="target 3x")
    for i, r in enumerate(rows):
        ax2.text(i, r["speedup_vs_sdpa"], f"{r['speedup_vs_sdpa']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("speed-up over dense SDPA (plan + kernel)")
    ax2.legend(fontsize=8)
    sh, cf = result["shape"], result["config"]
    fig.suptitle(f"CritiPrefill prefill, one layer - {result['device']} - Hq {sh['num_q_heads']} Hkv "
                 f"{sh['num_kv_heads']} D {sh['head_size']} {sh['dtype']} page {sh['page_size']} - "
                 f"Sq {cf['segment_size']} Bk {cf['block_size']} budget {cf['budget']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
