#!/usr/bin/env python3
"""(g) The SFI decode path as the backend runs it, in a model-shaped decode loop (labelled model-shaped).

    python bench/bench_sfi_path.py --out bench/results                 # CUDA
    python bench/bench_sfi_path.py --out /tmp/b --smoke                # CPU, tiny, PyTorch twins

Not a model: random bf16 weights in the shapes of Llama-3.1-8B and Qwen3-4B, every layer doing RMSNorm,
the fused QKV GEMM, the KV write of the new token, attention, the output GEMM, RMSNorm, gate/up,
SiLU-and-mul and down, then the final norm and the LM head. To fit 128K x batch 16 on one GPU all
layers read the same weights and one shared KV cache (each far larger than L2, so the bytes moved per
layer are a real model's); the compact segments are per layer, as in the backend.

What runs per decode step, for ``steps`` (>= 256) steps with the context growing by one token:
- ``dense``: :func:`paged_decode` in every layer (our split-K kernel at the copy bandwidth);
- ``sfi``: the backend's own code: the step plan (:meth:`SfiSlotTables.plan`: schedule on the device,
  compacted slow rows, persistent buffers; eager, as the metadata builder runs it) and then the whole
  step replayed from one CUDA graph with :func:`vllm_ext.methods.sfi.path.sfi_decode` in every layer
  (one dense pass for slow rows with evidence + key norms, the two-segment pass for fast rows,
  selector + gather over the compacted slow list on the side stream, one join);
- ``sfi_serial``: the same with maintenance on the main stream (``dual_stream = false``);
- ``sfi_fast_only``: no triggers and no refresh after the first selection: every step fast.

With ``--modes`` (``bench/QUALITY.md``, Quest-style selection; results in ``sfi_path_quest.json``):
- ``quest``: ``sfi.selector = "quest"`` with 16-token pages and a selection every step (schedule
  periodic, refresh 1): each layer updates its newest page's max/min of K, scores every page with the
  query, runs the selector's top-K over the context and gathers ``k`` tokens, then the two-segment pass;
- ``quest_keep``: the same with 8-token pages and ``keep_prefill`` = k/2 (the quality runs' best): the
  kept half stays, each step selects and gathers the other half;
- ``quest_rerank``: 16-token pages with ``quest_rerank`` 4 (the quality runs' best without a kept set):
  each step also takes the top 4k tokens by page bound as candidates, reads their K for the group's
  attention mass and selects ``k`` of them. Per layer the page table is
  ``(batch + 1) x 2 x ctx/page x Hkv x D``; it is shared by all layers here (as the KV cache), so the
  bytes read per layer are a real model's.

The schedule is realistic: each row's last token is a trigger with probability 1/24 per step (a
sentence end every ~24 tokens, as in prose) on top of the refresh budget (32); the rows' phases are
random, so at batch 16 most steps carry a slow row. ``sfi_ms`` is the mean per step over the whole
run (plan + replay, slow steps included), timed with CUDA events around the loop.
Writes ``sfi_path.json`` (``rows``: model, ctx, batch, dense_ms, sfi_ms, sfi_serial_ms,
fast_only_ms, slow_fraction, speedup, kv_gbps, ...) and ``sfi_path.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataclasses  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import copy_bandwidth, device_for, env_info, parse_args, plot, write_json  # noqa: E402

MODELS = {
    "Llama-3.1-8B": dict(layers=32, hidden=4096, hq=32, hkv=8, d=128, inter=14336, vocab=128256),
    "Qwen3-4B": dict(layers=36, hidden=2560, hq=32, hkv=8, d=128, inter=9728, vocab=151936),
}
SMOKE_MODELS = {"tiny": dict(layers=2, hidden=64, hq=4, hkv=2, d=16, inter=128, vocab=256)}
TRIGGER_P = 1.0 / 24
TRIGGER_ID = 1
BLOCK = 16


class PathLoop:
    """A model-shaped decode loop over one shared paged KV cache and per-layer SFI buffers."""

    def __init__(self, cfg: dict, batch: int, ctx: int, steps: int, dtype, device, sfi_cfg,
                 seed: int = 0):
        from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
        from vllm_ext.kernels.dense_decode_evidence import dense_decode_workspace
        from vllm_ext.kernels.two_segment_decode import dense_num_splits

        self.cfg, self.batch, self.ctx, self.steps, self.dtype, self.device = (
            cfg, batch, ctx, steps, dtype, device)
        self.sfi_cfg = sfi_cfg
        h, hq, hkv, d = cfg["hidden"], cfg["hq"], cfg["hkv"], cfg["d"]
        g = torch.Generator(device="cpu").manual_seed(seed)
        torch.manual_seed(seed)

        def w(o, i):
            return (torch.randn(o, i, device=device) * i ** -0.5).to(dtype)
        self.w_qkv, self.w_o = w((hq + 2 * hkv) * d, h), w(h, hq * d)
        self.w_gu, self.w_down = w(2 * cfg["inter"], h), w(h, cfg["inter"])
        self.w_lm = w(cfg["vocab"], h)
        self.ln = torch.ones(h, dtype=dtype, device=device)
        self.x0 = torch.randn(batch, h, device=device).to(dtype)
        self.max_len = ctx + steps + 1
        mb = -(-self.max_len // BLOCK)
        nb = batch * mb + 1
        self.kv_cache = (torch.randn(nb, BLOCK, hkv, 2 * d, device=device) * 0.5).to(dtype) \
            .transpose(1, 2)
        self.block_table = torch.randperm(nb - 1, generator=g)[: batch * mb].reshape(batch, mb) \
            .to(torch.int32).to(device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.scale = d ** -0.5
        self.attn_out = torch.empty(batch, hq, d, dtype=dtype, device=device)
        self.ns_dense = dense_num_splits(batch, hkv, self.max_len, device)
        self.ws_dense = dense_decode_workspace(batch, hq, d, self.ns_dense, device)
        self.layers = [SfiLayerBuffers(batch, hkv, sfi_cfg, d, dtype, device)
                       for _ in range(cfg["layers"])]
        self.quest = {}                      # mode -> (cfg, layers, runtime), built on first use
        self.runtimes = {dual: SfiRuntime(dataclasses.replace(sfi_cfg, dual_stream=dual),
                                          capacity=batch, max_rows=batch, num_heads=hq,
                                          num_kv_heads=hkv, head_size=d, max_len=self.max_len,
                                          device=device)
                         for dual in ((True, False) if device.type == "cuda" else (False,))}
        # the schedule's inputs: per step and row the last token (a trigger with prob. 1/24)
        trig = torch.rand(steps, batch, generator=g) < TRIGGER_P
        self.tokens = torch.where(trig, TRIGGER_ID, 7).to(torch.int32).to(device)
        self.no_triggers = torch.full_like(self.tokens, 7)

    # ------------------------------------------------------------------ state
    def quest_state(self, mode: str):
        """Quest modes: their config, per-layer buffers (one page table shared by all layers, filled
        from the shared KV cache) and runtime."""
        if mode in self.quest:
            return self.quest[mode]
        from vllm_ext.methods.sfi.path import quest_prefill_pages
        from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
        from vllm_ext.methods.sfi.slot_tables import QuestPrefillPages

        base = dict(selector="quest", schedule="periodic", refresh=1, dual_stream=False)
        keep = self.sfi_cfg.k // 2 if mode == "quest_keep" else 0
        cfg = dataclasses.replace(self.sfi_cfg, **base, page_size=8 if keep else 16, keep_prefill=keep,
                                  select_span=6 if keep else 0, select_span_back=6 if keep else 0,
                                  quest_rerank=4 if mode == "quest_rerank" else 0)
        cfg.validate()
        hq, hkv, d = self.cfg["hq"], self.cfg["hkv"], self.cfg["d"]
        first = SfiLayerBuffers(self.batch, hkv, cfg, d, self.dtype, self.device, max_len=self.max_len)
        idx = torch.arange(self.batch, device=self.device)
        quest_prefill_pages(self.kv_cache, self.block_table, QuestPrefillPages(
            rows=idx, seq_lens=torch.full((self.batch,), self.ctx, dtype=torch.int32, device=self.device),
            first_page=torch.zeros(self.batch, dtype=torch.int32, device=self.device),
            sfi_slot=idx.to(torch.int32), max_pages=-(-self.ctx // cfg.page_size)), cfg, first)
        layers = [first]
        for _ in range(self.cfg["layers"] - 1):
            layer = SfiLayerBuffers(self.batch, hkv, dataclasses.replace(cfg, selector="sfi"), d,
                                    self.dtype, self.device)
            layer.quest_pages, layer.quest_table = first.quest_pages, first.quest_table
            layers.append(layer)
        for layer in layers:
            layer.compact_len.fill_(cfg.n_sink + cfg.k)
            if keep:
                # kept positions spread over the context; their entries were gathered at prefill end
                pos = torch.linspace(cfg.n_sink, self.ctx - cfg.n_recent - 1, keep, device=self.device)
                layer.kept_pos = pos.to(torch.int32).expand(self.batch, hkv, keep).contiguous()
        rt = SfiRuntime(cfg, capacity=self.batch, max_rows=self.batch, num_heads=hq, num_kv_heads=hkv,
                        head_size=d, max_len=self.max_len, device=self.device)
        self.quest[mode] = (cfg, layers, rt)
        return self.quest[mode]

    def make_tables(self, *, fast_only: bool, cfg=None):
        from vllm_ext.config import SpeedSfiConfig
        from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

        cfg = cfg or self.sfi_cfg
        if fast_only:
            cfg = dataclasses.replace(cfg, refresh=10 ** 9)
        lut = torch.zeros(16, dtype=torch.bool, device=self.device)
        lut[TRIGGER_ID] = True
        # (the copy trigger's history, on by default, is sized here; its two per-step launches are
        # not in this bench's steps: they run once per step, before the layers)
        t = SfiSlotTables(self.batch + 1, self.batch, self.batch, SpeedSfiConfig(sfi=cfg), lut,
                          self.device, max_model_len=self.max_len)
        self.reset_tables(t, fast_only=fast_only)
        return t

    def reset_tables(self, t, *, fast_only: bool) -> None:
        """Fresh per-request state (the plan buffers stay: a captured graph reads them)."""
        idx = torch.arange(self.batch, device=self.device)
        t.apply_resets(idx, idx.to(torch.int32),
                       torch.full_like(idx, self.sfi_cfg.k, dtype=torch.int32),
                       torch.ones_like(idx, dtype=torch.bool))
        if t.cfg.selector == "quest":
            # the prefill wrote the context's pages; with keep_prefill it kept k/2 tokens
            t.page_upto[: self.batch] = self.ctx
            t.has_selection[: self.batch] = True
            if t.cfg.keep_prefill:
                t.n_kept[: self.batch] = t.cfg.keep_prefill
        elif not fast_only:
            # stagger the refresh phases (requests started at different times)
            g = torch.Generator(device="cpu").manual_seed(1)
            t.steps_since_slow[: self.batch] = torch.randint(
                0, self.sfi_cfg.refresh, (self.batch,), generator=g, dtype=torch.int32).to(self.device)
        t.stats.zero_()

    # ------------------------------------------------------------------ one step
    def _rms(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.ln

    def _write_kv(self, k, v):
        d = self.cfg["d"]
        pos = (self.seq_lens - 1).long()
        blk = self.block_table.gather(1, (pos // BLOCK)[:, None])[:, 0].long()
        off = pos % BLOCK
        self.kv_cache[blk, :, off, :d] = k
        self.kv_cache[blk, :, off, d:] = v

    def step(self, mode: str, plan=None, rt=None):
        from vllm_ext.methods.sfi.path import sfi_decode
        from vllm_ext.kernels.dense_decode_evidence import paged_decode

        sfi_cfg, layers = self.sfi_cfg, self.layers
        if mode.startswith("quest"):
            sfi_cfg, layers, _ = self.quest_state(mode)
        cfg = self.cfg
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
        x = self.x0
        for li in range(cfg["layers"]):
            hdn = self._rms(x)
            qkv = hdn @ self.w_qkv.t()
            q = qkv[:, :hq * d].view(-1, hq, d)
            self._write_kv(qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d),
                           qkv[:, (hq + hkv) * d:].view(-1, hkv, d))
            if mode == "dense":
                paged_decode(q, self.kv_cache, self.block_table, self.seq_lens, self.scale,
                             self.attn_out, num_splits=self.ns_dense, workspace=self.ws_dense)
            else:
                sfi_decode(q, self.kv_cache, self.block_table, self.seq_lens, plan, sfi_cfg,
                           layers[li], rt, li, self.scale, self.attn_out, dense_done=False)
            x = x + self.attn_out.reshape(-1, hq * d) @ self.w_o.t()
            gu = self._rms(x) @ self.w_gu.t()
            gg, u = gu.chunk(2, dim=-1)
            x = x + (F.silu(gg) * u) @ self.w_down.t()
        if rt is not None:
            rt.ring.join()
        return self._rms(x) @ self.w_lm.t()

    # ------------------------------------------------------------------ the run
    def run(self, mode: str) -> dict:
        """Mean per-step ms over ``steps`` steps (plan + step), and the slow-row statistics."""
        dev = self.device
        cuda = dev.type == "cuda"
        fast_only = mode == "sfi_fast_only"
        if mode.startswith("quest"):
            qcfg, _, rt = self.quest_state(mode)
            tables = self.make_tables(fast_only=False, cfg=qcfg)
        else:
            rt = None if mode == "dense" else self.runtimes[mode == "sfi" and cuda]
            tables = None if mode == "dense" else self.make_tables(fast_only=fast_only)
        tokens = self.no_triggers if fast_only else self.tokens
        rows = torch.arange(self.batch, dtype=torch.int32, device=dev)
        decode = torch.ones(self.batch, dtype=torch.int32, device=dev)
        self.seq_lens.fill_(self.ctx)

        def plan(i):
            if tables is None:
                return None
            return tables.plan(row_slot=rows, row_last_token=tokens[i], row_is_decode=decode,
                               seq_lens=self.seq_lens, block_table=self.block_table)

        # warm-up (compiles/autotunes outside capture), then capture one step over the plan buffers
        p0 = plan(0)
        self.step(mode, p0, rt)
        graph = None
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(mode, p0, rt)
            torch.cuda.synchronize()
        if tables is not None:            # warm-up and capture touched the state: start clean
            self.reset_tables(tables, fast_only=fast_only)
            if fast_only:                 # one slow step makes the selection, then every step is fast
                plan(0)
                self.step(mode, p0, rt)
                tables.stats.zero_()
        self.seq_lens.fill_(self.ctx)
        if cuda:
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
        else:
            import time
            c0 = time.perf_counter()
        for i in range(self.steps):
            plan(i)
            if graph is not None:
                graph.replay()
            else:
                self.step(mode, p0, rt)
            self.seq_lens.add_(1)
        if cuda:
            t1.record()
            torch.cuda.synchronize()
            ms = t0.elapsed_time(t1) / self.steps
        else:
            ms = (time.perf_counter() - c0) * 1e3 / self.steps
        out = {"ms": ms}
        if tables is not None:
            from vllm_ext.methods.sfi.step_plan import STAT_FAST, STAT_SLOW
            st = tables.stats.tolist()
            rows_total = self.steps * self.batch
            out.update(slow_rows=st[STAT_SLOW], fast_rows=st[STAT_FAST],
                       slow_fraction=st[STAT_SLOW] / rows_total)
        return out

    def bytes_per_step(self, mode: str, slow_fraction: float = 0.0) -> dict:
        cfg = self.cfg
        el = torch.empty((), dtype=self.dtype).element_size()
        weights = sum(t.numel() for t in (self.w_qkv, self.w_o, self.w_gu, self.w_down)) \
            * cfg["layers"] * el + self.w_lm.numel() * el
        per_tok = cfg["hkv"] * 2 * cfg["d"] * el * cfg["layers"]            # K+V of one position
        t = self.ctx + self.steps / 2
        if mode == "dense":
            kv = self.batch * t * per_tok
        elif mode.startswith("quest"):
            s, _, _ = self.quest_state(mode)
            # sink + selected + recent, the page table (2 vectors per page vs 2 per token) and the
            # candidates' K (quest_rerank: half of each candidate row)
            cand = s.quest_rerank * (s.k - s.keep_prefill) / 2
            kv = self.batch * (s.n_sink + s.k + s.n_recent + t / s.page_size + cand) * per_tok
        else:
            s = self.sfi_cfg
            fast = s.n_sink + s.k + s.n_recent
            kv = self.batch * ((1 - slow_fraction) * fast + slow_fraction * t) * per_tok
        return {"weights": weights, "kv": kv}


QUEST_MODES = ("quest", "quest_keep", "quest_rerank")

def shapes(smoke: bool) -> dict:
    from vllm_ext.methods.sfi.config import SfiConfig

    if smoke:
        return dict(models=SMOKE_MODELS, batches=[2], ctxs=[160], steps=8, dtype=torch.float32,
                    sfi=SfiConfig(enabled=True, k=32, k_min=4, n_sink=4, n_recent=16, refresh=4))
    return dict(models=MODELS, batches=[1, 4, 16], ctxs=[8192, 32768, 131072], steps=256,
                dtype=torch.bfloat16, sfi=SfiConfig(enabled=True))


def main(argv=None):
    def extra(ap):
        ap.add_argument("--models", default=None, help="comma list (default: all)")
        ap.add_argument("--ctxs", default=None, help="comma list of contexts")
        ap.add_argument("--batches", default=None, help="comma list of batch sizes")
        ap.add_argument("--steps", type=int, default=None)
        ap.add_argument("--modes", default=None,
                        help="comma list of modes (default: dense,sfi,sfi_serial,sfi_fast_only on CUDA); "
                             "with quest, quest_keep or quest_rerank the results go to sfi_path_quest.json")
        ap.add_argument("--profile", default=None, metavar="MODE",
                        help="instead of the sweep: torch.profiler kernel table of MODE (dense, sfi, "
                             "sfi_fast_only) for the first model/ctx/batch, written to "
                             "sfi_path_profile_MODE.txt")

    args = parse_args(__doc__.splitlines()[1], argv, extra)
    dev = device_for(args)
    sh = shapes(args.smoke)
    models = sh["models"] if not args.models else {m: sh["models"][m] for m in args.models.split(",")}
    ctxs = [int(c) for c in args.ctxs.split(",")] if args.ctxs else sh["ctxs"]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else sh["batches"]
    steps = args.steps or sh["steps"]
    env = env_info(dev)
    if args.profile:
        return profile(args, models, ctxs, batches, steps, sh, dev)
    copy = copy_bandwidth(dev)
    rows = []
    modes = ["dense", "sfi", "sfi_serial", "sfi_fast_only"] if dev.type == "cuda" else \
        ["dense", "sfi", "sfi_fast_only"]
    if args.modes:
        modes = args.modes.split(",")
        unknown = set(modes) - {"dense", "sfi", "sfi_serial", "sfi_fast_only", *QUEST_MODES}
        if unknown or (dev.type != "cuda" and "sfi_serial" in modes):
            raise SystemExit(f"bench_sfi_path: unknown modes {sorted(unknown)} (sfi_serial needs CUDA)")
    quest_run = any(m.startswith("quest") for m in modes)
    for name, cfg in models.items():
        for ctx in ctxs:
            for batch in batches:
                loop = PathLoop(cfg, batch, ctx, steps, sh["dtype"], dev, sh["sfi"])
                row = dict(model=name, ctx=ctx, batch=batch, steps=steps)
                with torch.inference_mode():
                    for mode in modes:
                        try:
                            r = loop.run(mode)
                        except Exception as exc:         # record, keep going
                            row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:400]
                            print(f"[g] {name} ctx {ctx} batch {batch} {mode}: {row[f'{mode}_error']}",
                                  flush=True)
                            continue
                        key = "fast_only" if mode == "sfi_fast_only" else mode
                        row[f"{key}_ms"] = r["ms"]
                        if mode == "sfi":
                            row["slow_fraction"] = r["slow_fraction"]
                            row["slow_rows"] = r["slow_rows"]
                        if mode.startswith("quest"):
                            row[f"{mode}_selection_rows"] = r["slow_rows"]
                            if "dense_ms" in row:
                                row[f"{mode}_speedup"] = row["dense_ms"] / r["ms"]
                                b = loop.bytes_per_step(mode)
                                row[f"{mode}_kv_gbps"] = (b["weights"] + b["kv"]) / r["ms"] / 1e6
                if "dense_ms" in row and "sfi_ms" in row:
                    row["speedup"] = row["dense_ms"] / row["sfi_ms"]
                    b = loop.bytes_per_step("sfi", row.get("slow_fraction", 0.0))
                    bd = loop.bytes_per_step("dense")
                    row["kv_gbps"] = (b["weights"] + b["kv"]) / row["sfi_ms"] / 1e6
                    row["dense_gbps"] = (bd["weights"] + bd["kv"]) / row["dense_ms"] / 1e6
                    row["tok_per_s_dense"] = batch * 1e3 / row["dense_ms"]
                    row["tok_per_s_sfi"] = batch * 1e3 / row["sfi_ms"]
                if "dense_ms" in row and "fast_only_ms" in row:
                    row["speedup_fast_only"] = row["dense_ms"] / row["fast_only_ms"]
                    if "speedup" in row:
                        row["whole_vs_fast_only"] = row["speedup"] / row["speedup_fast_only"]
                rows.append(row)
                print(f"[g] {name} ctx {ctx:6d} batch {batch:2d}: dense {row.get('dense_ms', 0):8.2f} ms"
                      f"  sfi {row.get('sfi_ms', 0):7.2f} ms (serial {row.get('sfi_serial_ms', 0):7.2f})"
                      f"  fast-only {row.get('fast_only_ms', 0):7.2f} ms  slow rows "
                      f"{row.get('slow_fraction', 0):.3f}  speed-up {row.get('speedup', 0):.2f}x"
                      f" (fast-only {row.get('speedup_fast_only', 0):.2f}x)"
                      + "".join(f"  {m} {row[m + '_ms']:7.2f} ms ({row.get(m + '_speedup', 0):.2f}x)"
                                for m in QUEST_MODES if m + "_ms" in row), flush=True)
                del loop
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    payload = dict(bench="sfi_path", label="model-shaped (random weights, not a model); the backend's "
                   "own SFI path (plan + sfi_decode + maintenance) in every layer",
                   env=env, copy_bandwidth=copy, smoke=args.smoke, dtype=str(sh["dtype"]),
                   sfi=dict(k=sh["sfi"].k, n_sink=sh["sfi"].n_sink, n_recent=sh["sfi"].n_recent,
                            refresh=sh["sfi"].refresh, trigger_probability=TRIGGER_P),
                   timing="mean per step over the whole run (plan eager + step replayed from a "
                          "CUDA graph), CUDA events around the loop",
                   kv_gbps="(weights + KV bytes the step must read) / sfi_ms",
                   modes=modes, rows=rows)
    stem = "sfi_path_quest" if quest_run else "sfi_path"
    if quest_run:
        payload["quest"] = ("selector quest, refresh 1: quest = page 16; quest_keep = page 8 with "
                            "keep_prefill k/2; quest_rerank = page 16 with quest_rerank 4; "
                            "quest*_kv_gbps counts the page table read (ctx/page entries of 2 vectors "
                            "per KV head) and the candidates' K")
    write_json(args.out, stem, payload)
    series = {}
    for name in models:
        for batch in batches:
            rs = [r for r in rows if r["model"] == name and r["batch"] == batch and "speedup" in r]
            if rs:
                series[f"{name} b{batch}"] = ([r["ctx"] for r in rs], [r["speedup"] for r in rs])
    for name in models:
        for batch in batches:
            for m in QUEST_MODES:
                rs = [r for r in rows if r["model"] == name and r["batch"] == batch and f"{m}_speedup" in r]
                if rs:
                    series[f"{name} b{batch} {m}"] = ([r["ctx"] for r in rs], [r[f"{m}_speedup"] for r in rs])
    plot(args.out, stem, f"SFI path speed-up over dense, whole run ({env['gpu']})",
         "context (tokens)", "speed-up (x)", series, logx=True)
    return payload


def profile(args, models, ctxs, batches, steps, sh, dev):
    """Per-kernel GPU time of ``steps`` steps of one configuration (what the graph replays)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    name, cfg = next(iter(models.items()))
    loop = PathLoop(cfg, batches[0], ctxs[0], steps, sh["dtype"], dev, sh["sfi"])
    with torch.inference_mode():
        loop.run(args.profile)                            # warm-up, compile, capture once
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            r = loop.run(args.profile)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    head = (f"{name} ctx {ctxs[0]} batch {batches[0]} mode {args.profile}: {r['ms']:.3f} ms/step "
            f"over {steps} steps (profiled run includes one warm-up + capture)\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"sfi_path_profile_{args.profile}.txt"
    path.write_text(head + table)
    print(head + table, flush=True)
    return {"profile": str(path)}


if __name__ == "__main__":
    main()
