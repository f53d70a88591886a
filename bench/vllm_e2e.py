#!/usr/bin/env python3
"""Real vLLM 0.32 + SPEEDSFI end to end on a GPU: correctness, quality and performance (issue 10).

Run on the GPU machine by ``scripts/gpu_e2e.sh`` (which unpacks the payload of
``scripts/gpu_vllm_bundle.sh`` and puts it on ``PYTHONPATH``)::

    python bench/vllm_e2e.py smoke,correct,quality --out $OUT --deadline-s 520
    python bench/vllm_e2e.py perf --out $OUT --deadline-s 520
    python bench/vllm_e2e.py perf --dry-run            # the plan and a time estimate; no vLLM, no GPU
    python bench/vllm_e2e.py report --merge a.json b.json --out bench/results   # merge + re-plot (CPU)

This process never imports vLLM or torch: every configuration (one backend, one SPEEDSFI
configuration, eager or CUDA graphs) runs in its own subprocess (``_worker``) with a timeout, one
``LLM`` reused for all its input lengths; a failure is recorded with its exact error and the run
goes on; ``vllm_e2e.json`` is rewritten after every configuration, so a run stopped at any point
leaves what it measured. Stages:

* ``smoke``: vLLM's ``_C`` kernels against PyTorch (rms_norm, fused_add_rms_norm, silu_and_mul),
  imports and the plugin entry point, a tiny model through TRITON_ATTN, SPEEDSFI dense and SFI.
* ``correct``: random weights in Llama-3.1-8B and Qwen3-4B shapes (``load_format="dummy"``, then
  re-drawn N(0, 0.02) in place, norms 1, the same seed in every engine, so attention decides the
  greedy tokens), bf16, greedy, ``ignore_eos``, prompts as token ids, a local word-level tokenizer
  (1 in 24 words ends in "."). TRITON_ATTN == SPEEDSFI all off == SFI with a budget covering the
  context, token for token; SFI's default preset runs fast steps (``vllm_ext.metrics`` counters).
* ``quality``: ``scripts/eval_quality.py`` on ``models/retrieval-llama`` (dense, SFI k 256, SFI k
  256 + select_span 4; 180 samples each, fp32 as on the CPU) against ``bench/results/quality_cpu_*``.
* ``perf``: TRITON_ATTN vs SPEEDSFI (all off; SFI preset) on the Qwen3-4B shape, input 8K..128K,
  256 output tokens, CUDA graphs (``FULL_DECODE_ONLY``, no torch.compile) and eager: TPOT (decode
  steps with every request decoding), TTFT, output tok/s (vLLM's own ``RequestOutput.metrics`` beside
  them), KV GB/s vs a 1 GiB torch copy, how many sequences fit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1
STAGES = ("smoke", "correct", "quality", "perf")
JSON_NAME = "vllm_e2e.json"
PNG_NAME = "vllm_e2e.png"
LOGS_TAR = "vllm_e2e_logs.tar.gz"
STATE_FILE = os.environ.get("VLLM_E2E_STATE", "/tmp/vllm_e2e_state.json")

# ------------------------------------------------------------------------------------------------
# model shapes (random weights) and configurations
# ------------------------------------------------------------------------------------------------

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(arch="LlamaForCausalLM", family="llama", layers=32, hidden=4096, heads=32,
                         kv_heads=8, head_dim=128, inter=14336, vocab=128256, rope_theta=500000.0,
                         tie=False),
    "qwen3-4b": dict(arch="Qwen3ForCausalLM", family="qwen3", layers=36, hidden=2560, heads=32,
                     kv_heads=8, head_dim=128, inter=9728, vocab=151936, rope_theta=1000000.0,
                     tie=True),
    # the smoke stage's small model (GPU)
    "tiny-llama": dict(arch="LlamaForCausalLM", family="llama", layers=4, hidden=1024, heads=8,
                       kv_heads=2, head_dim=128, inter=2816, vocab=32000, rope_theta=500000.0,
                       tie=False),
    # --cpu (the CPU build of vLLM, tests of this script)
    "cpu-tiny-llama": dict(arch="LlamaForCausalLM", family="llama", layers=2, hidden=128, heads=4,
                           kv_heads=2, head_dim=32, inter=256, vocab=1024, rope_theta=10000.0,
                           tie=False),
    "cpu-tiny-qwen3": dict(arch="Qwen3ForCausalLM", family="qwen3", layers=2, hidden=128, heads=4,
                           kv_heads=2, head_dim=32, inter=256, vocab=1024, rope_theta=10000.0,
                           tie=True),
}
TRIGGER_EVERY = 24                # about 1 in 24 vocabulary words ends in "."
N_SPECIAL = 3                     # <unk> <s> </s>

SFI_SMALL = {"sfi": {"enabled": True, "k": 64, "k_min": 4, "n_sink": 4, "n_recent": 32}}
SFI_CPU = {"sfi": {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4, "n_recent": 16}}

# name -> backend, SPEEDSFI section (or a function of the context to cover), extra environment
CONFIGS: dict[str, dict[str, Any]] = {
    # vLLM's Triton backend on the V1 model runner, the runner SPEEDSFI uses: like for like
    "triton": dict(backend="TRITON_ATTN", speedsfi=None, env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    # vLLM's Triton backend as a user gets it (vLLM 0.32 picks Model Runner V2 for it on CUDA)
    "triton_v2": dict(backend="TRITON_ATTN", speedsfi=None, env={}),
    "speedsfi_dense": dict(backend="SPEEDSFI", speedsfi={"preset": "dense"}, env={}),
    "speedsfi_sfi": dict(backend="SPEEDSFI", speedsfi={"preset": "sfi"}, env={}),
    # a budget covering the whole context: every decode row must be dense
    "speedsfi_sfi_full": dict(backend="SPEEDSFI", speedsfi="cover", env={}),
    "speedsfi_sfi_small": dict(backend="SPEEDSFI", speedsfi=SFI_SMALL, env={}),
}


def speedsfi_section(config: str, max_model_len: int, cpu: bool) -> dict | None:
    spec = CONFIGS[config]["speedsfi"]
    if spec == "cover":
        return {"sfi": {"enabled": True, "k": int(max_model_len), "n_recent": 256}}
    if cpu and config in ("speedsfi_sfi", "speedsfi_sfi_small"):
        return SFI_CPU          # the tiny CPU prompts are shorter than the preset's 2308-token budget
    return spec


def backend_of(config: str, cpu: bool) -> str:
    b = CONFIGS[config]["backend"]
    return "CPU_ATTN" if (cpu and b == "TRITON_ATTN") else b


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    m = MODELS[model]
    return m["layers"] * m["kv_heads"] * m["head_dim"] * 2 * dtype_bytes


def param_count(model: str) -> int:
    m = MODELS[model]
    h, hd = m["hidden"], m["head_dim"]
    per_layer = h * (m["heads"] + 2 * m["kv_heads"]) * hd + m["heads"] * hd * h + 3 * h * m["inter"]
    emb = m["vocab"] * h * (1 if m["tie"] else 2)
    return m["layers"] * per_layer + emb


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


# ------------------------------------------------------------------------------------------------
# local model folders: config.json written with transformers + a word-level tokenizer
# ------------------------------------------------------------------------------------------------

def trigger_ids(vocab: int, seed: int = 0, every: int = TRIGGER_EVERY) -> set[int]:
    """The ids whose word ends in "." : a seeded sample of ~1/every of the non-special ids."""
    ids = list(range(N_SPECIAL, vocab))
    rng = random.Random(seed)
    return set(rng.sample(ids, round(len(ids) / every)))


def token_strings(vocab: int, seed: int = 0) -> list[str]:
    trig = trigger_ids(vocab, seed)
    words = ["<unk>", "<s>", "</s>"]
    words += [f"w{i}." if i in trig else f"w{i}" for i in range(N_SPECIAL, vocab)]
    return words


def build_tokenizer(out_dir: str | Path, vocab: int, seed: int = 0):
    """A ``PreTrainedTokenizerFast`` (WordLevel, ids 0..vocab-1) saved into ``out_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = token_strings(vocab, seed)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(out_dir))
    return fast


