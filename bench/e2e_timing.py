"""The GPU driver's timing rules (bench/vllm_e2e.py): what TPOT, TTFT, output tok/s and KV GB/s mean,
the rows' schema, token comparisons, and the time estimate of each job (the plan's deadline check
and the hang rule: a job is killed at its own estimate x ``HANG_FACTOR``). No vLLM, no torch."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from e2e_models import MODELS, kv_bytes_per_token, param_count

# a job still running at HANG_FACTOR x its estimate is taken as hung and killed (its failure recorded)
HANG_FACTOR = 1.5


def hang_timeout(est_s: float) -> float:
    """The kill time of a job estimated at ``est_s`` seconds."""
    return HANG_FACTOR * float(est_s)


def kv_gbps(model: str, batch: int, input_len: int, output_len: int, tpot_ms: float | None,
            read_fraction: float = 1.0, dtype_bytes: int = 2) -> dict[str, float | None]:
    """KV bytes a decode step reads (mean context over the output: input + output / 2) / TPOT.

    ``kv_gbps``: the dense-equivalent rate (what dense attention must read in that time);
    ``kv_gbps_read``: the bytes actually read (``read_fraction`` from SFI's counters)."""
    ctx = input_len + output_len / 2.0
    nbytes = batch * ctx * kv_bytes_per_token(model, dtype_bytes)
    out: dict[str, float | None] = {"kv_bytes_per_step": nbytes, "kv_read_fraction": read_fraction}
    if not tpot_ms or tpot_ms <= 0:
        out.update(kv_gbps=None, kv_gbps_read=None)
        return out
    out["kv_gbps"] = nbytes / (tpot_ms * 1e-3) / 1e9
    out["kv_gbps_read"] = nbytes * read_fraction / (tpot_ms * 1e-3) / 1e9
    return out


def tokens_digest(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Identical? Per row: tokens equal before the first difference."""
    rows = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        rows.append({"first_diff": None if (n == len(x) == len(y)) else n, "len": [len(x), len(y)]})
    same = len(a) == len(b) and all(r["first_diff"] is None for r in rows)
    return {"identical": same, "rows": rows}


def decode_timing(step_times: list[float], step_counts: list[int], batch: int, skip: int = 8) -> dict:
    """TPOT from the steps in which every one of ``batch`` requests got one token (pure decode).

    ``step_times``: perf_counter at the end of each step that produced tokens; ``step_counts``: how
    many requests got a token in that step, counting only requests that already had one (i.e. a
    decode token). The first ``skip`` such steps are left out when enough remain (kernel variants
    compiled at the first steps). TPOT = mean interval between consecutive pure-decode steps."""
    t = [ts for ts, c in zip(step_times, step_counts) if c == batch]
    if len(t) - skip >= 16:
        t = t[skip:]
    if len(t) < 2:
        return {"tpot_ms": None, "tpot_ms_median": None, "max_step_ms": None, "decode_steps": len(t),
                "steps_over_5x_median": None}
    d = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    s = sorted(d)
    med = s[len(s) // 2]
    # long intervals: SFI slow steps, or a kernel compiled / autotuned inside the window
    return {"tpot_ms": (t[-1] - t[0]) * 1e3 / (len(t) - 1), "tpot_ms_median": med,
            "max_step_ms": s[-1], "decode_steps": len(t), "steps_over_5x_median": sum(x > 5 * med for x in d)}


def sfi_summary(counters: dict[str, int], batch: int, input_len: int, n_out: int) -> dict[str, Any]:
    """Counters of one measured group -> fast/slow steps, fast-step retained fraction and the KV
    read fraction over all decode steps (slow and dense rows read everything)."""
    fast_ctx = counters.get("sfi.fast_context_tokens", 0)
    ret = counters.get("sfi.fast_retained_tokens", 0)
    total_ctx = batch * sum(input_len + i for i in range(1, n_out))
    return {"sfi_fast_steps": counters.get("sfi.fast_steps", 0),
            "sfi_slow_steps": counters.get("sfi.slow_steps", 0),
            "sfi_dense_rows": counters.get("sfi.dense_rows", 0),
            "sfi_fast_retained_fraction": (ret / fast_ctx) if fast_ctx else None,
            "kv_read_fraction": ((total_ctx - fast_ctx + ret) / total_ctx) if total_ctx else 1.0,
            "fallbacks": {k: v for k, v in counters.items() if k.startswith("fallback.") and v}}


PERF_ROW_KEYS = ("backend", "config", "model", "mode", "cuda_graphs", "input_len", "output_len",
                 "batch", "tpot_ms", "ttft_ms", "output_tok_s")


def make_perf_row(**kw) -> dict[str, Any]:
    """A perf row with every required key present (None where not measured)."""
    row = {k: None for k in PERF_ROW_KEYS}
    row.update(max_concurrency=None, kv_gbps=None, error=None)
    row.update(kw)
    return row


def est_engine_s(model: str, groups: list[dict], eager: bool, cpu: bool, warmup: bool = False) -> float:
    """A wall-time estimate of one engine job on an H100 (the plan's deadline check, and its kill
    time x HANG_FACTOR): import + engine start (+ graph capture), the perf warm-up, then per group
    the prefill (weights at 500 TFLOP/s, attention at 200) and the decode steps (weights + KV at
    2.6 TB/s, + launch cost per layer when eager)."""
    if cpu:
        # the CPU build (tests): a tiny model on a shared 2-core machine, start-up dominated
        return 60.0 + sum(g["batch_cap"] * g["input_len"] / 500 + g["output_len"] * 0.2 for g in groups)
    m = MODELS[model]
    p = param_count(model)
    total = 30.0 + (0.0 if eager else 10.0) + 8.0          # import + init (+ capture) + first steps
    if warmup:
        total += 15.0                                       # the perf warm-up (short prompts, every batch)
    for g in groups:
        b, n, o = g.get("batch_cap", 1), g["input_len"], g["output_len"]
        if not isinstance(b, int):
            # "max": what an H100's KV cache holds (0.9 of 80 GB less the weights), at most 64
            kv_tokens = (0.9 * 80e9 - 2.0 * p - 3e9) / kv_bytes_per_token(model)
            b = max(1, min(64, int(kv_tokens // (n + o))))
        attn = 2.0 * m["layers"] * m["heads"] * m["head_dim"] * n * n      # causal QK^T + PV
        prefill = b * (2.0 * p * n / 500e12 + attn / 200e12)
        step = (2.0 * p + b * (n + o / 2) * kv_bytes_per_token(model)) / 2.6e12
        step += (m["layers"] * 0.45e-3) if eager else 0.002
        total += prefill + o * step + 2.0
        if g.get("profile_steps"):
            # the kernel table: the batch again (prefill) and 40 tokens, the profiler's trace written
            total += prefill + 40 * step + 15.0
    return total


