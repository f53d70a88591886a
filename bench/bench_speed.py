#!/usr/bin/env python3
"""(i) SPEED in a model-shaped loop: prefill time (TTFT) and decode step (TPOT), with and without SPEED.

    python bench/bench_speed.py --out bench/results              # CUDA
    python bench/bench_speed.py --out /tmp/b --smoke             # CPU, tiny, PyTorch twins

Model-shaped, not a model: random bf16 weights in the Llama-3.1-8B shape (32 layers, l_cut 24 as in
the paper), every layer doing RMSNorm, the fused QKV GEMM, RoPE-free attention, the output GEMM,
RMSNorm, gate/up, SiLU-and-mul and down; all layers share one set of weights (the bytes and FLOPs
per layer are a real model's).

- ``prefill``: one prompt of ``ctx`` tokens, in chunks of ``chunk`` tokens as vLLM schedules it.
  Dense: every layer on every token, causal attention (PyTorch SDPA over the chunk's queries and
  all earlier keys). SPEED: the lower ``l_cut`` layers the same; the upper layers only on the last
  prompt token (and BoS in the first chunk), attending to BoS and itself
  (:func:`vllm_ext.kernels.speed_attention.speed_attention`), exactly what the backend runs
  (``vllm_ext.methods.speed.upper_stack``). TTFT = the whole prefill.
- ``decode``: one decode step of a batch after a ``ctx`` prompt. Dense: :func:`paged_decode` over
  ``ctx`` in every layer. SPEED: the same in the lower layers, the upper layers read BoS + the
  decode-phase tokens (``decoded`` of them) through ``speed_attention``.
- ``kv``: KV bytes a request holds (block arithmetic of :mod:`vllm_ext.methods.speed.kv_spec`).

Paper anchors (Llama-3.1-8B, 128K, 24/32): TTFT -33 %, TPOT -22 %, KV -25 %.
Writes ``speed.json`` (rows: ctx, batch, prefill_dense_ms, prefill_speed_ms, decode_dense_ms,
decode_speed_ms, kv_ratio) and ``speed.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import device_for, env_info, parse_args, plot, write_json  # noqa: E402

SHAPE = dict(layers=32, l_cut=24, hidden=4096, hq=32, hkv=8, d=128, inter=14336)
SMOKE_SHAPE = dict(layers=4, l_cut=3, hidden=64, hq=4, hkv=2, d=16, inter=128)
BLOCK = 16


class Model:
    def __init__(self, cfg, dtype, device, seed=0):
        torch.manual_seed(seed)
        h, hq, hkv, d = cfg["hidden"], cfg["hq"], cfg["hkv"], cfg["d"]

        def w(o, i):
            return (torch.randn(o, i, device=device) * i ** -0.5).to(dtype)
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.w_qkv, self.w_o = w((hq + 2 * hkv) * d, h), w(h, hq * d)
        self.w_gu, self.w_down = w(2 * cfg["inter"], h), w(h, cfg["inter"])

    def mlp(self, x, chunk=8192):
        out = torch.empty_like(x)
        for i in range(0, x.shape[0], chunk):
            gu = x[i:i + chunk] @ self.w_gu.T
            g, u = gu.chunk(2, dim=-1)
            out[i:i + chunk] = (F.silu(g) * u) @ self.w_down.T
        return out

    def qkv(self, x):
        c = self.cfg
        q, k, v = (x @ self.w_qkv.T).split([c["hq"] * c["d"], c["hkv"] * c["d"], c["hkv"] * c["d"]], -1)
        return (q.view(-1, c["hq"], c["d"]), k.view(-1, c["hkv"], c["d"]), v.view(-1, c["hkv"], c["d"]))


def _norm(x):
    return F.rms_norm(x, (x.shape[-1],))


def prefill(m: Model, ctx: int, chunk: int, speed: bool):
    """Chunked prefill of one prompt; K/V per layer kept contiguous ([ctx, Hkv, D]) for SDPA."""
    c = m.cfg
    dev, dt = m.device, m.dtype
    from vllm_ext.kernels.speed_attention import speed_attention

    n_kv_layers = c["l_cut"] if speed else c["layers"]
    # one K/V buffer reused by every layer (the bytes per layer are a real model's)
    k_all = torch.zeros(ctx, c["hkv"], c["d"], dtype=dt, device=dev)
    v_all = torch.zeros_like(k_all)
    up_cache = torch.zeros(2, c["hkv"], BLOCK, 2 * c["d"], dtype=dt, device=dev)   # BoS + P-1 blocks
    bt = torch.tensor([[0] + [1] * ((ctx - 1) // BLOCK)], dtype=torch.int32, device=dev)
    for start in range(0, ctx, chunk):
        end = min(ctx, start + chunk)
        x = torch.randn(end - start, c["hidden"], device=dev).to(dt)
        for layer in range(c["layers"]):
            upper = layer >= n_kv_layers
            if upper:
                keep = [i for i in (0, ctx - 1) if start <= i < end]
                if not keep:
                    break                                       # no token of this chunk goes higher
                idx = torch.tensor(keep, device=dev) - start
                xs = x[idx]
                q, k, v = m.qkv(_norm(xs))
                pos = torch.tensor(keep, device=dev)
                slot_blocks = torch.where(pos == 0, 0, 1)
                up_cache[slot_blocks, :, pos % BLOCK, :c["d"]] = k
                up_cache[slot_blocks, :, pos % BLOCK, c["d"]:] = v
                out = torch.empty_like(q)
                speed_attention(q, up_cache, bt, torch.zeros_like(pos), pos,
                                torch.tensor([ctx - 1], dtype=torch.int32, device=dev), 1, False,
                                c["d"] ** -0.5, out)
                xs = xs + out.reshape(len(keep), -1) @ m.w_o.T
                xs = xs + m.mlp(_norm(xs))
                x = x.index_copy(0, idx, xs)
                continue
            q, k, v = m.qkv(_norm(x))
            k_all[start:end], v_all[start:end] = k, v
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k_all[:end].transpose(0, 1)[None],
                v_all[:end].transpose(0, 1)[None], is_causal=False,
                attn_mask=_causal(start, end, dev), enable_gqa=True)[0].transpose(0, 1)
            x = x + attn.reshape(end - start, -1) @ m.w_o.T
            x = x + m.mlp(_norm(x))
    return x


def _causal(start, end, dev):
    q = torch.arange(start, end, device=dev)[:, None]
    k = torch.arange(end, device=dev)[None, :]
    return (k <= q)[None, None]


def decode_step(m: Model, batch: int, ctx: int, decoded: int, speed: bool):
    from vllm_ext.kernels.dense_decode_evidence import paged_decode
    from vllm_ext.kernels.speed_attention import speed_attention

    c = m.cfg
    dev, dt = m.device, m.dtype
    seq = ctx + decoded
    mb = -(-seq // BLOCK)
    nb = batch * mb
    kv = torch.randn(nb, c["hkv"], BLOCK, 2 * c["d"], device=dev).to(dt)
    bt = torch.arange(nb, dtype=torch.int32, device=dev).view(batch, mb)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    rows = torch.arange(batch, device=dev)
    pos = torch.full((batch,), seq - 1, device=dev)
    tail = torch.full((batch,), ctx - 1, dtype=torch.int32, device=dev)

    def step():
        x = torch.randn(batch, c["hidden"], device=dev).to(dt)
        for layer in range(c["layers"]):
            q, _, _ = m.qkv(_norm(x))
            out = torch.empty_like(q)
            if speed and layer >= c["l_cut"]:
                speed_attention(q, kv, bt, rows, pos, tail, 1, False, c["d"] ** -0.5, out)
            else:
                paged_decode(q, kv, bt, seq_lens, c["d"] ** -0.5, out)
            x = x + out.reshape(batch, -1) @ m.w_o.T
            x = x + m.mlp(_norm(x))
        return x
    return step


def _time(fn, dev, reps):
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def main(argv=None):
    def extra(ap):
        ap.add_argument("--ctxs", default=None, help="comma list of prompt lengths")
        ap.add_argument("--batch", type=int, default=None)
        ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (vLLM's token budget)")
    args = parse_args(__doc__.splitlines()[1], argv, extra)
    dev = device_for(args)
    cfg = SMOKE_SHAPE if args.smoke else SHAPE
    dt = torch.float32 if args.smoke else torch.bfloat16
    ctxs = [int(x) for x in args.ctxs.split(",")] if args.ctxs else \
        ([96, 200] if args.smoke else [8192, 32768, 65536, 131072])
    batch = args.batch or (2 if args.smoke else 16)
    chunk = args.chunk or (64 if args.smoke else 8192)
    decoded = 16 if args.smoke else 256
    reps = 1 if args.smoke else 3
    m = Model(cfg, dt, dev)
    rows = []
    with torch.inference_mode():
        for ctx in ctxs:
            row = dict(ctx=ctx, batch=batch, chunk=chunk, decoded=decoded)
            row["prefill_dense_ms"] = _time(lambda: prefill(m, ctx, chunk, False), dev, reps)
            row["prefill_speed_ms"] = _time(lambda: prefill(m, ctx, chunk, True), dev, reps)
            try:
                row["decode_dense_ms"] = _time(decode_step(m, batch, ctx, decoded, False), dev, reps * 3)
                row["decode_speed_ms"] = _time(decode_step(m, batch, ctx, decoded, True), dev, reps * 3)
            except torch.OutOfMemoryError as exc:
                row["decode_error"] = str(exc)[:200]
            blocks = -(-(ctx + decoded) // BLOCK)
            upper = 1 + blocks - max(1, (ctx - 1) // BLOCK)
            row["kv_ratio"] = (cfg["l_cut"] * blocks + (cfg["layers"] - cfg["l_cut"]) * upper) / \
                (cfg["layers"] * blocks)
            row["ttft_change"] = row["prefill_speed_ms"] / row["prefill_dense_ms"] - 1
            if "decode_speed_ms" in row:
                row["tpot_change"] = row["decode_speed_ms"] / row["decode_dense_ms"] - 1
            rows.append(row)
            print(f"[i] ctx {ctx:6d}: prefill dense {row['prefill_dense_ms']:9.1f} ms speed "
                  f"{row['prefill_speed_ms']:9.1f} ms ({row['ttft_change']:+.1%}); decode b{batch} "
                  f"{row.get('decode_dense_ms', 0):7.2f} -> {row.get('decode_speed_ms', 0):7.2f} ms "
                  f"({row.get('tpot_change', 0):+.1%}); KV x{row['kv_ratio']:.3f}", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    write_json(args.out, "speed", dict(
        bench="speed", label="model-shaped (random weights, not a model): Llama-3.1-8B shape, "
        "l_cut 24 of 32; prefill chunked, SDPA attention in the lower layers; decode with "
        "paged_decode / speed_attention", env=env_info(dev), smoke=args.smoke, shape=cfg,
        paper={"ttft_change": -0.33, "tpot_change": -0.22, "kv_ratio": 0.75}, rows=rows))
    plot(args.out, "speed", "SPEED vs dense (model-shaped, Llama-3.1-8B shape, 24/32)",
         "prompt tokens", "SPEED / dense",
         {"TTFT": ([r["ctx"] for r in rows], [1 + r["ttft_change"] for r in rows]),
          "TPOT": ([r["ctx"] for r in rows if "tpot_change" in r],
                   [1 + r["tpot_change"] for r in rows if "tpot_change" in r]),
          "KV per request": ([r["ctx"] for r in rows], [r["kv_ratio"] for r in rows])},
         logx=True)


if __name__ == "__main__":
    main()