def write_config(out_dir: str | Path, model: str, max_position: int) -> dict:
    """config.json with transformers (architectures and dtype bfloat16 set)."""
    import transformers

    m = MODELS[model]
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[m["family"]]
    kw = dict(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
              num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
              num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
              max_position_embeddings=max_position, tie_word_embeddings=m["tie"],
              bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    try:
        cfg = cls(**kw, rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]})
    except TypeError:                                   # transformers < 5
        cfg = cls(**kw, rope_theta=m["rope_theta"])
    cfg.architectures = [m["arch"]]
    if hasattr(cfg, "dtype"):                           # transformers 5: "dtype" (was torch_dtype)
        cfg.dtype = "bfloat16"
    else:                                               # pragma: no cover - transformers 4
        cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(str(out_dir))
    with open(Path(out_dir) / "config.json") as f:
        return json.load(f)


def make_model_dir(root: str | Path, model: str, max_position: int = 262144) -> str:
    """``root/model`` with config.json + tokenizer; reused when already made with the same inputs."""
    d = Path(root) / model
    stamp = d / ".vllm_e2e_stamp"
    want = json.dumps({"model": MODELS[model], "max_position": max_position, "trigger_every": TRIGGER_EVERY})
    if stamp.is_file() and stamp.read_text() == want:
        return str(d)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    write_config(d, model, max_position)
    build_tokenizer(d, MODELS[model]["vocab"])
    stamp.write_text(want)
    return str(d)


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Distinct random token-id prompts (non-special ids), one per length, seeded."""
    out = []
    for i, n in enumerate(lengths):
        rng = random.Random(f"{seed}:{n}:{i}")
        out.append([rng.randrange(N_SPECIAL, vocab) for _ in range(n)])
    return out


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------

def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def log(msg: str) -> None:
    print(f"[vllm_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def short_error(text: str, limit: int = 600) -> str:
    """The most telling line(s) of a traceback / log tail: the last exception line."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    pat = re.compile(r"(Error|Exception|error:|FAILED|Traceback|Killed|out of memory|CUDA)")
    for ln in reversed(lines):
        if pat.search(ln) and not ln.lstrip().startswith("File "):
            return ln.strip()[:limit]
    return (lines[-1].strip() if lines else "")[:limit]


C_OP_PATTERN = re.compile(r"_C_stable|torch\.ops\._C|_C::|_C\.|no kernel image|cudaErrorNoKernelImage|"
                          r"undefined symbol|_custom_ops|rms_norm|silu_and_mul|rotary_embedding")


def looks_like_c_op_failure(text: str) -> bool:
    """Does the exception line of ``text`` (a traceback or log) point at vLLM's ``_C`` kernels?
    Only the final error line is matched: frames of a traceback name rms_norm & co. whatever failed."""
    return bool(C_OP_PATTERN.search(short_error(text or "")))


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


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------

