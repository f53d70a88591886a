"""The GPU driver's worker (bench/vllm_e2e.py ``_worker``): one subprocess per job, the only code that
imports vLLM or torch. Reads its job spec (JSON), writes events (JSON lines) the parent turns into
rows, checks and failures."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from e2e_models import MODELS, backend_of, make_prompts, param_count, speedsfi_section
from e2e_timing import decode_timing, kv_gbps, make_perf_row, sfi_summary, tokens_digest

class Events:
    def __init__(self, path: str):
        self.path = path

    def emit(self, **rec) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _torch_env() -> dict:
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), sms=p.multi_processor_count,
                    gpu_mem_gib=round(p.total_memory / 2 ** 30, 1))
    else:
        info["gpu"] = "none (CPU build)"
    return info


def worker_env(spec: dict, ev: Events) -> None:
    import torch
    info = _torch_env()
    if torch.cuda.is_available():
        nbytes = 1 << 30
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y.copy_(x)
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        ms = sorted(ts)[len(ts) // 2]
        info.update(copy_bytes=nbytes, copy_ms=ms, copy_gbps_rw=2 * nbytes / ms / 1e6,
                    copy_gbps_read=nbytes / ms / 1e6)
    ev.emit(type="env", **info)


def worker_c_ops(spec: dict, ev: Events) -> None:
    import torch
    res: dict[str, Any] = {"ops": {}}
    res.update(_torch_env())
    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except Exception as exc:
        res["ops"]["load"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800]}
        ev.emit(type="c_ops", **res)
        return
    res["ops"]["load"] = {"ok": True}
    torch.manual_seed(0)
    dt = torch.bfloat16

    def rms(x, w, eps=1e-6):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dt)

    def run(name, fn):
        try:
            out, ref = fn()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            scale = ref.float().abs().max().item() or 1.0
            res["ops"][name] = {"ok": bool(err <= 2e-2 * scale), "max_abs_err": err, "ref_max": scale}
        except Exception as exc:
            res["ops"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800]}

    x = torch.randn(64, 4096, device="cuda", dtype=dt)
    w = torch.randn(4096, device="cuda", dtype=dt)

    def f_rms():
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w, 1e-6)
        return out, rms(x, w)

    def f_fused():
        xi, r = x.clone(), torch.randn_like(x)
        ref_res = (x.float() + r.float()).to(dt)
        ref = rms(ref_res, w)
        torch.ops._C.fused_add_rms_norm(xi, r, w, 1e-6)
        return xi, ref

    def f_silu():
        g = torch.randn(64, 2 * 4096, device="cuda", dtype=dt)
        o = torch.empty(64, 4096, device="cuda", dtype=dt)
        torch.ops._C.silu_and_mul(o, g)
        return o, (torch.nn.functional.silu(g[:, :4096].float()) * g[:, 4096:].float()).to(dt)

    run("rms_norm", f_rms)
    run("fused_add_rms_norm", f_fused)
    run("silu_and_mul", f_silu)
    ev.emit(type="c_ops", **res)


def worker_imports(spec: dict, ev: Events) -> None:
    import importlib
    import importlib.metadata as md
    res: dict[str, Any] = {"failed": {}, "ok": []}
    mods = ["vllm", "vllm.entrypoints.llm", "vllm.v1.attention.backends.triton_attn",
            "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3", "vllm.vllm_flash_attn",
            "vllm_ext", "vllm_ext.backend.backend"]
    if spec.get("cpu"):
        mods = [m for m in mods if m != "vllm.vllm_flash_attn"]
    for m in mods:
        try:
            importlib.import_module(m)
            res["ok"].append(m)
        except Exception as exc:
            res["failed"][m] = f"{type(exc).__name__}: {exc}"[:600]
    try:
        import vllm_ext
        vllm_ext.register()
        res["ok"].append("vllm_ext.register()")
    except Exception as exc:
        res["failed"]["vllm_ext.register()"] = f"{type(exc).__name__}: {exc}"[:600]
    try:
        eps = md.entry_points(group="vllm.general_plugins")
        res["general_plugins"] = sorted(f"{e.name} = {e.value}" for e in eps)
    except Exception as exc:
        res["general_plugins"] = f"{type(exc).__name__}: {exc}"
    for name in ("vllm", "torch", "triton", "transformers"):
        try:
            res[name] = importlib.import_module(name).__version__
        except Exception:
            res[name] = None
    ev.emit(type="imports", **res)


def _graph_time_ms(fn, reps: int = 20) -> float:
    """Median time of ``fn`` replayed from a CUDA graph of ``reps`` launches (decode runs in graphs)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return sorted(ts)[len(ts) // 2]


def worker_kernels(spec: dict, ev: Events) -> None:
    """Dense decode of one layer at each (context, batch) point, bf16, the model's heads: our
    ``paged_decode`` (SFI's dense rows; ``dense_decode = paged_decode``) against the delegate's kernel
    (vLLM's ``TritonAttentionImpl.forward``, i.e. ``unified_attention`` with the metadata its builder
    makes for a decode batch: the 3D split kernel at small batches), both in CUDA graphs. The faster
    one is what dense decode rows should take."""
    import types

    import torch
    from vllm.v1.attention.backends import triton_attn as ta

    from vllm_ext.backend.dense_path import paged_decode_workspace
    from vllm_ext.kernels.dense_decode_evidence import paged_decode

    hq, hkv, d = spec["heads"], spec["kv_heads"], spec["head_dim"]
    bs, dt, dev = 16, torch.bfloat16, torch.device("cuda")
    scale = d ** -0.5
    impl = ta.TritonAttentionImpl(hq, d, scale, hkv, None, None, "auto", None)
    ones = torch.ones((), dtype=torch.float32, device=dev)
    layer = types.SimpleNamespace(_q_scale=ones, _k_scale=ones, _v_scale=ones, _prob_scale=ones)
    for ctx, batch in spec["points"]:
        rec: dict[str, Any] = dict(context=ctx, batch=batch, heads=hq, kv_heads=hkv, head_dim=d, dtype="bfloat16")
        try:
            per = -(-ctx // bs)
            nb = per * batch + 1
            kv = torch.randn(nb, bs, hkv, 2 * d, dtype=dt, device=dev).transpose(1, 2)   # LBNHC strides
            bt = torch.randperm(nb - 1, device=dev)[:per * batch].to(torch.int32).view(batch, per)
            seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, hq, d, dtype=dt, device=dev)
            out_a, out_b = torch.empty_like(q), torch.empty_like(q)
            ws = paged_decode_workspace(max_rows=batch, num_heads=hq, num_kv_heads=hkv, head_size=d,
                                        max_len=ctx + 256, device=dev)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            thr = ta.MIN_LAUNCH_GRID_SIZE_2D // hkv
            seg = ta.NUM_PAR_SOFTMAX_SEGMENTS
            dp = 1 << (d - 1).bit_length()
            f32 = dict(dtype=torch.float32, device=dev)
            md = ta.TritonAttentionMetadata(
                num_actual_tokens=batch, max_query_len=1, query_start_loc=qsl, max_seq_len=ctx, seq_lens=seq,
                block_table=bt, slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev),
                seq_threshold_3D=thr, num_par_softmax_segments=seg,
                softmax_segm_output=torch.empty(max(thr, batch), hq, seg, dp, **f32),
                softmax_segm_max=torch.empty(max(thr, batch), hq, seg, **f32),
                softmax_segm_expsum=torch.empty(max(thr, batch), hq, seg, **f32), causal=True)
            rec["delegate_kernel"] = "3D (split)" if batch <= thr else "2D"
            ms_pd = _graph_time_ms(lambda: paged_decode(q, kv, bt, seq, scale, out_a, workspace=ws))
            ms_dl = _graph_time_ms(lambda: impl.forward(layer, q, q, q, kv, md, out_b))
            nbytes = batch * ctx * hkv * d * 2 * 2
            rec.update(paged_decode_us=1e3 * ms_pd, delegate_us=1e3 * ms_dl,
                       paged_decode_gbps=nbytes / (ms_pd * 1e-3) / 1e9, delegate_gbps=nbytes / (ms_dl * 1e-3) / 1e9,
                       faster="paged_decode" if ms_pd <= ms_dl else "delegate",
                       max_abs_diff=float((out_a.float() - out_b.float()).abs().max()))
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:800]
            rec["traceback"] = traceback.format_exc()[-2000:]
        ev.emit(type="kernel", **rec)
        print(f"[worker] kernels {rec}", flush=True)


