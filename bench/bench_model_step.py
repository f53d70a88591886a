#!/usr/bin/env python3
"""(f) Model-shaped decode step: dense vs SFI per-step time at 8K .. 128K (labelled model-shaped).

    python bench/bench_model_step.py --out bench/results          # CUDA
    python bench/bench_model_step.py --out /tmp/b --smoke         # CPU, tiny, PyTorch twins

NOT a model: random bf16 weights in the shapes of Llama-3.1-8B and Qwen3-4B, batch 16, every layer
doing RMSNorm, the fused QKV GEMM, the KV-cache write of the new token, attention (ours), the output
GEMM, RMSNorm, the gate/up GEMM, SiLU-and-mul and the down GEMM; then the final norm and the LM head.
RoPE, q/k-norm and sampling are left out (elementwise, negligible). To fit 128K x batch 16 on one GPU
every layer reads the same weights and the same KV cache: each is far larger than L2, so the bytes
moved per layer are those of a real model.

Variants (each a whole step captured in one CUDA graph):
- ``dense``: ``paged_decode`` over the whole context in every layer;
- ``sfi_fast``: ``two_segment_decode`` (sink 4 + K 2048 + recent 256) in every layer;
- ``sfi_slow``: ``dense_decode_with_evidence`` + selector (if ``vllm_ext.kernels.sfi_selector``
  exists) + ``gather_compact`` in every layer, serially (no side stream: an upper bound);
- ``sfi_amortized`` = (31 fast + 1 slow) / 32, the refresh budget R = 32 with no boundary triggers.

Anchor (end to end, Qwen3-4B, B200, batch 16, the paper): ~1.8x at 8K rising to 14.4x at 128K.
Writes ``model_step.json`` and ``model_step.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (BASELINE_NOTE, DecodeProblem, device_for, env_info, parse_args, plot,  # noqa: E402
                    time_op, write_json)

MODELS = {
    "Llama-3.1-8B": dict(layers=32, hidden=4096, hq=32, hkv=8, d=128, inter=14336, vocab=128256),
    "Qwen3-4B": dict(layers=36, hidden=2560, hq=32, hkv=8, d=128, inter=9728, vocab=151936),
}
SMOKE_MODELS = {"tiny": dict(layers=2, hidden=64, hq=4, hkv=2, d=16, inter=128, vocab=256)}
PAPER_E2E_QWEN3_4B = {"8192": 1.8, "131072": 14.4}


class ModelShaped:
    def __init__(self, cfg: dict, batch: int, ctx: int, dtype, device, budget: dict, select_fn,
                 sfi_cfg):
        self.cfg, self.batch, self.ctx, self.device = cfg, batch, ctx, device
        h, hq, hkv, d = cfg["hidden"], cfg["hq"], cfg["hkv"], cfg["d"]
        torch.manual_seed(0)

        def w(o, i):
            return (torch.randn(o, i, device=device) * i ** -0.5).to(dtype)
        self.w_qkv = w((hq + 2 * hkv) * d, h)
        self.w_o = w(h, hq * d)
        self.w_gu = w(2 * cfg["inter"], h)
        self.w_down = w(h, cfg["inter"])
        self.w_lm = w(cfg["vocab"], h)
        self.ln = torch.ones(h, dtype=dtype, device=device)
        self.x0 = torch.randn(batch, h, device=device).to(dtype)
        self.prob = DecodeProblem(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, block_size=16,
                                  dtype=dtype, device=device)
        self.st = self.prob.sfi_state(n_sink=budget["sink"], n_sel=budget["k"],
                                      n_recent=budget["recent"])
        self.budget = budget
        p = self.prob
        # the new token of each row sits at position ctx - 1
        pos = ctx - 1
        self.w_blk = p.block_table[:, pos // 16].long()
        self.w_off = pos % 16
        from vllm_ext.kernels.dense_decode_evidence import dense_decode_workspace
        from vllm_ext.kernels.two_segment_decode import (dense_num_splits, two_segment_num_splits,
                                                         two_segment_workspace)
        self.ns_dense = dense_num_splits(batch, hkv, ctx, device)
        self.ws_dense = dense_decode_workspace(batch, hq, d, self.ns_dense, device, max_len=ctx)
        retained = budget["sink"] + budget["k"] + budget["recent"]
        self.ns_sfi = two_segment_num_splits(batch, hkv, retained, device)
        self.ws_sfi = two_segment_workspace(batch, hq, d, self.ns_sfi, device)
        self.attn_out = torch.empty(batch, hq, d, dtype=dtype, device=device)
        self.ev = torch.empty(batch, hkv, ctx, dtype=torch.float32, device=device)
        self.lo = torch.full((batch,), budget["sink"], dtype=torch.int32, device=device)
        self.hi = p.seq_lens - budget["recent"]
        self.select_fn, self.sfi_cfg = select_fn, sfi_cfg
        if select_fn is not None:
            kn = torch.linalg.vector_norm(p.kv_cache[..., :d], dim=-1, dtype=torch.float32)
            self.key_norms = kn[p.block_table.long()].permute(0, 2, 1, 3).reshape(
                batch, hkv, -1)[..., :ctx].contiguous()

    def _rms(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.ln

    def _attn(self, q, mode):
        from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence, paged_decode
        from vllm_ext.kernels.gather_compact import gather_compact
        from vllm_ext.kernels.two_segment_decode import two_segment_decode
        p, st, o = self.prob, self.st, self.attn_out
        if mode == "dense":
            paged_decode(q, p.kv_cache, p.block_table, p.seq_lens, p.scale, o,
                         num_splits=self.ns_dense, workspace=self.ws_dense)
        elif mode == "sfi_fast":
            two_segment_decode(q, p.kv_cache, p.block_table, p.seq_lens, st["recent_start"],
                               st["compact_kv"], st["compact_len"], st["slot_idx"], p.scale, o,
                               num_splits=self.ns_sfi, max_recent=self.budget["recent"],
                               workspace=self.ws_sfi)
        else:  # sfi_slow
            dense_decode_with_evidence(q, p.kv_cache, p.block_table, p.seq_lens, self.lo, self.hi,
                                       p.scale, o, self.ev, num_splits=self.ns_dense,
                                       workspace=self.ws_dense)
            sel, n_sel = st["selected"], st["n_sel"]
            if self.select_fn is not None:
                sel, n_sel = self.select_fn(self.ev, self.key_norms, self.lo, self.hi, self.sfi_cfg,
                                            self.budget["k"])
            gather_compact(p.kv_cache, p.block_table, st["slot_idx"], sel, n_sel,
                           self.budget["sink"], st["compact_kv"], st["compact_len"],
                           seq_lens=p.seq_lens)
        return o

    def step(self, mode):
        cfg, p = self.cfg, self.prob
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
        x = self.x0
        for _ in range(cfg["layers"]):
            h = self._rms(x)
            qkv = h @ self.w_qkv.t()
            q = qkv[:, :hq * d].view(-1, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            p.kv_cache[self.w_blk, :, self.w_off, :d] = k
            p.kv_cache[self.w_blk, :, self.w_off, d:] = v
            o = self._attn(q, mode)
            x = x + o.reshape(-1, hq * d) @ self.w_o.t()
            gu = self._rms(x) @ self.w_gu.t()
            g, u = gu.chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ self.w_down.t()
        return self._rms(x) @ self.w_lm.t()


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(models=SMOKE_MODELS, batch=2, dtype=torch.float32, ctxs=[128, 256],
                    budget=dict(sink=4, k=32, recent=16))
    return dict(models=MODELS, batch=16, dtype=torch.bfloat16,
                ctxs=[8192, 16384, 32768, 65536, 131072],
                budget=dict(sink=4, k=2048, recent=256))


def main(argv=None):
    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    sh = shapes(args.smoke)
    env = env_info(dev)
    try:
        from vllm_ext.methods.sfi.config import SfiConfig
        from vllm_ext.kernels.sfi_selector import select as select_fn
        from vllm_ext.methods.sfi.selector_params import selector_params
        sfi_cfg = selector_params(SfiConfig(k=sh["budget"]["k"], k_min=min(32, sh["budget"]["k"])))
        sel_note = None
    except Exception as exc:
        select_fn, sfi_cfg = None, None
        sel_note = f"selector not available ({type(exc).__name__}: {exc}); slow step = evidence + gather"
    results = {}
    for name, cfg in sh["models"].items():
        rows = []
        for ctx in sh["ctxs"]:
            m = ModelShaped(cfg, sh["batch"], ctx, sh["dtype"], dev, sh["budget"], select_fn, sfi_cfg)
            row = dict(ctx=ctx)
            with torch.inference_mode():
                for mode in ("dense", "sfi_fast", "sfi_slow"):
                    t = time_op(lambda: m.step(mode), dev, rep_ms=300)
                    row[f"{mode}_ms"] = t["ms"]
                    row[f"{mode}_ms_eager"] = t["ms_eager"]
                    if "graph_error" in t:
                        row[f"{mode}_graph_error"] = t["graph_error"]
            row["sfi_amortized_ms"] = (31 * row["sfi_fast_ms"] + row["sfi_slow_ms"]) / 32
            row["speedup_fast"] = row["dense_ms"] / row["sfi_fast_ms"]
            row["speedup_amortized"] = row["dense_ms"] / row["sfi_amortized_ms"]
            for mode in ("dense", "sfi_fast", "sfi_amortized"):
                row[f"{mode}_tok_per_s"] = sh["batch"] * 1e3 / row[f"{mode}_ms"]
            rows.append(row)
            print(f"[f] {name} ctx {ctx:6d}: dense {row['dense_ms']:8.2f} ms  fast "
                  f"{row['sfi_fast_ms']:7.2f} ms  slow {row['sfi_slow_ms']:8.2f} ms  "
                  f"speed-up fast {row['speedup_fast']:.2f}x amortized "
                  f"{row['speedup_amortized']:.2f}x", flush=True)
            del m
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        results[name] = dict(shape=cfg, rows=rows)
    payload = dict(bench="model_step", label="model-shaped (random weights, not a model)", env=env,
                   smoke=args.smoke, baseline=BASELINE_NOTE, batch=sh["batch"],
                   dtype=str(sh["dtype"]), budget=sh["budget"], selector_note=sel_note,
                   weights_and_kv="one layer's weights and one KV cache shared by all layers",
                   timing="whole step in one CUDA graph, replay median (ms)",
                   anchor_paper_e2e_speedup_qwen3_4b_b200=PAPER_E2E_QWEN3_4B, models=results)
    write_json(args.out, "model_step", payload)
    series = {}
    for name, r in results.items():
        xs = [x["ctx"] for x in r["rows"]]
        series[f"{name} fast"] = (xs, [x["speedup_fast"] for x in r["rows"]])
        series[f"{name} amortized"] = (xs, [x["speedup_amortized"] for x in r["rows"]])
    plot(args.out, "model_step", f"model-shaped decode step, SFI speed-up over dense ({env['gpu']})",
         "context (tokens)", "speed-up (x)", series, logx=True,
         anchors={"paper e2e Qwen3-4B (B200)": ([float(k) for k in PAPER_E2E_QWEN3_4B],
                                                list(PAPER_E2E_QWEN3_4B.values()))})
    return payload


if __name__ == "__main__":
    main()