def parse_batches(text: str) -> dict[int, int | str]:
    out: dict[int, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, v = part.split(":")
        out[int(k)] = v if v == "max" else int(v)
    return out


def est_engine_s(model: str, groups: list[dict], eager: bool, cpu: bool) -> float:
    """A rough wall-time estimate of one engine job on an H100 (printed with the plan)."""
    if cpu:
        return 25.0 + sum(g["batch_cap"] * g["input_len"] / 2000 + g["output_len"] * 0.05 for g in groups)
    m = MODELS[model]
    p = param_count(model)
    total = 30.0 + (0.0 if eager else 10.0) + 8.0          # import + init (+ capture) + warm-up
    for g in groups:
        b, n, o = g.get("batch_cap", 1), g["input_len"], g["output_len"]
        b = b if isinstance(b, int) else 3
        attn = 2.0 * m["layers"] * m["heads"] * m["head_dim"] * n * n      # causal QK^T + PV
        prefill = b * (2.0 * p * n / 500e12 + attn / 200e12)
        step = (2.0 * p + b * (n + o / 2) * kv_bytes_per_token(model)) / 2.6e12
        step += (m["layers"] * 0.45e-3) if eager else 0.002
        total += prefill + o * step + 2.0
    return total


def build_plan(args) -> list[dict]:
    """Every job of the requested stages, in the order it runs (most important first)."""
    jobs: list[dict] = []
    cpu = args.cpu
    stages = args.stages
    if not cpu and "smoke" not in stages and any(s in stages for s in ("correct", "perf")):
        jobs.append(dict(stage="preflight", kind="c_ops", name="c_ops", est_s=15, min_s=20, timeout_s=90))
    if "smoke" in stages:
        if not cpu:
            jobs.append(dict(stage="smoke", kind="c_ops", name="c_ops", est_s=15, min_s=20, timeout_s=90))
        jobs.append(dict(stage="smoke", kind="imports", name="imports", est_s=20, min_s=20, timeout_s=120))
        # one small engine through SPEEDSFI with SFI on (registration, metadata, SFI kernels, counters)
        model = "cpu-tiny-llama" if cpu else "tiny-llama"
        lengths = [8, 100, 300] if cpu else [8, 1000, 3000]
        groups = [dict(kind="greedy", lengths=lengths, input_len=max(lengths), output_len=32,
                       batch_cap=len(lengths))]
        jobs.append(dict(stage="smoke", kind="engine", name=f"smoke/{model}/speedsfi_sfi_small/eager", model=model,
                         config="speedsfi_sfi_small", eager=True, groups=groups, max_model_len=max(lengths) + 64,
                         max_num_seqs=4, est_s=est_engine_s(model, groups, True, cpu), min_s=40,
                         timeout_s=240))
    later: list[dict] = []
    if "correct" in stages:
        models = args.correct_models
        lengths = args.correct_lengths
        out_len = args.correct_output_len
        mml = max(lengths) + out_len + 16
        cfgs = ["triton", "speedsfi_dense", "speedsfi_sfi_full", "speedsfi_sfi"]
        extra = ["triton_v2"] if (args.with_triton_v2 and not cpu) else []
        for group_cfgs, dest in ((cfgs, jobs), (extra, later)):
            for model in models:
                for cfg in group_cfgs:
                    groups = [dict(kind="greedy", lengths=lengths, input_len=max(lengths), output_len=out_len,
                                   batch_cap=len(lengths))]
                    dest.append(dict(stage="correct", kind="engine", name=f"correct/{model}/{cfg}/eager",
                                     model=model, config=cfg, eager=True, groups=groups, max_model_len=mml,
                                     max_num_seqs=len(lengths),
                                     est_s=est_engine_s(model, groups, True, cpu), min_s=40,
                                     timeout_s=min(args.job_timeout_s, 240)))
    if "quality" in stages:
        jobs.append(dict(stage="quality", kind="quality", name="quality/retrieval-llama", est_s=100,
                         min_s=60, timeout_s=300))
    jobs += later                        # information only (vLLM's default runner): after the quality stage
    if "perf" in stages:
        if not cpu:
            jobs.append(dict(stage="perf", kind="env", name="copy_bandwidth", est_s=12, min_s=15, timeout_s=90))
        caps = parse_batches(args.batches)
        modes = [m for m in args.modes if not (cpu and m == "graph")]
        order = []
        # CUDA graphs first (the headline), then eager; within a mode the configs in --perf-configs order
        for mode in ("graph", "eager"):
            if mode in modes:
                order += [(cfg, mode) for cfg in args.perf_configs]
        for model in args.perf_models:
            for cfg, mode in order:
                lens = [n for n in args.lengths if mode == "graph" or n <= args.eager_max_len]
                if not lens:
                    continue
                groups = [dict(kind="perf", input_len=n, output_len=args.output_len,
                               batch_cap=caps.get(n, args.default_batch)) for n in sorted(lens)]
                eager = mode == "eager"
                ints = [g["batch_cap"] for g in groups if isinstance(g["batch_cap"], int)]
                max_seqs = max(ints + [1]) if all(isinstance(g["batch_cap"], int) for g in groups) else 32
                est = est_engine_s(model, groups, eager, cpu)
                jobs.append(dict(stage="perf", kind="engine", name=f"perf/{model}/{cfg}/{mode}", model=model,
                                 config=cfg, eager=eager, groups=groups,
                                 max_model_len=max(lens) + args.output_len + 16, max_num_seqs=max_seqs,
                                 est_s=est, min_s=60 if not eager else 45,
                                 # a hung engine must not eat the call: 2.5x the estimate, at least 3 min
                                 timeout_s=min(args.job_timeout_s, max(180.0, 2.5 * est))))
    return jobs


def print_plan(jobs: list[dict], args) -> None:
    total = 0.0
    print(f"plan: stages {','.join(args.stages)}; deadline {args.deadline_s:.0f} s; "
          f"{'CPU build (tests)' if args.cpu else 'GPU'}")
    for j in jobs:
        total += j["est_s"]
        extra = ""
        if j["kind"] == "engine":
            b = backend_of(j["config"], args.cpu)
            sec = speedsfi_section(j["config"], j["max_model_len"], args.cpu)
            gs = "; ".join(f"in {g['input_len']} x{g['batch_cap']} out {g['output_len']}" if g["kind"] == "perf"
                           else f"prompts {g['lengths']} out {g['output_len']}" for g in j["groups"])
            extra = (f" backend {b} speedsfi {json.dumps(sec) if sec else '-'} "
                     f"{'eager' if j['eager'] else 'cuda graphs'} max_model_len {j['max_model_len']}: {gs}")
        print(f"  [{j['stage']:8s}] {j['name']:44s} ~{j['est_s']:5.0f} s (cum ~{total:5.0f} s){extra}")
    print(f"estimated total ~{total:.0f} s ({total / 60:.1f} min) against a deadline of {args.deadline_s:.0f} s"
          + ("" if total <= args.deadline_s else " -- OVER: the tail will be skipped (recorded)"))


# ------------------------------------------------------------------------------------------------
# the parent: runs jobs in subprocesses, records everything
# ------------------------------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="vllm_e2e_"))
        self.logdir = self.work / "logs"
        self.logdir.mkdir()
        self.state = self._load_state()
        if args.custom_ops == "none":
            self.state["custom_ops_none"] = True
        self.result: dict[str, Any] = {
            "schema": SCHEMA, "tool": "bench/vllm_e2e.py", "command": " ".join(sys.argv),
            "started_utc": now_utc(), "env": {"gpu": None, "vllm": None, "torch": None},
            "stages": {}, "checks": [], "correctness": [], "rows": [], "quality": None,
            "failures": [], "workarounds": [], "skipped": [], "plan": [],
        }
        self._env_from_payload()

    # -- state shared by the calls of one warm machine (custom ops fallback) --
    def _load_state(self) -> dict:
        try:
            with open(STATE_FILE) as f:
                return json.load(f)
        except Exception:
            return {}

    def _save_state(self) -> None:
        try:
            with open(STATE_FILE, "w") as f:
                json.dump(self.state, f)
        except OSError:
            pass

    def _env_from_payload(self) -> None:
        env = self.result["env"]
        env.update(python=platform.python_version(), host=platform.node(), cpu_build=self.args.cpu)
        site = os.environ.get("VLLM_SITE", "/tmp/vllm_site")
        try:
            with open(os.path.join(site, ".speedsfi_payload.json")) as f:
                p = json.load(f)
            env.update(vllm=p.get("vllm"), c_library=p.get("so_variant"), payload_site=site)
        except Exception:
            pass

    def remaining(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- output --
    def write(self) -> None:
        self.result["updated_utc"] = now_utc()
        self.result["wall_s"] = round(self.elapsed(), 1)
        tmp = self.out / (JSON_NAME + ".part")
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.out / JSON_NAME)
        try:
            with tarfile.open(self.out / (LOGS_TAR + ".part"), "w:gz") as tf:
                tf.add(self.logdir, arcname="vllm_e2e_logs")
            os.replace(self.out / (LOGS_TAR + ".part"), self.out / LOGS_TAR)
        except Exception as exc:  # pragma: no cover
            log(f"could not pack the logs: {exc}")

    def failure(self, stage: str, job: str, phase: str, error: str, **kw) -> None:
        rec = dict(stage=stage, job=job, phase=phase, error=error, **kw)
        self.result["failures"].append(rec)
        log(f"FAILED {job} ({phase}): {error}")

    def check(self, stage: str, name: str, ok: bool | None, detail: Any = None) -> None:
        self.result["checks"].append(dict(stage=stage, name=name, ok=ok, detail=detail))
        log(f"check [{stage}] {name}: {'PASS' if ok else ('n/a' if ok is None else 'FAIL')}"
            + (f" ({detail})" if detail is not None and not isinstance(detail, (dict, list)) else ""))

    # -- subprocesses --
    def child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        pp = [str(ROOT)]
        site = os.environ.get("VLLM_SITE")
        if site and os.path.isdir(site):
            pp.insert(0, site)
        pp += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in pp]
        env["PYTHONPATH"] = os.pathsep.join(pp)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", VLLM_EXT_TRACE_INTERVAL_S="0",
                   VLLM_EXT_LOG_INTERVAL_S="600",
                   # the GPU image has no FlashInfer; vLLM's sampler imports it unless told not to
                   # (found on the H100: "ModuleNotFoundError: No module named 'flashinfer'" from
                   # TopKTopPSampler.__init__ -> flashinfer_sampler_supported)
                   VLLM_USE_FLASHINFER_SAMPLER="0")
        if self.args.cpu:
            env.update(SPEEDSFI_FORCE_TORCH_KERNELS="1", VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND="nobind")
            env.pop("TRITON_INTERPRET", None)
        env.update(extra or {})
        return env

    def spawn(self, name: str, argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, str, float]:
        """Run ``argv`` with output to logs/<name>.log; kill its process group at ``timeout``.
        Returns (exit status or None on timeout, log text, seconds)."""
        path = self.logdir / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".log")
        t = time.monotonic()
        with open(path, "ab") as fo:
            fo.write(f"$ {' '.join(argv)}\n".encode())
            fo.flush()
            proc = subprocess.Popen(argv, stdout=fo, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                rc = None
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=15)
                except Exception:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except Exception:
                        pass
                    proc.wait()
                fo.write(f"\n[vllm_e2e] killed after {timeout:.0f} s (timeout)\n".encode())
        return rc, path.read_text(errors="replace"), time.monotonic() - t

    def worker(self, job: dict, timeout: float, spec_extra: dict | None = None) -> tuple[int | None, list[dict], str, float]:
        spec = dict(job, **(spec_extra or {}))
        spec["cpu"] = self.args.cpu
        spec["events"] = str(self.work / f"events_{abs(hash(job['name'] + str(time.time())))}.jsonl")
        spec["trace_dir"] = tempfile.mkdtemp(prefix="trace_", dir=self.work)
        spec["gpu_memory_utilization"] = self.args.gpu_memory_utilization
        spec["graph_mode"] = self.args.graph_mode
        spec["weights"] = self.args.weights
        spec["custom_ops_none"] = spec.get("custom_ops_none", bool(self.state.get("custom_ops_none")))
        if job.get("model"):
            spec["model_dir"] = make_model_dir(self.args.models_dir, job["model"])
        spec_path = self.work / f"spec_{abs(hash(spec['events']))}.json"
        spec_path.write_text(json.dumps(spec))
        env_extra = dict(CONFIGS[job["config"]]["env"]) if job.get("config") else {}
        env_extra["VLLM_EXT_TRACE_DIR"] = spec["trace_dir"]
        argv = [sys.executable, str(Path(__file__).resolve()), "_worker", "--spec", str(spec_path)]
        rc, text, secs = self.spawn(job["name"], argv, timeout, self.child_env(env_extra))
        events = []
        if os.path.isfile(spec["events"]):
            with open(spec["events"]) as f:
                for line in f:
                    try:
                        events.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
        return rc, events, text, secs

    # -- stages --
    def run(self, jobs: list[dict]) -> int:
        self.result["plan"] = [{k: v for k, v in j.items() if k not in ("groups",)} | (
            {"groups": j["groups"]} if "groups" in j else {}) for j in jobs]
        self.write()
        stage_t: dict[str, float] = {}
        for j in jobs:
            st = j["stage"]
            self.result["stages"].setdefault(st, {"jobs": 0, "wall_s": 0.0, "skipped": 0})
            rem = self.remaining()
            if rem < j["min_s"]:
                why = f"deadline: {rem:.0f} s left, the job needs at least {j['min_s']} s"
                self.result["skipped"].append(dict(stage=st, job=j["name"], reason=why))
                self.result["stages"][st]["skipped"] += 1
                log(f"SKIP {j['name']}: {why}")
                if j["kind"] == "engine" and st == "perf":
                    for g in j["groups"]:
                        self.result["rows"].append(self._perf_stub(j, g, f"skipped ({why})"))
                self.write()
                continue
            timeout = min(j["timeout_s"], rem - 10)
            log(f"[{st}] {j['name']} (timeout {timeout:.0f} s; {self.elapsed():.0f} s elapsed, "
                f"{rem:.0f} s left; estimate {j['est_s']:.0f} s)")
            t = time.monotonic()
            try:
                getattr(self, f"job_{j['kind']}")(j, timeout)
            except Exception:
                self.failure(st, j["name"], "driver", traceback.format_exc().strip().splitlines()[-1],
                             traceback=traceback.format_exc()[-3000:])
            dt = time.monotonic() - t
            self.result["stages"][st]["jobs"] += 1
            self.result["stages"][st]["wall_s"] = round(self.result["stages"][st]["wall_s"] + dt, 1)
            stage_t[st] = stage_t.get(st, 0.0) + dt
            log(f"[{st}] {j['name']} took {dt:.0f} s (stage {st} so far {stage_t[st]:.0f} s)")
            self.finish_stage_checks()
            if st == "perf" and j["kind"] == "engine" and not self.args.no_plot:
                try:
                    plot_perf(self.result, self.out / PNG_NAME)
                except Exception as exc:  # pragma: no cover
                    log(f"plot failed: {exc}")
            self.write()
        self.finish_stage_checks()
        if "perf" in self.args.stages and not self.args.no_plot:
            plot_perf(self.result, self.out / PNG_NAME)
        self.write()
        print(markdown_report(self.result), flush=True)
        for st, secs in stage_t.items():
            log(f"stage {st}: {secs:.0f} s")
        failed = [c for c in self.result["checks"] if c["ok"] is False]
        log(f"done in {self.elapsed():.0f} s: {len(self.result['rows'])} perf rows, "
            f"{len(self.result['checks'])} checks ({len(failed)} failed), {len(self.result['failures'])} failures, "
            f"{len(self.result['skipped'])} skipped -> {self.out / JSON_NAME}")
        return 1 if (failed or self.result["failures"]) else 0

    def job_env(self, j: dict, timeout: float) -> None:
        rc, events, text, secs = self.worker(j, timeout)
        info = next((e for e in events if e.get("type") == "env"), None)
        if info:
            self.result["env"].update({k: v for k, v in info.items() if k != "type"})
        else:
            self.failure(j["stage"], j["name"], "env", short_error(text) or f"exit status {rc}")

    def job_c_ops(self, j: dict, timeout: float) -> None:
        if j["stage"] == "preflight" and "c_ops_ok" in self.state:
            log(f"c_ops already checked on this machine: ok={self.state['c_ops_ok']}")
            return
        rc, events, text, secs = self.worker(j, timeout)
        res = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "c_ops"), None)
        if res is None:
            err = short_error(text) or f"exit status {rc}"
            self.check("smoke", "_C kernels load and match PyTorch", False, err)
            self.failure(j["stage"], j["name"], "c_ops", err, workaround="custom_ops ['none'] for every engine")
            ok = False
        else:
            ok = all(r.get("ok") for r in res["ops"].values())
            self.check("smoke", "_C kernels load and match PyTorch", ok, res["ops"])
            for k in ("gpu", "torch", "triton", "cuda"):
                if res.get(k):
                    self.result["env"][k] = res[k]
            if not ok:
                self.failure(j["stage"], j["name"], "c_ops", json.dumps(res["ops"])[:600],
                             workaround="custom_ops ['none'] for every engine")
        self.state["c_ops_ok"] = ok
        if not ok and self.args.custom_ops == "auto":
            self.state["custom_ops_none"] = True
            self.result["workarounds"].append("custom_ops ['none'] (vLLM's _C kernels failed the check)")
        self._save_state()

    def job_imports(self, j: dict, timeout: float) -> None:
        rc, events, text, secs = self.worker(j, timeout)
        res = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "imports"), None)
        if res is None:
            err = short_error(text) or f"exit status {rc}"
            self.check("smoke", "vLLM + plugin import", False, err)
            self.failure(j["stage"], j["name"], "imports", err)
            return
        ok = not res["failed"]
        self.check("smoke", "vLLM + plugin import", ok, res)
        for k in ("vllm", "torch", "triton", "transformers"):
            if res.get(k):
                self.result["env"][k] = res[k]
        if not ok:
            self.failure(j["stage"], j["name"], "imports", json.dumps(res["failed"])[:800])

    def job_engine(self, j: dict, timeout: float) -> None:
        t_start = time.monotonic()
        rc, events, text, secs = self.worker(j, timeout)
        retry_note = None
        init_err = next((e for e in events if e.get("type") == "error" and e.get("phase") == "init"), None)
        grp_errs = [e for e in events if e.get("type") == "error" and e.get("phase") == "group"]
        first_err_text = (init_err or (grp_errs[0] if grp_errs else {})).get("traceback", "") or (
            text if rc not in (0, None) else "")
        used_none = bool(self.state.get("custom_ops_none"))
        rows_done = [e for e in events if e.get("type") in ("row", "greedy")]
        if (rc != 0 and not used_none and self.args.custom_ops == "auto" and not rows_done
                and looks_like_c_op_failure(first_err_text)):
            err = short_error(first_err_text)
            left = timeout - (time.monotonic() - t_start)
            self.failure(j["stage"], j["name"], "init" if init_err else "run", err,
                         workaround="retried with compilation_config custom_ops ['none']")
            if left > j["min_s"]:
                log(f"retrying {j['name']} with custom_ops ['none'] ({left:.0f} s left for it)")
                rc, events, text, secs = self.worker(j, left, {"custom_ops_none": True})
                retry_note = f"custom_ops ['none'] after: {err}"
                if rc == 0:
                    self.state["custom_ops_none"] = True
                    self._save_state()
                    self.result["workarounds"].append(f"custom_ops ['none'] from {j['name']} on ({err})")
        engine = next(({k: v for k, v in e.items() if k != "type"} for e in events if e.get("type") == "engine"), {})
        for e in events:
            if e.get("type") == "info" and "warmup_s" in e:
                engine = dict(engine, warmup_s=e["warmup_s"], warmup_batches=e.get("warmup_batches"))
        errors = [e for e in events if e.get("type") == "error"]
        for e in errors:
            self.failure(j["stage"], j["name"], e.get("phase", "?"), e.get("error", "?"),
                         traceback=e.get("traceback", "")[-3000:])
        if rc is None:
            self.failure(j["stage"], j["name"], "timeout", f"killed after {timeout:.0f} s (timeout / deadline)")
        elif rc != 0 and not errors:
            self.failure(j["stage"], j["name"], "crash", short_error(text) or f"exit status {rc}",
                         log_tail=text[-2000:])
        mc = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
        common = dict(model=j["model"], config=j["config"], backend=backend_of(j["config"], self.args.cpu),
                      mode="eager" if j["eager"] else "graph", engine=engine, workaround=retry_note,
                      max_concurrency_vllm_log=(float(mc[-1][1]) if mc else None),
                      max_concurrency_vllm_log_tokens=(int(mc[-1][0].replace(",", "")) if mc else None))
        if engine:
            for k in ("gpu", "torch", "vllm", "triton"):
                if engine.get(k) and not self.result["env"].get(k):
                    self.result["env"][k] = engine[k]
        if j["stage"] == "perf":
            got = {(e["input_len"]): e for e in events if e.get("type") == "row"}
            for g in j["groups"]:
                e = got.get(g["input_len"])
                if e is None:
                    why = (errors[-1]["error"] if errors else
                           ("killed at the timeout before this length" if rc is None else
                            (short_error(text) or f"exit status {rc}")))
                    self.result["rows"].append(self._perf_stub(j, g, f"not measured: {why}", engine=engine,
                                                               workaround=retry_note))
                else:
                    row = dict(e)
                    row.pop("type", None)
                    row.update({k: v for k, v in common.items() if k not in row or row[k] is None})
                    self.result["rows"].append(make_perf_row(**row))
        else:
            for e in events:
                if e.get("type") == "greedy":
                    rec = dict(common, stage=j["stage"], **{k: v for k, v in e.items() if k != "type"})
                    self.result["correctness"].append(rec)
            if not any(e.get("type") == "greedy" for e in events):
                self.result["correctness"].append(dict(common, stage=j["stage"], error=(
                    errors[-1]["error"] if errors else short_error(text) or f"exit status {rc}")))

    def _perf_stub(self, j: dict, g: dict, error: str, **kw) -> dict:
        return make_perf_row(model=j["model"], config=j["config"], backend=backend_of(j["config"], self.args.cpu),
                             mode="eager" if j["eager"] else "graph", input_len=g["input_len"],
                             output_len=g["output_len"], batch=g["batch_cap"], error=error, **kw)

    def job_quality(self, j: dict, timeout: float) -> None:
        qdir = self.work / "quality"
        qdir.mkdir(exist_ok=True)
        name = "quality_cpu-build_retrieval-llama" if self.args.cpu else "quality_gpu_retrieval-llama"
        configs = {"sfi_k256": {"sfi": {"enabled": True, "k": 256, "n_recent": 64}},
                   "sfi_k256_span4": {"sfi": {"enabled": True, "k": 256, "n_recent": 64, "select_span": 4}}}
        base = ["--per-cell", str(self.args.quality_per_cell), "--configs", json.dumps(configs),
                "--out", str(qdir), "--name", name, "--no-plots"]
        if self.args.quality_lengths:
            base += ["--lengths", self.args.quality_lengths]
        attempts = [("float32", base + ["--engine-args", json.dumps({"dtype": "float32"})])]
        attempts.append(("bfloat16", base + ["--engine-args", json.dumps({"dtype": "bfloat16"})]))
        wrapper = ("import sys, runpy; sys.argv = ['scripts/eval_quality.py'] + sys.argv[1:]; import vllm_ext; "
                   "vllm_ext.register(); runpy.run_path('scripts/eval_quality.py', run_name='__main__')")
        t_start = time.monotonic()
        res = None
        for dtype, argv in attempts:
            left = timeout - (time.monotonic() - t_start)
            if left < j["min_s"]:
                break
            rc, text, secs = self.spawn(f"{j['name']}_{dtype}", [sys.executable, "-c", wrapper] + argv, left,
                                        self.child_env())
            path = qdir / f"{name}.json"
            if rc == 0 and path.is_file():
                res = (dtype, path)
                break
            err = short_error(text) or f"exit status {rc}"
            self.failure("quality", j["name"], f"eval_quality ({dtype})", err,
                         workaround="retry in bfloat16" if dtype == "float32" else None)
        if res is None:
            self.result["quality"] = {"error": "eval_quality did not finish (see failures)"}
            self.check("quality", "retrieval-llama accuracy GPU vs CPU", False, "no result")
            return
        dtype, path = res
        for ext in (".json", ".md"):
            src = path.with_suffix(ext)
            if src.is_file():
                shutil.copy(src, self.out / src.name)
        self.result["quality"] = compare_quality(json.loads(path.read_text()), dtype)
        q = self.result["quality"]
        for c in q["configs"]:
            if c.get("cpu_accuracy") is None:
                continue
            ok = abs(c["accuracy"] - c["cpu_accuracy"]) <= self.args.quality_tolerance
            self.check("quality", f"retrieval-llama {c['name']}: accuracy {100 * c['accuracy']:.1f}% here "
                       f"vs {100 * c['cpu_accuracy']:.1f}% on the CPU", ok,
                       f"same output as the CPU for {100 * (c['same_output_as_cpu'] or 0):.1f}% of the samples")

    def finish_stage_checks(self) -> None:
        """Correctness checks from the greedy records so far (idempotent: recomputed each time)."""
        self.result["checks"] = [c for c in self.result["checks"] if not c.get("derived")]
        recs = [r for r in self.result["correctness"] if r.get("tokens") is not None]
        by = {(r["stage"], r["model"], r["config"]): r for r in recs}
        pairs = [("speedsfi_dense", "triton", "SPEEDSFI all off == TRITON_ATTN"),
                 ("speedsfi_sfi_full", "speedsfi_dense", "SFI budget covering the context == dense"),
                 ("speedsfi_sfi_full", "triton", "SFI budget covering the context == TRITON_ATTN"),
                 ("triton_v2", "triton", "TRITON_ATTN on Model Runner V2 == V1 (information)")]
        for (stage, model) in sorted({(r["stage"], r["model"]) for r in recs}):
            for a, b, label in pairs:
                ra, rb = by.get((stage, model, a)), by.get((stage, model, b))
                if not (ra and rb):
                    continue
                cmp = compare_tokens(ra["tokens"], rb["tokens"])
                same_w = ra.get("weights_checksum") == rb.get("weights_checksum")
                info = "triton_v2" in (a, b)
                self.result["checks"].append(dict(
                    stage=stage, name=f"{model}: {label}", ok=(cmp["identical"] if not info else None),
                    detail={"identical": cmp["identical"], "first_diff": [r["first_diff"] for r in cmp["rows"]],
                            "same_weights": same_w}, derived=True))
            for cfg in ("speedsfi_sfi", "speedsfi_sfi_small"):
                r = by.get((stage, model, cfg))
                if r:
                    c = r.get("counters") or {}
                    ok = c.get("sfi.fast_steps", 0) > 0 and c.get("sfi.slow_steps", 0) > 0
                    ref = by.get((stage, model, "triton"))
                    agree = compare_tokens(r["tokens"], ref["tokens"]) if ref else None
                    self.result["checks"].append(dict(
                        stage=stage, name=f"{model}: {cfg} runs fast steps", ok=ok,
                        detail={k: c.get(k, 0) for k in ("sfi.fast_steps", "sfi.slow_steps", "sfi.dense_rows",
                                                         "sfi.fast_retained_tokens", "sfi.fast_context_tokens")}
                        | {"identical_to_triton": agree["identical"] if agree else None,
                           "first_diff_vs_triton": [x["first_diff"] for x in agree["rows"]] if agree else None},
                        derived=True))
            r = by.get((stage, model, "speedsfi_sfi_full"))
            if r:
                c = r.get("counters") or {}
                self.result["checks"].append(dict(
                    stage=stage, name=f"{model}: SFI covering budget decodes dense rows only",
                    ok=c.get("sfi.fast_steps", 0) == 0 and c.get("sfi.dense_rows", 0) > 0,
                    detail={k: c.get(k, 0) for k in ("sfi.fast_steps", "sfi.slow_steps", "sfi.dense_rows")},
                    derived=True))
        # perf: the dense configurations must produce the same tokens as TRITON_ATTN (same prompts, weights)
        rows = [r for r in self.result["rows"] if r.get("tokens_sha")]
        for r in rows:
            if r["config"] != "speedsfi_dense":
                continue
            ref = next((x for x in rows if x["config"] == "triton" and x["mode"] == r["mode"] and
                        x["input_len"] == r["input_len"] and x["batch"] == r["batch"] and x["model"] == r["model"]), None)
            if ref:
                self.result["checks"].append(dict(
                    stage="perf", name=f"perf {r['model']} {r['mode']} {r['input_len']} x{r['batch']}: "
                                       "SPEEDSFI all off tokens == TRITON_ATTN", ok=r["tokens_sha"] == ref["tokens_sha"],
                    detail=None, derived=True))