def _sharpen(model, seed: int = 1234, std: float = 0.02) -> float:
    """Re-draw every weight in place: matrices N(0, std) (one seeded generator per parameter, in name
    order), norm weights 1, other vectors 0. Returns a checksum (identical across engines)."""
    import torch
    total = 0.0
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters(), key=lambda kv: kv[0])):
            if not p.is_floating_point():
                continue
            if p.dim() <= 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                g = torch.Generator(device=p.device)
                g.manual_seed(seed + i)
                p.normal_(0.0, std, generator=g)
            if i < 6:
                total += float(p.float().abs().sum().item())
    return total


def _runner_info(worker) -> dict:
    w = getattr(worker, "worker", worker)
    mr = getattr(w, "model_runner", None)
    info: dict[str, Any] = {"runner": f"{type(mr).__module__}.{type(mr).__name__}" if mr is not None else None}
    try:
        cc = mr.compilation_config
        info["cudagraph_mode"] = str(cc.cudagraph_mode)
        info["cudagraph_capture_sizes"] = list(cc.cudagraph_capture_sizes or [])
        info["compilation_mode"] = str(cc.mode)
        info["custom_ops"] = list(cc.custom_ops or [])
    except Exception as exc:
        info["compilation_error"] = f"{type(exc).__name__}: {exc}"
    try:
        groups = getattr(mr, "attn_groups", None) or []
        names = set()
        for gl in groups:
            for g in gl:
                names.add(getattr(g.backend, "__name__", str(g.backend)))
        info["attention_backends"] = sorted(names)
    except Exception:
        pass
    return info


