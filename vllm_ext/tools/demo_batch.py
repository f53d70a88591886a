"""The demo's speed section: a batch of long requests decoding together, with SFI off for them and
with the ``sfi`` preset, and the tokens per second each run decodes.

    python -m vllm_ext.tools.demo_batch --model DIR [--requests 4 --length 3500 --steps 64]

One in-process engine (``LLM``: SPEEDSFI with the preset, prefix caching on) takes ``--requests``
distinct prompts of ``--length`` tokens (``bench/bench_cpu_decode_batch.py``'s needle-in-a-haystack
texts) twice: once with SFI off for every request (a per-request override: dense rows, which run
the dense delegate's kernels, ``CPU_ATTN`` on the CPU build) and once with the preset. The first run
prefills the prompts; the second finds most of them in vLLM's prefix cache. Each run then times
``--steps`` engine steps in which every request decodes (``bench_cpu_decode_batch.run_point``:
whole steps, scheduler to sampler). On the CPU build, with ``--threads 1`` (the default), a step's
time is the thread's CPU time on one OpenMP thread, which other jobs on the machine do not inflate;
otherwise wall time. Tokens per second = requests / mean step time.

It prints a line of progress while it runs (every ~10 s), then a table: each run's tokens per second,
mean step, the SFI rows' slow steps and the share of the KV SFI's fast steps read, and the ratio of
the two runs' tokens per second. It measures; whether the preset is faster depends on the machine
(docs/demo.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

REQUESTS, LENGTH, STEPS = 4, 3500, 64
PRESET = {"preset": "sfi"}
SFI_OFF = {"speedsfi": {"sfi": {"enabled": False}}}
PROGRESS = "[demo] batch progress: "          # demo.py redraws these in place on a terminal


def _say(line: str) -> None:
    print(line, flush=True)


class _Progress:
    """One line every ``every_s`` seconds while a run prefills and decodes."""

    def __init__(self, label: str, requests: int, steps: int, every_s: float = 10.0):
        self.label, self.requests, self.steps, self.every_s = label, requests, steps, every_s
        self.started: set[str] = set()
        self.decode_steps = 0
        self.t0 = self.last = time.monotonic()

    def step(self, outputs) -> None:
        if len(self.started) < self.requests:
            self.started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
        else:
            self.decode_steps += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            _say(PROGRESS + self.line(now))

    def line(self, now: float) -> str:
        where = (f"prefill, {len(self.started)} of {self.requests} requests decoding"
                 if len(self.started) < self.requests
                 else f"decode step {min(self.decode_steps, self.steps)} of {self.steps}")
        return f"{self.label}: {where} ({now - self.t0:.0f} s)"


class _Run:
    """The engine as ``run_point`` drives it, with this run's per-request override and a progress
    line on each step."""

    def __init__(self, engine, extra_args: dict | None, progress: _Progress):
        self.engine, self.extra_args, self.progress = engine, extra_args, progress
        self.vllm_config = engine.vllm_config

    def add_request(self, request_id, prompt, params):
        if self.extra_args:
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), **self.extra_args}
        self.engine.add_request(request_id, prompt, params)

    def step(self):
        outputs = self.engine.step()
        self.progress.step(outputs)
        return outputs

    def abort_request(self, request_ids):
        self.engine.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=REQUESTS, help="requests decoding together")
    ap.add_argument("--length", type=int, default=LENGTH, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=STEPS, help="timed decode steps of each run")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU build: OpenMP threads while decoding (0: every core, wall time); prefill "
                         "uses every core")
    ap.add_argument("--dtype", default=None,
                    help="the model's dtype (default: float32 on a CPU, bf16 arithmetic is emulated "
                         "without AVX512-BF16 or AMX; the checkpoint's otherwise)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not (BENCH / "bench_cpu_decode_batch.py").is_file():
        _say(f"[demo] batch: skipped: it reuses {BENCH}/bench_cpu_decode_batch.py, which an installed "
             "wheel does not have (run it from the repository)")
        return 0
    os.environ.setdefault("SPEEDSFI_TRACE_INTERVAL_S", "5")     # counters are read in-process
    sys.path.insert(0, str(BENCH))
    import bench_cpu_decode_batch as bench                      # sets the in-process engine's env

    from vllm import LLM
    from vllm_ext import metrics

    cpu = _on_cpu()
    dtype = args.dtype or ("float32" if cpu else "auto")
    timed_by = ("thread CPU time, one OpenMP thread" if cpu and args.threads == 1 else "wall time")
    budget = 4096
    max_len = args.length + args.steps + args.requests + args.requests * args.length // budget + 64
    llm = LLM(model=args.model, attention_backend="SPEEDSFI", enforce_eager=True, dtype=dtype,
              max_num_seqs=args.requests, max_model_len=max_len, max_num_batched_tokens=budget,
              block_size=32, enable_prefix_caching=True, seed=0,
              kv_cache_memory_bytes=_kv_bytes(args.model, dtype, max_len, args.requests),
              additional_config={"speedsfi": PRESET})
    engine = llm.llm_engine
    ids = bench.prompts(llm.get_tokenizer(), args.length, args.requests)
    _say(f"[demo] batch: {args.requests} requests of {len(ids[0]):,} prompt tokens decoding together, "
         f"{args.steps} steps timed per run ({timed_by}), {dtype}; SFI off for them, then the `sfi` preset")
    rows = []
    try:
        for label, extra in (("SFI off", SFI_OFF), ("sfi preset", None)):
            progress = _Progress(label, args.requests, args.steps)
            _say(PROGRESS + progress.line(time.monotonic()))
            before = metrics.snapshot()
            raw = bench.run_point(_Run(engine, extra, progress), ids, args.steps,
                                  args.threads if cpu else 0, False, label.replace(" ", "-"))
            after = metrics.snapshot()
            ms = raw["cpu_ms"] if cpu and args.threads == 1 else raw["wall_ms"]
            step_ms = sum(ms) / len(ms)
            context = after.get("sfi.fast_context_tokens", 0) - before.get("sfi.fast_context_tokens", 0)
            retained = after.get("sfi.fast_retained_tokens", 0) - before.get("sfi.fast_retained_tokens", 0)
            rows.append(dict(label=label, tokens_s=1e3 * args.requests / step_ms, step_ms=step_ms,
                             wall_tokens_s=1e3 * args.requests / (sum(raw["wall_ms"]) / len(raw["wall_ms"])),
                             prefill_s=raw["prefill_wall_s"], slow=int(raw["slow_row_steps"]),
                             fast=int(raw["fast_row_steps"]),
                             read=f"{retained / context:.3f}" if context else "1.000"))
            _say(f"[demo] batch: {label}: {rows[-1]['tokens_s']:.1f} tokens/s ({step_ms:.0f} ms a step; "
                 f"prefill {raw['prefill_wall_s']:.0f} s, not timed)")
    finally:
        engine.engine_core.shutdown()
    _table(rows, args, timed_by)
    return 0


def _kv_bytes(model: str, dtype: str, max_len: int, requests: int) -> int:
    """Room for every request's context in the dtype's KV, twice over (SFI's own groups beside it)."""
    import json

    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    except (OSError, KeyError, ValueError):
        return 2 << 30
    elem = 4 if dtype == "float32" else 2
    return max(512 << 20, 2 * per_token * elem * max_len * requests)


def _table(rows: list[dict], args, timed_by: str) -> None:
    _say(f"[demo] batch summary: {args.requests} requests decoding together; tokens/s = requests / mean "
         f"step ({timed_by}; 'wall': by the clock); 'slow': SFI's dense row-steps; 'KV read': of the "
         "context, on SFI's fast steps")
    _say(f"[demo]     {'run':<11} {'tokens/s':>9} {'ms a step':>10} {'wall tokens/s':>14} {'slow':>5} "
         f"{'fast':>5} {'KV read':>8}")
    for r in rows:
        _say(f"[demo]     {r['label']:<11} {r['tokens_s']:>9.1f} {r['step_ms']:>10.0f} "
             f"{r['wall_tokens_s']:>14.1f} {r['slow']:>5} {r['fast']:>5} {r['read']:>8}")
    if len(rows) == 2:
        _say(f"[demo] batch: the preset's tokens/s over SFI off's: {rows[1]['tokens_s'] / rows[0]['tokens_s']:.2f}x "
             "(above 1: the preset decodes this batch faster)")


if __name__ == "__main__":
    sys.exit(main())