def compare_quality(gpu: dict, dtype: str) -> dict:
    """GPU eval_quality JSON vs the committed CPU JSONs: accuracy and per-sample output agreement."""
    cpu_files = sorted((ROOT / "bench" / "results").glob("quality_cpu_retrieval-llama*.json"))
    cpu_cfgs: dict[str, dict] = {}
    for p in cpu_files:
        try:
            d = json.loads(p.read_text())
        except Exception:
            continue
        for c in d.get("configs", []):
            cpu_cfgs.setdefault(c["name"], dict(c, _file=p.name))
    out = []
    for c in gpu.get("configs", []):
        ref = cpu_cfgs.get(c["name"])
        same = None
        if ref:
            key = lambda s: (s["task"], s["length"], s["depth"], s["seed"])  # noqa: E731
            rs = {key(s): s for s in ref.get("samples", [])}
            pairs = [(s, rs.get(key(s))) for s in c.get("samples", [])]
            pairs = [(a, b) for a, b in pairs if b is not None]
            same = (sum(a["output"] == b["output"] for a, b in pairs) / len(pairs)) if pairs else None
            # the CPU accuracy over the same samples (the GPU run may use fewer per cell)
            cpu_acc = (sum(b["correct"] for _, b in pairs) / len(pairs)) if pairs else ref.get("accuracy")
        out.append(dict(name=c["name"], speedsfi=c.get("speedsfi"), accuracy=c.get("accuracy"),
                        agreement_with_dense=c.get("agreement_with_dense"),
                        fast_retained_fraction=c.get("fast_retained_fraction"),
                        read_fraction=c.get("read_fraction"), n=len(c.get("samples", [])),
                        cpu_accuracy=(cpu_acc if ref else None), cpu_file=ref.get("_file") if ref else None,
                        same_output_as_cpu=same, per_task=c.get("per_task")))
    return {"dtype": dtype, "meta": gpu.get("meta"), "configs": out}