def _engine_kwargs(spec: dict) -> dict:
    cpu = spec.get("cpu")
    section = speedsfi_section(spec["config"], spec["max_model_len"], cpu, spec["max_num_seqs"])
    kw: dict[str, Any] = dict(model=spec["model_dir"], tokenizer=spec["model_dir"], load_format="dummy",
                              dtype="float32" if cpu else "bfloat16", seed=0, enforce_eager=spec["eager"],
                              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                              enable_prefix_caching=False, disable_log_stats=False)
    backend = backend_of(spec["config"], cpu)
    if backend is not None:                   # None: the backend vLLM picks (vllm_default)
        kw["attention_backend"] = backend
    if section is not None:
        kw["additional_config"] = {"speedsfi": section}
    cc: dict[str, Any] = {}
    if spec.get("custom_ops_none"):
        cc["custom_ops"] = ["none"]
    if any(g.get("profile_steps") for g in spec["groups"]):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": _profile_dir(spec)}
    if not spec["eager"]:
        sizes = {1, 2, 4} | {g["batch_cap"] for g in spec["groups"] if isinstance(g["batch_cap"], int)}
        if any(not isinstance(g["batch_cap"], int) for g in spec["groups"]):
            sizes |= set(range(8, spec["max_num_seqs"] + 1, 8))     # "max": every batch that may fit
        sizes = sorted(sizes)
        sizes = [s for s in sizes if s <= spec["max_num_seqs"]] or [1]
        mode = spec.get("graph_mode", "full_decode")
        if mode == "full_decode":
            cc.update(mode="NONE", cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=sizes)
        elif mode == "piecewise":
            cc.update(mode="VLLM_COMPILE", cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=sizes)
        else:                                 # "vllm_default": vLLM's own compilation defaults
            cc.update(cudagraph_capture_sizes=sizes)
    if cc:
        kw["compilation_config"] = cc
    if cpu:
        kw.update(kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=256, block_size=32)
    else:
        kw.update(gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.9))
        if spec.get("max_num_batched_tokens"):
            kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    return kw


def _profile_dir(spec: dict) -> str:
    return str(Path(tempfile.gettempdir()) / f"speedsfi_profile_{os.getpid()}")


