#!/usr/bin/env python3
"""(h) Tiles of the launches whose work is decided on the device (kernel-only, one layer).

    python bench/tune_fixed_tiles.py --out bench/results            # CUDA
    python bench/tune_fixed_tiles.py --out /tmp/b --smoke           # CPU: the harness only

Masked and count-driven launches cannot be autotuned (vLLM's warm-up and CUDA-graph capture carry
none of their work, see ``triton_utils.untuned``), so their tile is a module constant. This sweeps
those constants on the GPU, one layer in the Llama-3.1-8B shape (32 query / 8 KV heads, head 128,
bf16, page 16), each launch replayed from a CUDA graph:

- ``slow_pass``: ``dense_decode_with_evidence`` over the compacted slow list as ``sfi_decode`` calls
  it (16 entries, 1 live, evidence + key norms, count on the device) at 32K and 128K;
  sweeps ``SLOW_PASS_META``, ``PERSISTENT_WAVES`` and the split count;
- ``two_segment_masked``: the fast rows' pass (batch 16, K 2048 + 4 sink + 256 recent, all rows
  fast); sweeps ``two_segment_decode.MASKED_META``;
- ``dense_masked``: ``paged_decode`` with a row mask (the dense rows, batch 16, all dense); sweeps
  ``FIXED_META``.

Each case also times the autotuned unmasked launch of the same work (``ref``) and reports GB/s of
the bytes the launch must read. Writes ``tile_sweep.json`` with every point and the best per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common import DecodeProblem, device_for, env_info, gbps, parse_args, time_op, write_json  # noqa: E402

TILES = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in (
    (32, 2, 3), (32, 4, 3), (32, 4, 4), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
    (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3))]


def _tile_name(t: dict) -> str:
    return f"N{t['BLOCK_N']}w{t['num_warps']}s{t['num_stages']}"


def sweep_slow_pass(dev, ctx: int, live: int, rep_ms: int, smoke: bool) -> list[dict]:
    from vllm_ext.kernels import dense_decode_evidence as dde

    hq, hkv, d, e = (4, 2, 16, 4) if smoke else (32, 8, 128, 16)
    dt = torch.float32 if smoke else torch.bfloat16
    p = DecodeProblem(batch=live, ctx=ctx, hq=hq, hkv=hkv, d=d, block_size=16, dtype=dt, device=dev)
    rows = torch.full((e,), -1, dtype=torch.int32, device=dev)
    rows[:live] = torch.arange(live, dtype=torch.int32, device=dev)
    count = torch.tensor([live], dtype=torch.int32, device=dev)
    lo = torch.full((live,), 4, dtype=torch.int32, device=dev)
    hi = torch.full((live,), ctx - 256, dtype=torch.int32, device=dev)
    ev = torch.empty((e, hkv, ctx), dtype=torch.float32, device=dev)
    kn = torch.empty_like(ev)
    splits_grid = [4] if smoke else [32, 64, 128]
    ws = dde.dense_decode_workspace(e, hq, d, max(splits_grid), dev, max_len=ctx, evidence_rows=e)
    nbytes = p.kv_bytes(ctx)
    out = []

    def run(splits):
        return lambda: dde.dense_decode_with_evidence(
            p.query, p.kv_cache, p.block_table, p.seq_lens, lo, hi, p.scale, p.out, ev,
            workspace=ws, evidence_rows=rows, key_norms=kn, evidence_count=count, num_splits=splits)

    ref = time_op(lambda: dde.paged_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, p.scale,
                                           p.out), dev, rep_ms=rep_ms)
    out.append(dict(case="slow_pass", ctx=ctx, live=live, config="ref: paged_decode autotuned, "
                    "no evidence", ms=ref["ms"], gbps=gbps(nbytes, ref["ms"])))
    saved = (dict(dde.SLOW_PASS_META), dde.PERSISTENT_WAVES)
    try:
        for tile in (TILES[:1] if smoke else TILES):
            dde.SLOW_PASS_META = tile
            for waves in ([2] if smoke else [2, 4]):
                dde.PERSISTENT_WAVES = waves
                for splits in splits_grid:
                    try:
                        r = time_op(run(splits), dev, rep_ms=rep_ms)
                    except Exception as exc:                 # e.g. out of shared memory: record
                        out.append(dict(case="slow_pass", ctx=ctx, live=live, tile=_tile_name(tile),
                                        waves=waves, splits=splits, error=str(exc)[:200]))
                        continue
                    out.append(dict(case="slow_pass", ctx=ctx, live=live, tile=_tile_name(tile),
                                    meta=tile, waves=waves, splits=splits, ms=r["ms"],
                                    gbps=gbps(nbytes, r["ms"])))
    finally:
        dde.SLOW_PASS_META, dde.PERSISTENT_WAVES = saved
    return out


def sweep_masked(dev, ctx: int, rep_ms: int, smoke: bool) -> list[dict]:
    from vllm_ext.kernels import dense_decode_evidence as dde
    from vllm_ext.kernels import two_segment_decode as tsd

    batch, hq, hkv, d = (2, 4, 2, 16) if smoke else (16, 32, 8, 128)
    n_sel, n_sink, n_recent = (32, 4, 16) if smoke else (2048, 4, 256)
    dt = torch.float32 if smoke else torch.bfloat16
    p = DecodeProblem(batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, block_size=16, dtype=dt, device=dev)
    st = p.sfi_state(n_sink=n_sink, n_sel=n_sel, n_recent=n_recent)
    mask = torch.ones(batch, dtype=torch.bool, device=dev)
    out = []
    cases = {
        "two_segment_masked": (
            lambda m: tsd.two_segment_decode(p.query, p.kv_cache, p.block_table, p.seq_lens,
                                             st["recent_start"], st["compact_kv"], st["compact_len"],
                                             st["slot_idx"], p.scale, p.out, row_mask=m,
                                             max_recent=n_recent),
            p.kv_bytes(n_sink + n_sel + n_recent), tsd, "MASKED_META"),
        "dense_masked": (
            lambda m: dde.paged_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, p.scale, p.out,
                                       row_mask=m),
            p.kv_bytes(ctx), dde, "FIXED_META"),
    }
    for case, (fn, nbytes, mod, attr) in cases.items():
        ref = time_op(lambda: fn(None), dev, rep_ms=rep_ms)
        out.append(dict(case=case, ctx=ctx, batch=batch, config="ref: unmasked, autotuned",
                        ms=ref["ms"], gbps=gbps(nbytes, ref["ms"])))
        saved = dict(getattr(mod, attr))
        try:
            for tile in (TILES[:1] if smoke else TILES):
                setattr(mod, attr, tile)
                try:
                    r = time_op(lambda: fn(mask), dev, rep_ms=rep_ms)
                except Exception as exc:
                    out.append(dict(case=case, ctx=ctx, batch=batch, tile=_tile_name(tile),
                                    error=str(exc)[:200]))
                    continue
                out.append(dict(case=case, ctx=ctx, batch=batch, tile=_tile_name(tile), meta=tile,
                                ms=r["ms"], gbps=gbps(nbytes, r["ms"])))
        finally:
            setattr(mod, attr, saved)
    return out


def main(argv=None):
    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    rep = 20 if args.smoke else 60
    rows = []
    ctxs = [256] if args.smoke else [32768, 131072]
    with torch.inference_mode():
        for ctx in ctxs:
            for live in [1]:
                rows += sweep_slow_pass(dev, ctx, live, rep, args.smoke)
                print(f"[h] slow_pass ctx {ctx} live {live}: done", flush=True)
            rows += sweep_masked(dev, ctx, rep, args.smoke)
            print(f"[h] masked ctx {ctx}: done", flush=True)
    best = {}
    for r in rows:
        if "tile" not in r or "ms" not in r:
            continue
        key = f"{r['case']} ctx {r['ctx']}" + (f" live {r['live']}" if "live" in r else "")
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for key, r in best.items():
        ref = next(x for x in rows if x.get("config", "").startswith("ref") and x["case"] == r["case"]
                   and x["ctx"] == r["ctx"] and x.get("live") == r.get("live"))
        print(f"[h] best {key}: {r['tile']} waves {r.get('waves', '-')} splits {r.get('splits', '-')}"
              f" {r['ms'] * 1e3:.1f} us {r['gbps']:.0f} GB/s (ref {ref['ms'] * 1e3:.1f} us "
              f"{ref['gbps']:.0f} GB/s)", flush=True)
    write_json(args.out, "tile_sweep", dict(
        bench="tile_sweep", label="kernel-only, one layer, Llama-3.1-8B attention shape; CUDA-graph "
        "replay median", env=env_info(dev), smoke=args.smoke, rows=rows, best=best))


if __name__ == "__main__":
    main()