# ------------------------------------------------------------------------------------------------
# plot + report (CPU)
# ------------------------------------------------------------------------------------------------

def plot_perf(result: dict, path: Path) -> Path | None:
    rows = [r for r in result.get("rows", []) if r.get("tpot_ms")]
    if not rows:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        log(f"no plot ({exc})")
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 3, figsize=(17, 4.4 * len(models)), squeeze=False)
    copy_rw = (result.get("env") or {}).get("copy_gbps_rw")
    for i, model in enumerate(models):
        ax, bx, cx = axes[i]
        series = sorted({(r["config"], r["mode"]) for r in rows if r["model"] == model})
        for cfg, mode in series:
            style = "-" if mode == "graph" else "--"
            sel = sorted((r for r in rows if r["model"] == model and r["config"] == cfg and r["mode"] == mode),
                         key=lambda r: r["input_len"])
            xs = [r["input_len"] for r in sel]
            ax.plot(xs, [r["tpot_ms"] for r in sel], marker="o", linestyle=style, label=f"{cfg} ({mode})")
            for r in sel:
                ax.annotate(f"x{r['batch']}", (r["input_len"], r["tpot_ms"]), textcoords="offset points",
                            xytext=(3, 3), fontsize=6)
            kv = [(r["input_len"], r.get("kv_gbps_read")) for r in sel if r.get("kv_gbps_read")]
            if kv:
                cx.plot([p[0] for p in kv], [p[1] for p in kv], marker="o", linestyle=style,
                        label=f"{cfg} ({mode}) read")
            if cfg == "triton":
                continue
            ref = {(r["input_len"], r["batch"]): r["tpot_ms"] for r in rows if r["model"] == model
                   and r["config"] == "triton" and r["mode"] == mode}
            sp = [(r["input_len"], ref[(r["input_len"], r["batch"])] / r["tpot_ms"]) for r in sel
                  if (r["input_len"], r["batch"]) in ref]
            if sp:
                bx.plot([p[0] for p in sp], [p[1] for p in sp], marker="o", linestyle=style, label=f"{cfg} ({mode})")
        if copy_rw:
            cx.axhline(copy_rw, color="k", linestyle=":", linewidth=1, label=f"torch copy {copy_rw:.0f} GB/s (r+w)")
        for a in (ax, bx, cx):
            a.set_xscale("log", base=2)
            a.set_xlabel("input tokens")
            a.grid(True, alpha=0.3)
            a.legend(fontsize=7)
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{model}: TPOT (labels: batch)", fontsize=9)
        bx.axhline(1.0, color="k", linewidth=0.8)
        bx.set_ylabel("TPOT speed-up over TRITON_ATTN")
        bx.set_title(f"{model}: speed-up over TRITON_ATTN (same mode and batch)", fontsize=9)
        cx.set_ylabel("KV GB/s actually read per decode step")
        cx.set_title(f"{model}: achieved KV bandwidth", fontsize=9)
    env = result.get("env", {})
    fig.suptitle(f"vLLM {env.get('vllm')} end to end on {env.get('gpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")
    return path


