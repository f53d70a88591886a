#!/usr/bin/env python3
"""(e) Slow-step maintenance per layer: evidence, selector and gather time against dense attention.

    python bench/bench_selector.py --out bench/results          # CUDA
    python bench/bench_selector.py --out /tmp/b --smoke         # CPU, tiny, PyTorch twins

Per layer, 8 KV heads (32 query heads), head 128, bf16, page 16, K = 2048, ctx 8K / 32K / 64K / 128K,
batch (= slow rows) 1 / 4 / 16:

- ``dense_ms``: the layer's dense decode attention (our split-K ``paged_decode``) for the batch;
  ``dense_with_evidence_ms``: the slow step's attention with the evidence (the difference is the
  evidence's cost on the main stream);
- ``selector_ms``: ``vllm_ext.kernels.sfi_selector.select`` as the decode path calls it: pooled fp32
  log-evidence ``[B, Hkv, ctx]``, key norms, per-row budget tensor, ``k_cap = K``, with a persistent
  ``selector_workspace`` (no allocation; CUDA-graph replay, see ``common.time_op``);
  ``selector_scores_ms``: its first half alone (fusion statistics + scores), the rest is the top-K;
  ``selector_span4_ms``: the same with ``sfi.select_span = 4`` (bench/QUALITY.md);
  ``selector_keep_ms``: a decode slow step with ``sfi.keep_prefill = K/2``, ``select_span = 6``,
  ``select_span_back = 6`` (the K/2 kept positions excluded, the other K/2 selected; bench/QUALITY.md);
- ``gather_ms``: ``gather_compact`` of sink + K selected entries per (row, KV head);
- ``quest_page16_evidence_ms`` / ``quest_page8_evidence_ms``: ``sfi.selector = "quest"``: the page
  scores of the batch's queries over the page table (``ctx/page`` max/min pairs per KV head), which
  replace the dense pass; a Quest selection is that + the selector (neutral refinements, about
  ``selector_ms``) + the gather, at every step with ``refresh`` 1 (bench/QUALITY.md);
  ``quest_page16_selection_ms``: page scores + the selector's top-K, the whole selection but the
  gather; ``quest_page16_rerank4_selection_ms``: the same with ``sfi.quest_rerank = 4`` (the top 4K
  by page bound as candidates, their group attention mass from their K, the top-K of them).

``maintenance_ms`` = selector + gather (what the side stream runs per layer) and
``maintenance_over_dense`` = maintenance / dense, against the target of 0.15 at 32K-128K;
``selector_gbps``: bytes the selector's kernels move by design (about 32 per position and KV head,
``selector_model_bytes``) / time; ``selector_input_gbps``: the 8 bytes per position it must read.
``candidates_*``: how many positions reached the exact top-K step (the threshold bucket); above
``cap`` the step scans the whole row (slower, same result). Writes ``selector.json`` / ``.png``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (BASELINE_NOTE, DecodeProblem, device_for, env_info, gbps, parse_args, plot,  # noqa: E402
                    time_op, write_json)

SPAN = 4                               # sfi.select_span timed beside the paper's selector
QUEST_PAGES = (16, 8)                  # sfi.page_size of the timed Quest page scores
QUEST_RERANK, QUEST_RERANK_PAGE = 4, 16  # sfi.quest_rerank timed beside a plain Quest selection
TARGET = 0.15                          # the target: selector + gather <= 15 % of the layer's dense attention


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(batches=[1, 2], hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32,
                    ctxs=[256, 512], k=32, n_recent=16, n_sink=4)
    return dict(batches=[1, 4, 16], hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16,
                ctxs=[8192, 32768, 65536, 131072], k=2048, n_recent=256, n_sink=4)


def load_selector():
    try:
        from vllm_ext.methods.sfi.config import SfiConfig
        from vllm_ext.kernels import sfi_selector
    except Exception as exc:
        return None, None, f"vllm_ext.kernels.sfi_selector not importable: {type(exc).__name__}: {exc}"
    for name in ("select", "selector_workspace"):
        if not hasattr(sfi_selector, name):
            return None, None, f"vllm_ext.kernels.sfi_selector has no {name}()"
    return sfi_selector, SfiConfig, None


def model_bytes(mod, cfg, heads: int, sizes: list[int]) -> int:
    """Bytes the selector's kernels move by design for allowed sets of ``sizes`` positions: evidence +
    key norms twice (statistics, then scores, the latter with its halo), the score written once and
    read by the histogram, compaction and write steps."""
    from vllm_ext.methods.sfi.selector_params import selector_params

    halo_l, halo_r, _ = mod._halos(selector_params(cfg), int(cfg.select_span))
    t2 = mod._tile_t2(heads, halo_l, halo_r, mod.TILES)
    per_pos = 8 + 8 * t2 / (t2 - halo_l - halo_r) + 4 + 3 * 4
    return int(sum(sizes) * heads * per_pos)


def time_selector(mod, SfiConfig, sh, ev, kn, lo, hi, kt, dev, span: int, back: int = 0,
                  exclude: torch.Tensor | None = None) -> dict:
    from vllm_ext.methods.sfi.selector_params import selector_params

    cfg = selector_params(SfiConfig(k=sh["k"], select_span=span, select_span_back=back,
                                    k_min=0 if exclude is not None else SfiConfig.k_min))
    b, hkv, ctx = kn.shape
    out: dict = {}
    ws = mod.selector_workspace(b, hkv, ctx, sh["k"], dev, cfg)
    res = {}

    def run():
        res["out"] = mod.select(ev, kn, lo, hi, cfg, kt, k_cap=sh["k"], workspace=ws, exclude=exclude)
    t = time_op(run, dev)
    out.update(ms=t["ms"], ms_eager=t["ms_eager"])
    if "graph_error" in t:
        out["graph_error"] = t["graph_error"]
    out["result"] = res["out"]
    out["ws"] = ws
    if ws.score is not None and span == 0 and exclude is None:   # the Triton path: stage split, diagnostics
        out["scores_ms"] = time_op(lambda: mod.selector_scores_triton(ev, kn, lo, hi, cfg, fill_outside=False,
                                                                     workspace=ws), dev)["ms"]
        run()
        sizes = (hi.long() - lo.long()).clamp_min(0)
        need = (sizes > sh["k"])[:, None].expand(b, hkv)          # rows that went through the top-K
        if bool(need.any()):
            cnt = ws.cand_cnt[:b].long()[need]
            out.update(candidates_max=int(cnt.max()), candidates_mean=float(cnt.float().mean()),
                       candidates_overflow=int((cnt > ws.cap).sum()), cap=int(ws.cap))
    return out


def bound_pages(b: int, ctx: int, page: int, hkv: int, d: int, dtype, dev, block: int = 16):
    """Random Quest page bounds of ``b`` requests of ``ctx`` tokens as vLLM pages them
    (``vllm_ext.kernels.quest_pages``): blocks of ``block`` bound entries at shuffled ids, and the
    per-slot table."""
    from vllm_ext.methods.sfi.quest_tables import quest_blocks

    g = torch.Generator(device="cpu").manual_seed(page)
    per = quest_blocks(ctx, page, block)
    pages = torch.randn(b * per, hkv, block, 2 * d, generator=g).to(dev, dtype)
    table = torch.randperm(b * per, generator=g).view(b, per).to(dev, torch.int32)
    return pages, table


def time_quest_selection(mod, SfiConfig, sh, prob, reps, ent, lo, hi, kt, ev, dev) -> dict:
    """A whole Quest selection of the batch (page scores + the selector's top-K), and the same with
    ``quest_rerank`` (page scores, the candidates' top-K, their group attention mass from K, the
    top-K of the candidates)."""
    from vllm_ext.kernels.quest_pages import quest_page_evidence, quest_selector_params
    from vllm_ext.kernels.quest_rerank import quest_candidate_evidence, quest_rerank_workspace
    from vllm_ext.methods.sfi.selector_params import selector_params

    b, hkv, ctx = ev.shape
    k, r, page = sh["k"], QUEST_RERANK, QUEST_RERANK_PAGE
    qcfg = quest_selector_params(selector_params(SfiConfig(k=k, k_min=0)))
    ones = torch.ones(b, hkv, ctx, dtype=torch.float32, device=dev)
    final_ws = mod.selector_workspace(b, hkv, ctx, k, dev, qcfg)
    cand_ws = mod.selector_workspace(b, hkv, ctx, r * k, dev, qcfg)
    scores_ws = quest_rerank_workspace(b, prob.hq, hkv, prob.d, r * k, dev)
    cand_k = kt * r

    def plain():
        quest_page_evidence(prob.query, *reps, prob.scale, ent, ent, lo, hi, page, ev)
        mod.select(ev, ones, lo, hi, qcfg, kt, k_cap=k, workspace=final_ws)

    def rerank():
        quest_page_evidence(prob.query, *reps, prob.scale, ent, ent, lo, hi, page, ev)
        cand, n_cand = mod.select(ev, ones, lo, hi, qcfg, cand_k, k_cap=r * k, workspace=cand_ws)
        quest_candidate_evidence(prob.query, prob.kv_cache, prob.block_table, ent, cand, n_cand, hi,
                                 prob.scale, ev, workspace=scores_ws)
        mod.select(ev, ones, lo, hi, qcfg, kt, k_cap=k, workspace=final_ws)

    return {f"quest_page{page}_selection_ms": time_op(plain, dev)["ms"],
            f"quest_page{page}_rerank{r}_selection_ms": time_op(rerank, dev)["ms"]}


def run_config(ctx: int, batch: int, sh: dict, dev: torch.device, mod, SfiConfig, state: dict) -> dict:
    """One (context, batch) point; its buffers die with the call."""
    from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence,
                                                        dense_decode_workspace, paged_decode)
    from vllm_ext.kernels.gather_compact import gather_compact
    from vllm_ext.kernels.two_segment_decode import dense_num_splits

    prob = DecodeProblem(batch=batch, ctx=ctx, hq=sh["hq"], hkv=sh["hkv"], d=sh["d"],
                         block_size=sh["block_size"], dtype=sh["dtype"], device=dev)
    b, hkv = prob.batch, prob.hkv
    ns = dense_num_splits(b, hkv, ctx, dev)
    dws = dense_decode_workspace(b, prob.hq, prob.d, ns, dev, max_len=ctx)
    out = torch.empty_like(prob.query)
    ev = torch.full((b, hkv, ctx), float("-inf"), dtype=torch.float32, device=dev)
    lo = torch.full((b,), sh["n_sink"], dtype=torch.int32, device=dev)
    hi = prob.seq_lens - sh["n_recent"]
    kt = torch.full((b,), sh["k"], dtype=torch.int32, device=dev)
    row = dict(ctx=ctx, batch=b)
    row["dense_ms"] = time_op(lambda: paged_decode(
        prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, prob.scale, out,
        num_splits=ns, workspace=dws), dev)["ms"]
    try:
        row["dense_with_evidence_ms"] = time_op(lambda: dense_decode_with_evidence(
            prob.query, prob.kv_cache, prob.block_table, prob.seq_lens, lo, hi, prob.scale, out,
            ev, num_splits=ns, workspace=dws), dev)["ms"]
        row["evidence_extra_ms"] = row["dense_with_evidence_ms"] - row["dense_ms"]
    except Exception as exc:       # report, keep the rest (a random log-evidence instead)
        row["evidence_error"] = f"{type(exc).__name__}: {exc}"[:400]
        g = torch.Generator(device="cpu").manual_seed(ctx + b)
        ev.copy_((torch.randn(b, hkv, ctx, generator=g) * 2.0).to(dev))

    sel = torch.full((b, hkv, sh["k"]), -1, dtype=torch.int32, device=dev)
    n_sel = torch.full((b,), sh["k"], dtype=torch.int32, device=dev)
    if mod is not None:
        key_norms = torch.linalg.vector_norm(prob.kv_cache[..., :prob.d], dim=-1,
                                            dtype=torch.float32)         # [nb, H, bs]
        kn = key_norms[prob.block_table.long()].permute(0, 2, 1, 3).reshape(b, hkv, -1)[..., :ctx]
        kn = kn.contiguous()
        del key_norms
        try:
            try:
                t = time_selector(mod, SfiConfig, sh, ev, kn, lo, hi, kt, dev, 0)
            except Exception as exc:
                if dev.type != "cuda" or not getattr(mod.TILES, "gather", False):
                    raise
                # a Triton build whose tl.gather fails: the global-scratch fallback
                state["gather_fallback"] = f"{type(exc).__name__}: {exc}"[:400]
                mod.set_tiles(dataclasses.replace(mod.TILES, gather=False))
                t = time_selector(mod, SfiConfig, sh, ev, kn, lo, hi, kt, dev, 0)
            row["selector_ms"] = t["ms"]
            row["selector_ms_eager"] = t["ms_eager"]
            for key in ("graph_error", "scores_ms", "candidates_max", "candidates_mean",
                        "candidates_overflow", "cap"):
                if key in t:
                    row[key if key.startswith(("cand", "cap")) else f"selector_{key}"] = t[key]
            s_out, s_n = t["result"]
            sel.copy_(s_out)
            n_sel.copy_(s_n)
            sizes = (hi.long() - lo.long()).clamp_min(0).tolist()
            row["selector_model_bytes"] = model_bytes(mod, SfiConfig(k=sh["k"]), hkv, sizes)
            row["selector_gbps"] = gbps(row["selector_model_bytes"], row["selector_ms"])
            row["selector_input_gbps"] = gbps(sum(sizes) * hkv * 8, row["selector_ms"])
            if b <= 4 and ctx <= 8192:     # spot check against the twin (exact up to near-ties)
                from vllm_ext.methods.sfi.selector_params import selector_params

                ref, ref_n = mod.select_torch(ev, kn, lo, hi, selector_params(SfiConfig(k=sh["k"])), kt,
                                              k_cap=sh["k"])
                row["twin_n_sel_equal"] = bool(torch.equal(ref_n, s_n))
                row["twin_rows_heads_equal"] = float((ref == s_out).all(-1).float().mean())
        except Exception as exc:   # report, keep the rest of the bench
            row["selector_error"] = f"{type(exc).__name__}: {exc}"[:400]
        if "selector_ms" in row:       # the opt-in select_span: its window in the score step
            try:
                row[f"selector_span{SPAN}_ms"] = time_selector(
                    mod, SfiConfig, sh, ev, kn, lo, hi, kt, dev, SPAN)["ms"]
            except Exception as exc:
                row["selector_span_error"] = f"{type(exc).__name__}: {exc}"[:400]
            try:                       # sfi.keep_prefill: half the budget kept, excluded; the other half selected
                half = sh["k"] // 2
                kept = s_out[:, :, :half].clone()
                row["selector_keep_ms"] = time_selector(
                    mod, SfiConfig, sh, ev, kn, lo, hi, kt - half, dev, 6, 6, exclude=kept)["ms"]
            except Exception as exc:
                row["selector_keep_error"] = f"{type(exc).__name__}: {exc}"[:400]
        for page in QUEST_PAGES:       # selector quest: the page scores that replace the dense pass
            try:
                from vllm_ext.kernels.quest_pages import quest_page_evidence
                reps = bound_pages(b, ctx, page, hkv, prob.d, prob.dtype, dev)
                ent = torch.arange(b, dtype=torch.int32, device=dev)
                row[f"quest_page{page}_evidence_ms"] = time_op(lambda: quest_page_evidence(
                    prob.query, *reps, prob.scale, ent, ent, lo, hi, page, ev), dev)["ms"]
                if page == QUEST_RERANK_PAGE:
                    row.update(time_quest_selection(mod, SfiConfig, sh, prob, reps, ent, lo, hi, kt, ev, dev))
                del reps
            except Exception as exc:
                row[f"quest_page{page}_error"] = f"{type(exc).__name__}: {exc}"[:400]
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
        row["maintenance_over_dense"] = row["maintenance_ms"] / row["dense_ms"]
        row["selector_over_dense"] = row["selector_ms"] / row["dense_ms"]
        row["meets_target"] = bool(row["maintenance_over_dense"] <= TARGET)
        if "evidence_extra_ms" in row:
            row["slow_step_overhead_ms"] = row["evidence_extra_ms"] + row["maintenance_ms"]
    return row


def main(argv=None):
    args = parse_args(__doc__.splitlines()[1], argv)
    dev = device_for(args)
    sh = shapes(args.smoke)
    env = env_info(dev)
    mod, SfiConfig, why = load_selector()
    state: dict = {"gather_fallback": None}
    rows = []
    for ctx in sh["ctxs"]:
        for batch in sh["batches"]:
            row = run_config(ctx, batch, sh, dev, mod, SfiConfig, state)
            rows.append(row)
            print(f"[e] ctx {ctx:6d} batch {batch:2d}: " + "  ".join(
                f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    payload = dict(bench="selector", env=env, smoke=args.smoke, baseline=BASELINE_NOTE,
                   selector_available=mod is not None, selector_skip_reason=why,
                   selector_gather_fallback=state["gather_fallback"],
                   selector_tiles=(dataclasses.asdict(mod.TILES) if mod is not None and hasattr(mod, "TILES")
                                   else None),
                   target=dict(maintenance_over_dense=TARGET, ctx_range=[32768, 131072],
                               note="the target: selector + gather <= 15 % of the layer's dense attention"),
                   shapes=dict(batches=sh["batches"], q_heads=sh["hq"], kv_heads=sh["hkv"],
                               head_size=sh["d"], k=sh["k"], dtype=str(sh["dtype"])),
                   timing="CUDA-graph replay median, per layer", rows=rows)
    write_json(args.out, "selector", payload)
    series = {}
    for b in sh["batches"]:
        rs = [r for r in rows if r["batch"] == b]
        xs = [r["ctx"] for r in rs]
        series[f"dense b{b}"] = (xs, [r["dense_ms"] * 1e3 for r in rs])
        if all("selector_ms" in r for r in rs):
            series[f"selector b{b}"] = (xs, [r["selector_ms"] * 1e3 for r in rs])
        series[f"gather b{b}"] = (xs, [r["gather_ms"] * 1e3 for r in rs])
    plot(args.out, "selector", f"slow-step maintenance per layer ({env['gpu']})", "context (tokens)",
         "time per layer (us)", series, logx=True, logy=True)
    return payload


if __name__ == "__main__":
    main()