def _kernel_table(llm, spec: dict, prompts: list[list[int]], steps: int, ev: Events, input_len: int) -> None:
    """A decode window's kernels (vLLM's torch profiler, ``steps`` decode steps after the batch's
    prefill): per kernel name, launches and GPU microseconds per step, per layer, and its longest
    launch (fast and slow steps run the same launches under FULL graphs: a slow step shows as the
    maintenance kernels' longest launch)."""
    from e2e_report import kernel_table

    out = Path(_profile_dir(spec))
    shutil.rmtree(out, ignore_errors=True)
    sched = llm.llm_engine.vllm_config.scheduler_config
    prefill_steps = -(-sum(len(p) for p in prompts) // max(sched.max_num_batched_tokens, 1)) + 4
    llm.start_profile(f"decode{input_len}", delay_iterations=prefill_steps, max_iterations=steps)
    _generate(llm, prompts, prefill_steps + steps + 8, f"prof{input_len}")
    llm.stop_profile()
    traces = []
    for _ in range(120):
        traces = sorted(out.rglob("*.json*"))
        if traces:
            break
        time.sleep(0.5)
    if not traces:
        ev.emit(type="error", phase="profile", error=f"no trace written under {out}")
        return
    time.sleep(2.0)                                          # the writer may still be flushing
    events = []
    for t in traces:
        opener = gzip.open if t.suffix == ".gz" else open
        with opener(t, "rt") as f:
            events += json.load(f).get("traceEvents", [])
    table = kernel_table(events, steps=steps, layers=MODELS[spec["model"]]["layers"])
    ev.emit(type="kernel_table", config=spec["config"], input_len=input_len, batch=len(prompts),
            profiled_steps=steps, **table)
    shutil.rmtree(out, ignore_errors=True)


def _generate(llm, prompts: list[list[int]], out_len: int, tag: str) -> dict:
    """All prompts at once through the engine's step loop (what ``LLM.generate`` does), timing each step."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    toks: dict[str, list[int]] = {r: [] for r in ids}
    first: dict[str, float] = {}
    metrics: dict[str, Any] = {}
    step_t: list[float] = []
    step_c: list[int] = []
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    n_steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        t = time.perf_counter()
        n_steps += 1
        dec = 0
        got = False
        for o in outs:
            new = list(o.outputs[0].token_ids) if o.outputs else []
            if not new:
                continue
            got = True
            if o.request_id not in toks:
                continue
            if toks[o.request_id]:
                dec += 1
            else:
                first[o.request_id] = t
            toks[o.request_id].extend(new)
            if o.finished and getattr(o, "metrics", None) is not None:
                metrics[o.request_id] = o.metrics
        if got:
            step_t.append(t)
            step_c.append(dec)
    t_end = time.perf_counter()
    res = {"tokens": [toks[r] for r in ids], "e2e_s": t_end - t0, "engine_steps": n_steps,
           "ttft_s": [first[r] - t0 if r in first else None for r in ids], "step_t": step_t, "step_c": step_c}
    ttft_v, tpot_v = [], []
    for r in ids:
        m = metrics.get(r)
        if m is None:
            continue
        if getattr(m, "first_token_latency", 0):
            ttft_v.append(m.first_token_latency)
        n = getattr(m, "num_generation_tokens", 0)
        if n > 1 and getattr(m, "last_token_ts", 0) and getattr(m, "first_token_ts", 0):
            tpot_v.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    res["ttft_ms_vllm"] = 1e3 * sum(ttft_v) / len(ttft_v) if ttft_v else None
    res["tpot_ms_vllm"] = 1e3 * sum(tpot_v) / len(tpot_v) if tpot_v else None
    return res


def _counters() -> dict[str, int]:
    try:
        from vllm_ext import metrics
        return {k: int(v) for k, v in metrics.totals().items()}
    except Exception:
        return {}


def _diff(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) - before.get(k, 0)}


def worker_engine(spec: dict, ev: Events) -> int:
    t0 = time.time()
    cpu = spec.get("cpu")
    model = spec["model"]
    try:
        import vllm_ext
        vllm_ext.register()                  # no pip install here: the entry point may be absent
    except Exception as exc:
        ev.emit(type="error", phase="init", error=f"vllm_ext.register(): {type(exc).__name__}: {exc}",
                traceback=traceback.format_exc())
        return 3
    kw = _engine_kwargs(spec)
    ev.emit(type="info", engine_kwargs={k: v for k, v in kw.items() if k not in ("model", "tokenizer")})
    try:
        from vllm import LLM
        llm = LLM(**kw)
    except Exception as exc:
        ev.emit(type="error", phase="init", error=f"{type(exc).__name__}: {exc}"[:1500],
                traceback=traceback.format_exc())
        return 3
    startup = time.time() - t0
    vc = llm.llm_engine.vllm_config
    engine: dict[str, Any] = {"startup_s": round(startup, 1)}
    try:
        engine.update(num_gpu_blocks=vc.cache_config.num_gpu_blocks, block_size=vc.cache_config.block_size,
                      async_scheduling=getattr(vc.scheduler_config, "async_scheduling", None),
                      max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                      max_num_seqs=vc.scheduler_config.max_num_seqs, enforce_eager=vc.model_config.enforce_eager,
                      cudagraph_mode_config=str(vc.compilation_config.cudagraph_mode))
        engine["kv_cache_tokens"] = (engine["num_gpu_blocks"] or 0) * engine["block_size"]
    except Exception as exc:
        engine["config_error"] = f"{type(exc).__name__}: {exc}"
    try:
        engine.update(llm.collective_rpc(_runner_info)[0])
    except Exception as exc:
        engine["runner_info_error"] = f"{type(exc).__name__}: {exc}"
    engine.update({k: v for k, v in _torch_env().items() if k in ("gpu", "torch", "triton", "cuda")})
    try:
        import vllm
        engine["vllm"] = vllm.__version__
    except Exception:
        pass
    cg = engine.get("cudagraph_mode") or engine.get("cudagraph_mode_config") or "NONE"
    engine["cuda_graphs"] = (not spec["eager"]) and "NONE" not in cg.upper().replace("CUDAGRAPHMODE.", "")
    if spec.get("weights", "sharp") == "sharp":
        try:
            engine["weights_checksum"] = llm.apply_model(_sharpen)[0]
            engine["weights"] = "sharp N(0, 0.02), norms 1"
        except Exception as exc:
            engine["weights"] = "dummy (vLLM's uniform +-1e-3): re-drawing failed"
            engine["weights_error"] = f"{type(exc).__name__}: {exc}"
    else:
        engine["weights"] = "dummy (vLLM's uniform +-1e-3)"
    ev.emit(type="engine", **engine)
    vocab = MODELS[model]["vocab"]
    block = engine.get("block_size") or 16
    nblocks = engine.get("num_gpu_blocks") or 0
    status = 0
    # warm-up: compiles (and autotunes) the kernels of prefill, decode and SFI's slow and fast steps
    # for every batch size the plan measures, with short prompts, outside the measurements
    if spec["stage"] in ("perf", "sfi_perf", "critiprefill"):
        try:
            tw = time.time()
            n = min(3400, spec["max_model_len"] - 80)
            sizes = {1} | {min(int(g["batch_cap"]), spec["max_num_seqs"]) for g in spec["groups"]
                           if isinstance(g["batch_cap"], int)}
            for wb in sorted(sizes, reverse=True):
                _generate(llm, make_prompts(vocab, [n] * wb, seed=99 + wb), 40, f"warmup-{wb}")
            ev.emit(type="info", warmup_s=round(time.time() - tw, 1), warmup_batches=sorted(sizes))
        except Exception as exc:
            ev.emit(type="error", phase="warmup", error=f"{type(exc).__name__}: {exc}"[:1500],
                    traceback=traceback.format_exc())
            return 4
    for gi, g in enumerate(spec["groups"]):
        try:
            before = _counters()
            if g["kind"] == "greedy":
                prompts = make_prompts(vocab, g["lengths"], seed=7)
                r = _generate(llm, prompts, g["output_len"], f"g{gi}")
                counters = _diff(_counters(), before)
                ev.emit(type="greedy", model=model, config=spec["config"], lengths=g["lengths"],
                        output_len=g["output_len"], tokens=r["tokens"], tokens_sha=tokens_digest(r["tokens"]),
                        counters=counters, weights_checksum=engine.get("weights_checksum"),
                        e2e_s=round(r["e2e_s"], 2), cuda_graphs=engine["cuda_graphs"])
                continue
            n, o = g["input_len"], g["output_len"]
            per_seq = -(-(n + o) // block)
            fit = nblocks // per_seq if per_seq else 0
            cap = g["batch_cap"]
            batch = fit if cap == "max" else min(int(cap), fit)
            batch = min(batch, spec["max_num_seqs"])
            if batch < 1:
                ev.emit(type="row", **make_perf_row(input_len=n, output_len=o, batch=0, max_concurrency=fit,
                                                    error=f"does not fit: {nblocks} blocks of {block} tokens"))
                continue
            prompts = make_prompts(vocab, [n] * batch, seed=1000 + n)
            r = _generate(llm, prompts, o, f"p{gi}")
            counters = _diff(_counters(), before)
            timing = decode_timing(r["step_t"], r["step_c"], batch)
            sfi = sfi_summary(counters, batch, n, o)
            kv = kv_gbps(model, batch, n, o, timing["tpot_ms"], sfi["kv_read_fraction"],
                         dtype_bytes=4 if cpu else 2)
            kv.pop("kv_read_fraction")
            ttft = [x for x in r["ttft_s"] if x is not None]
            wbytes = param_count(model) * (4 if cpu else 2)
            row = make_perf_row(
                input_len=n, output_len=o, batch=batch, batch_requested=cap, max_concurrency=fit,
                cuda_graphs=engine["cuda_graphs"], cudagraph_mode=engine.get("cudagraph_mode"),
                tpot_ms=timing["tpot_ms"], tpot_ms_median=timing["tpot_ms_median"], max_step_ms=timing["max_step_ms"],
                decode_steps_measured=timing["decode_steps"], steps_over_5x_median=timing["steps_over_5x_median"],
                tpot_ms_vllm=r["tpot_ms_vllm"],
                ttft_ms=(1e3 * sum(ttft) / len(ttft)) if ttft else None,
                ttft_ms_first=(1e3 * min(ttft)) if ttft else None, ttft_ms_last=(1e3 * max(ttft)) if ttft else None,
                ttft_ms_vllm=r["ttft_ms_vllm"], e2e_s=r["e2e_s"],
                # every prompt token over the time until the last request's first token: the
                # prefill rate the whole batch got (TTFT's mean hides which steps were slow)
                prefill_tok_s=(batch * n / max(ttft)) if ttft and max(ttft) > 0 else None,
                output_tok_s=batch * o / r["e2e_s"] if r["e2e_s"] else None,
                decode_tok_s=(batch / (timing["tpot_ms"] * 1e-3)) if timing["tpot_ms"] else None,
                weight_bytes=wbytes,
                step_gbps=((kv["kv_bytes_per_step"] * sfi["kv_read_fraction"] + wbytes) / (timing["tpot_ms"] * 1e-3) / 1e9)
                if timing["tpot_ms"] else None,
                tokens_sha=tokens_digest(r["tokens"]), counters=counters, **kv, **sfi)
            ev.emit(type="row", **row)
            if g.get("profile_steps"):
                _kernel_table(llm, spec, prompts, int(g["profile_steps"]), ev, n)
            print(f"[worker] {spec['config']} {'eager' if spec['eager'] else 'graph'} in {n} x{batch}: "
                  f"TPOT {row['tpot_ms']} ms, TTFT {row['ttft_ms']} ms, {row['output_tok_s']} tok/s "
                  f"({time.time() - t0:.0f} s)", flush=True)
        except Exception as exc:
            text = traceback.format_exc()
            ev.emit(type="error", phase="group", input_len=g.get("input_len"),
                    error=f"{type(exc).__name__}: {exc}"[:1500], traceback=text)
            status = 5
            if re.search(r"CUDA error|illegal memory|device-side assert|out of memory", text):
                break                          # the CUDA context is gone or unusable: stop this engine
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return status


def worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    ev = Events(spec["events"])
    kind = spec["kind"]
    try:
        if kind == "env":
            worker_env(spec, ev)
            return 0
        if kind == "c_ops":
            worker_c_ops(spec, ev)
            return 0
        if kind == "imports":
            worker_imports(spec, ev)
            return 0
        if kind == "kernels":
            worker_kernels(spec, ev)
            return 0
        return worker_engine(spec, ev)
    except Exception as exc:
        ev.emit(type="error", phase=kind, error=f"{type(exc).__name__}: {exc}"[:1500],
                traceback=traceback.format_exc())
        return 6