def merge_results(parts: list[dict]) -> dict:
    """Several runs' JSON (e.g. two device calls) into one: lists concatenated, env merged."""
    out = dict(parts[0])
    out = json.loads(json.dumps(out))
    for p in parts[1:]:
        for k in ("checks", "correctness", "rows", "failures", "workarounds", "skipped", "plan"):
            out[k] = (out.get(k) or []) + (p.get(k) or [])
        out["env"] = {**{k: v for k, v in (p.get("env") or {}).items() if v is not None},
                      **{k: v for k, v in (out.get("env") or {}).items() if v is not None}}
        for k, v in (p.get("stages") or {}).items():
            out.setdefault("stages", {})[k] = v
        if p.get("quality") and not out.get("quality"):
            out["quality"] = p["quality"]
    out["merged_from"] = [p.get("command") for p in parts]
    return out


def markdown_report(result: dict) -> str:
    """Checks, perf rows, quality and every failure as markdown (for bench/README.md)."""
    out = [f"vLLM {result.get('env', {}).get('vllm')} on {result.get('env', {}).get('gpu')} "
           f"(torch {result.get('env', {}).get('torch')}, _C library {result.get('env', {}).get('c_library')}, "
           f"copy {result.get('env', {}).get('copy_gbps_rw')} GB/s r+w)", "",
           "| stage | check | result |", "|---|---|---|"]
    for c in result.get("checks", []):
        res = {True: "PASS", False: "FAIL", None: "info"}[c.get("ok")]
        det = c.get("detail")
        if isinstance(det, dict) and "first_diff" in det:
            det = f"first differing token per prompt: {det['first_diff']}"
        out.append(f"| {c.get('stage')} | {c.get('name')} | {res} {'' if det is None else str(det)[:160]} |")
    if result.get("rows"):
        out += ["", summary_table(result)]
    q = result.get("quality") or {}
    if q.get("configs"):
        out += ["", f"Quality (retrieval-llama, {q.get('dtype')}):", "",
                "| config | accuracy | CPU accuracy | same output as CPU | fast-step retained |", "|---|---|---|---|---|"]
        for c in q["configs"]:
            pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
            out.append(f"| {c['name']} | {pct(c['accuracy'])} | {pct(c.get('cpu_accuracy'))} | "
                       f"{pct(c.get('same_output_as_cpu'))} | {c.get('fast_retained_fraction')} |")
    if result.get("failures") or result.get("workarounds") or result.get("skipped"):
        out += ["", "| stage | job | phase | error | workaround |", "|---|---|---|---|---|"]
        for f in result.get("failures", []):
            out.append(f"| {f.get('stage')} | {f.get('job')} | {f.get('phase')} | `{str(f.get('error'))[:300]}` | "
                       f"{f.get('workaround') or ''} |")
        for sk in result.get("skipped", []):
            out.append(f"| {sk.get('stage')} | {sk.get('job')} | skipped | {sk.get('reason')} | |")
        for w in result.get("workarounds", []):
            out.append(f"| | | workaround | | {w} |")
    return "\n".join(out)


def summary_table(result: dict) -> str:
    rows = [r for r in result.get("rows", [])]
    lines = ["| model | config | mode | input | batch | fit | TPOT ms | TTFT ms | out tok/s | KV GB/s (read) | speed-up | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {(r["model"], r["mode"], r["input_len"], r["batch"]): r["tpot_ms"] for r in rows
           if r["config"] == "triton" and r.get("tpot_ms")}

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    for r in rows:
        base = ref.get((r["model"], r["mode"], r["input_len"], r["batch"]))
        sp = (base / r["tpot_ms"]) if (base and r.get("tpot_ms")) else None
        lines.append(f"| {r['model']} | {r['config']} | {r['mode']} | {r['input_len']} | {r['batch']} | "
                     f"{r.get('max_concurrency') or '-'} | {f(r.get('tpot_ms'))} | {f(r.get('ttft_ms'), '{:.0f}')} | "
                     f"{f(r.get('output_tok_s'), '{:.0f}')} | {f(r.get('kv_gbps'), '{:.0f}')} "
                     f"({f(r.get('kv_gbps_read'), '{:.0f}')}) | {f(sp, '{:.2f}x')} | {(r.get('error') or '')[:60]} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the worker (one subprocess): everything that imports vLLM / torch lives below
# ------------------------------------------------------------------------------------------------

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
    section = speedsfi_section(spec["config"], spec["max_model_len"], cpu)
    kw: dict[str, Any] = dict(model=spec["model_dir"], tokenizer=spec["model_dir"], load_format="dummy",
                              dtype="float32" if cpu else "bfloat16", seed=0,
                              attention_backend=backend_of(spec["config"], cpu), enforce_eager=spec["eager"],
                              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                              enable_prefix_caching=False, disable_log_stats=False)
    if section is not None:
        kw["additional_config"] = {"speedsfi": section}
    cc: dict[str, Any] = {}
    if spec.get("custom_ops_none"):
        cc["custom_ops"] = ["none"]
    if not spec["eager"]:
        sizes = sorted({1, 2, 4} | {g["batch_cap"] for g in spec["groups"] if isinstance(g["batch_cap"], int)})
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
    return kw


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
    if spec["stage"] == "perf":
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
                output_tok_s=batch * o / r["e2e_s"] if r["e2e_s"] else None,
                decode_tok_s=(batch / (timing["tpot_ms"] * 1e-3)) if timing["tpot_ms"] else None,
                weight_bytes=wbytes,
                step_gbps=((kv["kv_bytes_per_step"] * sfi["kv_read_fraction"] + wbytes) / (timing["tpot_ms"] * 1e-3) / 1e9)
                if timing["tpot_ms"] else None,
                tokens_sha=tokens_digest(r["tokens"]), counters=counters, **kv, **sfi)
            ev.emit(type="row", **row)
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
        return worker_engine(spec, ev)
    except Exception as exc:
        ev.emit(type="error", phase=kind, error=f"{type(exc).__name__}: {exc}"[:1500],
                traceback=traceback.format_exc())
        return 6


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", help="comma list of smoke,correct,quality,perf | all | plan | report | note")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results" / "vllm_e2e"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate; run nothing")
    ap.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_E2E_BUDGET_S", 540)),
                    help="wall-time budget of this invocation; jobs that no longer fit are skipped (recorded)")
    ap.add_argument("--cpu", action="store_true", help="the CPU build of vLLM with tiny models (tests)")
    ap.add_argument("--models-dir", default=os.environ.get("VLLM_E2E_MODELS", "/tmp/vllm_e2e_models"))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--custom-ops", choices=("auto", "none"), default="auto",
                    help="auto: vLLM's _C kernels unless they fail (then ['none'], recorded); none: always native")
    ap.add_argument("--graph-mode", choices=("full_decode", "piecewise", "vllm_default"), default="full_decode",
                    help="CUDA-graph runs: full_decode = compilation mode NONE + FULL_DECODE_ONLY graphs (no "
                         "torch.compile; default); piecewise = VLLM_COMPILE + PIECEWISE; vllm_default = vLLM's own")
    ap.add_argument("--weights", choices=("sharp", "dummy"), default="sharp")
    ap.add_argument("--job-timeout-s", type=float, default=420)
    # correctness
    ap.add_argument("--correct-models", default="llama-3.1-8b,qwen3-4b")
    ap.add_argument("--correct-lengths", default="6000,4400,3000,1200",
                    help="prompt lengths of the correctness batch (SFI's default budget is 2308 tokens)")
    ap.add_argument("--correct-output-len", type=int, default=128)
    ap.add_argument("--with-triton-v2", action=argparse.BooleanOptionalAction, default=True,
                    help="also TRITON_ATTN on vLLM's default Model Runner V2 (last, information only)")
    # quality
    ap.add_argument("--quality-per-cell", type=int, default=3)
    ap.add_argument("--quality-lengths", default=None)
    ap.add_argument("--quality-tolerance", type=float, default=0.05,
                    help="accuracy difference GPU vs CPU accepted as 'the same' (fp32 vs fp32, other kernels)")
    # performance
    ap.add_argument("--perf-models", default="qwen3-4b")
    ap.add_argument("--perf-configs", default="triton,speedsfi_sfi,speedsfi_dense")
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", default="8192:16,32768:4,65536:2,131072:1",
                    help="input_len:batch (or :max = as many as the KV cache holds); capped by the fit")
    ap.add_argument("--default-batch", type=int, default=1)
    ap.add_argument("--eager-max-len", type=int, default=32768, help="eager runs only up to this input length")
    ap.add_argument("--no-plot", action="store_true")
    # report / note
    ap.add_argument("--merge", nargs="*", default=None, help="report: JSON files to merge")
    ap.add_argument("--error", default=None, help="note: an error to record")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = args.stages
    args.stages = list(STAGES) if s == "all" else [x for x in s.split(",") if x]
    if s not in ("plan", "report", "note", "_worker"):
        bad = [x for x in args.stages if x not in STAGES]
        if bad:
            ap.error(f"unknown stage(s) {bad}; choose from {STAGES}, all, plan, report, note")
    if s == "plan":
        args.dry_run = True
        args.stages = list(STAGES)
    args.correct_models = [m for m in args.correct_models.split(",") if m]
    args.perf_models = [m for m in args.perf_models.split(",") if m]
    args.perf_configs = [c for c in args.perf_configs.split(",") if c]
    args.modes = [m for m in args.modes.split(",") if m]
    args.lengths = ints(args.lengths)
    args.correct_lengths = ints(args.correct_lengths)
    if args.cpu:
        # tiny models through the CPU build: the same code path at test sizes
        if args.correct_models == ["llama-3.1-8b", "qwen3-4b"]:
            args.correct_models = ["cpu-tiny-llama", "cpu-tiny-qwen3"]
        if args.perf_models == ["qwen3-4b"]:
            args.perf_models = ["cpu-tiny-qwen3"]
        if args.lengths == [8192, 32768, 65536, 131072]:
            args.lengths = [96, 200]
        if args.correct_lengths == [6000, 4400, 3000, 1200]:
            args.correct_lengths = [120, 90, 60, 20]
        if args.batches == "8192:16,32768:4,65536:2,131072:1":
            args.batches = "96:2,200:1"
        if args.output_len == 256:
            args.output_len = 24
        if args.correct_output_len == 128:
            args.correct_output_len = 16
        args.eager_max_len = max(args.lengths)
    for m in args.correct_models + args.perf_models:
        if m not in MODELS:
            ap.error(f"unknown model {m}; choose from {sorted(MODELS)}")
    for c in args.perf_configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c}; choose from {sorted(CONFIGS)}")
    return args, s


def main(argv=None) -> int:
    args, raw = parse(argv)
    if raw == "_worker":
        return worker_main(args.spec)
    if raw == "report":
        parts = [json.loads(Path(p).read_text()) for p in (args.merge or [Path(args.out) / JSON_NAME])]
        res = merge_results(parts) if len(parts) > 1 else parts[0]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / JSON_NAME).write_text(json.dumps(res, indent=1, default=str))
        plot_perf(res, out / PNG_NAME)
        print(markdown_report(res))
        return 0
    if raw == "note":
        run = Run(args)
        run.failure("setup", "gpu_e2e.sh", "setup", args.error or "unknown")
        run.write()
        return 0
    jobs = build_plan(args)
    if args.dry_run:
        print_plan(jobs, args)
        heavy = [m for m in ("vllm", "torch", "transformers") if m in sys.modules]
        print(f"heavy modules imported by the plan: {heavy or 'none'}")
        return 0
    print_plan(jobs, args)
    return Run(args).run(jobs)


if __name__ == "__main__":
    sys.exit(main())
