#!/usr/bin/env python
"""Load test: a real ``vllm serve`` under many concurrent streamed requests, measured from the client:
vLLM's own CPU attention (``cpu_attn``), SPEEDSFI with every method off (``dense``), SFI and SPEED.

For every configuration it starts a server (``tests/e2e/served.py``: fp32, eager, the PyTorch twins
of the kernels; the CPU build's test server) with that ``speedsfi`` section, or attaches to one
already running (``--base-url``: any server, e.g. on a GPU node), sends the same seeded workload and
records per request the client-side TTFT (request sent -> first streamed token) and TPOT ((last
token - first token) / (tokens - 1)), whether the answer is right, and errors; per configuration
p50/p99 of both, throughput, the resident memory of the server's process tree (API server, engine
core, worker) when it became ready, after the warm-up, at the middle and at the end of the run,
sampled every second in between, and SPEEDSFI's counters (``/metrics``) over the measured run.

The workload: retrieval samples of ``vllm_ext/quality/tasks.py`` (the prompts of the committed
``models/retrieval-llama``: checkable answers) of mixed lengths, tasks and needle depths, each asking
for its answer plus a few random tokens more (``ignore_eos``), so prompt and output lengths vary.
With ``--random-ids`` (any model) the prompts are random token ids instead and answers are not
checked.

    .venv/bin/python scripts/load_test.py                # cpu_attn, dense, sfi, speed; 200 x 32
    .venv/bin/python scripts/load_test.py --configs dense,sfi --num-requests 400 --concurrency 64
    python scripts/load_test.py --base-url http://127.0.0.1:8000 --label sfi --server-pid 1234 \\
        --random-ids --lengths 4096,16384 --extra-tokens 256 --name load_h100_sfi
                          # attach to any server (a GPU node); RSS of that process tree

Soak (``--soak``): the same, plus every second the resident memory of each server process
(API server, engine core, worker), vLLM's ``vllm:kv_cache_usage_perc`` / ``num_requests_running`` /
``waiting`` and SPEEDSFI's request, SFI and CritiPrefill slots (``/metrics``); after the traffic it
waits until the server is idle and samples the end state for ``--end-sample-s``. ``--abort-fraction``
drops a seeded fraction of the streams after 0..3 chunks; ``--repeat-fraction`` repeats earlier
prompts (prefix-cache hits). Summary per configuration: RSS growth per process from after the
warm-up to the end, the slots and KV usage at the end, failures, drops; the plot shows the series.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/load_test.py --soak --configs cpu_attn,all_on,sfi_critiprefill_pc \
        --num-requests 2000 --lengths 64,128,256,1024 --extra-tokens 2 --warmup 32 \
        --abort-fraction 0.1 --repeat-fraction 0.2 --serve-args "--max-num-batched-tokens 512" --name soak_cpu

Writes ``<out>/<name>.json`` and ``<out>/<name>.png``; exits non-zero when any request failed or a
server did not stay healthy (or, soaking, did not come back to zero slots, queue and KV usage).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_ext.quality import tasks as T  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "models", "retrieval-llama")
# SPEED on the default model serves its SPEED-adapted twin (the base model loses its answers under
# SPEED's visibility: bench/QUALITY.md); same tokenizer, so the workload and its checks are the same
SPEED_MODEL = os.path.join(ROOT, "models", "retrieval-llama-speed")

# name -> (speedsfi section or None for no --additional-config, extra `vllm serve` arguments)
BUILTIN = {
    # vLLM's own CPU attention backend (the later --attention-backend wins; the plugin is loaded)
    "cpu_attn": (None, ("--attention-backend", "CPU_ATTN")),
    # SPEEDSFI with every method off
    "dense": ({}, ()),
    # a small SFI budget, so that prompts from 133 tokens on decode sparsely (sink 4 + k 64 + recent
    # 64); select_span 4 keeps the selector's quality (bench/QUALITY.md: 75 % vs 95 % dense at 2K)
    "sfi": ({"sfi": {"enabled": True, "k": 64, "n_recent": 64, "select_span": 4}}, ()),
    # SPEED needs prefix caching off (and an eager model, as every server here, to skip the upper
    # layers' prompt compute); l_cut: 3/4 of the layers
    "speed": ({"speed": {"enabled": True}}, ("--no-enable-prefix-caching",)),
    # the soak's configurations: every method on (SPEED forces prefix caching off), and the
    # methods that allow prefix caching with it on. CritiPrefill with a small segment so that it is
    # active from 256-token prompts (needs --max-num-batched-tokens > segment_size)
    "all_on": ({"sfi": {"enabled": True, "k": 64, "n_recent": 64, "select_span": 4},
                "speed": {"enabled": True},
                "critiprefill": {"enabled": True, "segment_size": 128, "block_size": 16, "budget": 256,
                                 "min_len": 256}},
               ("--no-enable-prefix-caching",)),
    "sfi_critiprefill_pc": ({"sfi": {"enabled": True, "k": 64, "n_recent": 64, "select_span": 4},
                             "critiprefill": {"enabled": True, "segment_size": 128, "block_size": 16,
                                              "budget": 256, "min_len": 256}},
                            ("--enable-prefix-caching",)),
}


def log(msg: str) -> None:
    print(f"[load_test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint served (default: the retrieval model)")
    p.add_argument("--configs", default="cpu_attn,dense,sfi,speed",
                   help=f"comma list of built-in names ({', '.join(BUILTIN)}) or a JSON mapping "
                        "name -> speedsfi section (optionally {\"speedsfi\": ..., \"serve_args\": [...]})")
    p.add_argument("--num-requests", type=int, default=200, help="requests per pass")
    p.add_argument("--passes", type=int, default=1,
                   help="send the workload this many times (fresh prompts each; RSS after each pass)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--lengths", default="64,128,256,512",
                   help="prompt lengths in tokens, drawn uniformly per request")
    p.add_argument("--extra-tokens", type=int, default=8,
                   help="each request asks for its answer plus 0..N more tokens (ignore_eos)")
    p.add_argument("--warmup", type=int, default=8, help="requests before the measured run (not counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-ids", action="store_true",
                   help="random token ids (any model; answers not checked) instead of retrieval samples")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--serve-args", default="",
                   help="more `vllm serve` arguments for every started server (one string)")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--base-url", default=None,
                   help="attach to this running server instead of starting one (one configuration)")
    p.add_argument("--served-model-name", default=None, help="with --base-url (default: the first model)")
    p.add_argument("--label", default="attached", help="with --base-url: the configuration's name")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --base-url: the server's pid, for resident memory (its process tree)")
    p.add_argument("--machine", default=None, help="describe the machine (default: from /proc/cpuinfo)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default="load_cpu", help="file stem of the JSON and the plot")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--abort-fraction", type=float, default=0.0,
                   help="this seeded fraction of the streamed requests is dropped by the client after "
                        "0..3 streamed chunks (0: right after the response headers); they ask for 32 "
                        "tokens more, so that the drop happens mid-generation")
    p.add_argument("--repeat-fraction", type=float, default=0.0,
                   help="this seeded fraction of the requests repeats an earlier request's prompt "
                        "(prefix-cache hits where prefix caching is on)")
    p.add_argument("--soak", action="store_true",
                   help="soak mode: every second RSS per server process, vLLM's KV-cache usage and "
                        "queue, SPEEDSFI's slot gauges; the end state measured once idle; soak plot")
    p.add_argument("--end-sample-s", type=float, default=5.0,
                   help="with --soak: seconds sampled after the server went idle (the end state)")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="with --soak: longest wait for the server to go idle after the traffic")
    p.add_argument("--code-commit", default=None,
                   help="record this commit as the code served (default: git HEAD of this tree, "
                        "with its modified paths)")
    return p.parse_args(argv)


def resolve_configs(spec: str) -> list[tuple[str, dict, tuple[str, ...]]]:
    spec = spec.strip()
    if spec.startswith("{"):
        out = []
        for name, value in json.loads(spec).items():
            if isinstance(value, dict) and ("speedsfi" in value or "serve_args" in value):
                out.append((name, value.get("speedsfi", {}), tuple(value.get("serve_args", ()))))
            else:
                out.append((name, value, ()))
        return out
    out = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name not in BUILTIN:
            raise SystemExit(f"unknown configuration {name!r}; built-in: {', '.join(BUILTIN)} "
                             "(or pass a JSON mapping)")
        section, serve_args = BUILTIN[name]
        out.append((name, section, serve_args))
    return out


# ------------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------------
def make_workload(n: int, lengths: list[int], extra: int, seed: int, random_ids: bool,
                  vocab_size: int | None = None) -> list[dict]:
    rng = random.Random(f"load|{seed}")
    out = []
    for i in range(n):
        length = rng.choice(lengths)
        if random_ids:
            ids = [rng.randrange(4, vocab_size or 1000) for _ in range(length)]
            out.append({"i": i, "task": "random", "length": length, "prompt_ids": ids,
                        "answer_ids": None, "max_tokens": 8 + rng.randint(0, extra)})
            continue
        # the tasks with distractor needles need room for them (>= 256 tokens)
        task = rng.choice(T.TASKS if length >= 256 else ("niah_single", "kv_lookup"))
        depth = rng.choice((0.0, 0.25, 0.5, 0.75, 1.0))
        s = T.make_sample(task, length, depth, seed=seed * 100_003 + i)
        out.append({"i": i, "task": task, "length": length, "depth": depth, "prompt_ids": s.prompt_ids,
                    "answer_ids": s.answer_ids, "max_tokens": len(s.answer_ids) + rng.randint(0, extra)})
    return out


ABORT_EXTRA_TOKENS = 32      # a dropped request asks for this many tokens more (dropped mid-generation)


def add_soak_traits(work: list[dict], abort_fraction: float, repeat_fraction: float, seed: int) -> list[dict]:
    """Mark a seeded ``abort_fraction`` of ``work`` to be dropped by the client after
    ``abort_after_chunks`` (0..3) streamed chunks, and make a seeded ``repeat_fraction`` repeat an
    earlier request's prompt (and answer). The same for every configuration (a function of the seed
    and the workload only); in place, returned."""
    rng = random.Random(f"soak|{seed}")
    for k, req in enumerate(work):
        if k and rng.random() < repeat_fraction:
            src = work[rng.randrange(max(0, k - 64), k)]        # a recent one: likely still cached
            req.update(task=src["task"], length=src["length"], prompt_ids=src["prompt_ids"],
                       answer_ids=src["answer_ids"], repeat_of=src["i"])
            if "depth" in src:
                req["depth"] = src["depth"]
            req["max_tokens"] = max(req["max_tokens"], len(src["answer_ids"] or ()))
        if rng.random() < abort_fraction:
            req["abort_after_chunks"] = rng.randint(0, 3)
            req["max_tokens"] += ABORT_EXTRA_TOKENS
    return work


async def one_request(client, model: str, req: dict, timeout: float) -> dict:
    rec = {"i": req["i"], "task": req["task"], "prompt_tokens": len(req["prompt_ids"]),
           "max_tokens": req["max_tokens"], "error": None}
    abort_after = req.get("abort_after_chunks")
    if abort_after is not None:
        rec["abort_after_chunks"] = abort_after
    if "repeat_of" in req:
        rec["repeat_of"] = req["repeat_of"]
    aborted = False
    ids: list[int] = []
    chunks = 0
    first = last = None
    usage = None
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req["prompt_ids"], max_tokens=req["max_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True}, timeout=timeout,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        if abort_after == 0:                        # dropped before any token: waiting or prefilling
            aborted = True
            await stream.close()
        else:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    got = list(getattr(choice, "token_ids", None) or [])
                    if got or choice.text:
                        first = now if first is None else first
                        last = now
                        chunks += 1
                    ids += got
                if abort_after is not None and chunks >= abort_after:
                    aborted = True                  # the client goes away; vLLM aborts the request
                    await stream.close()
                    break
    except Exception as e:                          # recorded, counted, never hidden
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    t_end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else len(ids)
    rec.update(completion_tokens=n, e2e_s=t_end - t0,
               ttft_s=None if first is None else first - t0,
               tpot_s=(last - first) / (n - 1) if first is not None and n > 1 else None)
    if aborted:
        rec["aborted"] = True
    elif rec["error"] is None and n != req["max_tokens"]:
        rec["error"] = f"short answer: {n} of {req['max_tokens']} tokens"
    if req["answer_ids"] is not None and not aborted:
        rec["correct"] = ids[:len(req["answer_ids"])] == req["answer_ids"]
    return rec


async def drive(base_url: str, model: str, work: list[dict], concurrency: int, timeout: float,
                on_done=None) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.AsyncClient(limits=limits, timeout=timeout))
    sem = asyncio.Semaphore(concurrency)

    async def bounded(req):
        async with sem:
            rec = await one_request(client, model, req, timeout)
        if on_done is not None:
            on_done(rec)
        return rec

    t0 = time.perf_counter()
    try:
        recs = await asyncio.gather(*(bounded(r) for r in work))
    finally:
        await client.close()
    return list(recs), time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Server side: resident memory and counters
# ------------------------------------------------------------------------------------------------
def server_processes(pid: int | None) -> list[tuple[int, str, int]] | None:
    """``(pid, name, rss bytes)`` of ``pid`` and its descendants (API server, engine core, worker);
    None when there is no such process."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.name(), p.memory_info().rss))
        except psutil.NoSuchProcess:
            continue
    return out


def tree_rss(pid: int | None) -> dict | None:
    """Resident memory of ``pid`` and its descendants (the API server and the engine core)."""
    procs = server_processes(pid)
    if procs is None:
        return None
    per = {f"{p} {name}": rss for p, name, rss in procs}
    return {"total_mib": round(sum(per.values()) / 2**20, 1),
            "per_process_mib": {k: round(v / 2**20, 1) for k, v in per.items()}}


class RssSampler:
    def __init__(self, pid: int | None, every_s: float = 1.0):
        self.pid, self.every_s, self.samples = pid, every_s, []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            r = tree_rss(self.pid)
            if r is not None:
                self.samples.append((round(time.perf_counter() - self._t0, 2), r["total_mib"]))
            self._stop.wait(self.every_s)

    def __enter__(self):
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


# ------------------------------------------------------------------------------------------------
# Soak: a time series of the server's processes and gauges
# ------------------------------------------------------------------------------------------------
ROLES = ("api_server", "engine_core", "worker", "other")
# /metrics sample -> timeline key (values summed over label sets)
SOAK_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",          # a fraction (0..1) despite its name
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "speedsfi_request_slots_in_use": "request_slots",
    "speedsfi_sfi_slots_in_use": "sfi_slots",
}
SOAK_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}
SLOT_KEYS = ("request_slots", "sfi_slots", "critiprefill_slots")


def role_of(name: str, is_root: bool) -> str:
    if is_root:
        return "api_server"
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return "other"                    # e.g. multiprocessing's resource tracker


def rss_by_role(pid: int | None) -> dict | None:
    """Resident memory (MiB) of the server's processes by role (the API server = ``pid``, the engine
    core, the worker, anything else), and their total."""
    procs = server_processes(pid)
    if procs is None:
        return None
    out = dict.fromkeys(ROLES, 0.0)
    for p, name, rss in procs:
        out[role_of(name, p == pid)] += rss / 2**20
    out["total"] = sum(out[r] for r in ROLES)
    return {k: round(v, 1) for k, v in out.items()}


def parse_metrics(text: str) -> dict:
    """The soak's values from a Prometheus exposition: vLLM's KV-cache usage and queue, SPEEDSFI's
    slot gauges, CritiPrefill's slots (assigned - released), preemptions, prefix-cache counters and
    finished requests by reason."""
    import re

    pat = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
    out: dict = {}
    events: dict[str, float] = {}
    finished: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not (m := pat.match(line)):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        key = SOAK_GAUGES.get(name) or SOAK_COUNTERS.get(name)
        if key:
            out[key] = out.get(key, 0.0) + value
        elif name == "speedsfi_events_total":
            if ev := re.search(r'event="([^"]+)"', labels):
                events[ev.group(1)] = events.get(ev.group(1), 0.0) + value
        elif name == "vllm:request_success_total":
            if fr := re.search(r'finished_reason="([^"]+)"', labels):
                finished[fr.group(1)] = finished.get(fr.group(1), 0.0) + value
    out["critiprefill_slots"] = (events.get("critiprefill.slots_assigned", 0)
                                 - events.get("critiprefill.slots_released", 0))
    for key in ("request_slots", "sfi_slots"):        # the gauges, or the counters they come from
        if key not in out:
            a, r = {"request_slots": ("slots.acquired", "slots.released"),
                    "sfi_slots": ("sfi.slots_assigned", "sfi.slots_released")}[key]
            out[key] = events.get(a, 0) - events.get(r, 0)
    out["finished"] = {k: int(v) for k, v in sorted(finished.items())}
    return {k: (int(v) if isinstance(v, float) and k != "kv_cache_usage" else v) for k, v in out.items()}


class Timeline:
    """Every ``every_s``: RSS by role and ``/metrics``' soak values, tagged with the phase the driver
    is in (``warmup``, ``run``, ``drain``, ``end``) and the requests finished so far."""

    def __init__(self, pid: int | None, base_url: str, every_s: float = 1.0):
        self.pid, self.base_url, self.every_s = pid, base_url, every_s
        self.samples: list[dict] = []
        self.phase, self.done = "warmup", 0
        self.t_run = None                            # perf_counter at the start of the measured run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        import httpx

        t = time.perf_counter()
        rec = {"t": None, "phase": self.phase, "done": self.done, "rss_mib": rss_by_role(self.pid)}
        try:
            rec.update(parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text))
        except Exception as e:                        # recorded; the soak goes on
            rec["metrics_error"] = f"{type(e).__name__}: {e}"[:200]
        rec["_pc"] = t                                # -> t (s since the measured run began) at stop
        self.samples.append(rec)
        return rec

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        for r in self.samples:                        # times relative to the measured run's start
            pc = r.pop("_pc", None)
            if pc is not None and self.t_run is not None:
                r["t"] = round(pc - self.t_run, 2)


def is_idle(sample: dict) -> bool:
    return (not sample.get("metrics_error") and sample.get("running", 1) == 0
            and sample.get("waiting", 1) == 0 and all(sample.get(k, 1) == 0 for k in SLOT_KEYS))


def _slope_per_1000(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (requests done, MiB) in MiB per 1000 requests."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return round(1000 * sum((x - mx) * (y - my) for x, y in points) / sxx, 2)


def soak_summary(samples: list[dict], recs: list[dict], wall_s: float) -> dict:
    """RSS growth per role from after the warm-up (the first sample of the measured run) to the end
    (the mean of the samples taken once idle), the slope over the run's second half (MiB per 1000
    requests finished), the gauges' peaks during the run and their values at the end, and whether the
    slots and the KV-cache usage came back to zero."""
    run = [s for s in samples if s["phase"] == "run" and s.get("rss_mib")]
    end = [s for s in samples if s["phase"] == "end"]
    with_metrics = [s for s in samples if s["phase"] in ("run", "drain") and "metrics_error" not in s]
    out: dict = {"requests": len(recs), "aborted": sum(bool(r.get("aborted")) for r in recs),
                 "failures": sum(r["error"] is not None for r in recs),
                 "failure_messages": sorted({r["error"] for r in recs if r["error"]})[:10],
                 "wall_s": round(wall_s, 1), "samples": len(samples),
                 "metrics_errors": sum("metrics_error" in s for s in samples)}
    end_rss = [s["rss_mib"] for s in end if s.get("rss_mib")]
    if run and end_rss:
        start = run[0]["rss_mib"]
        keys = [*ROLES, "total"]
        fin = {k: round(sum(r[k] for r in end_rss) / len(end_rss), 1) for k in keys}
        half = [s for s in run if s["done"] >= len(recs) / 2]
        out["rss_after_warmup_mib"] = start
        out["rss_end_mib"] = fin
        out["rss_peak_mib"] = {k: max(s["rss_mib"][k] for s in run + end if s.get("rss_mib")) for k in keys}
        out["rss_growth_mib"] = {k: round(fin[k] - start[k], 1) for k in keys}
        out["rss_second_half_slope_mib_per_1000_requests"] = {
            k: _slope_per_1000([(s["done"], s["rss_mib"][k]) for s in half]) for k in keys}
    keys = ("kv_cache_usage", "running", "waiting", *SLOT_KEYS)
    if with_metrics:
        out["peak"] = {k: max(s.get(k, 0) for s in with_metrics) for k in keys}
    ok_end = [s for s in end if "metrics_error" not in s]
    if ok_end:
        last = ok_end[-1]
        out["end"] = {k: last.get(k) for k in keys}
        out["end_max"] = {k: max(s.get(k, 0) for s in ok_end) for k in keys}
        for k in ("preemptions", "prefix_cache_queries", "prefix_cache_hits", "finished"):
            out["end"][k] = last.get(k)
        out["back_to_zero"] = {"slots": all(out["end_max"][k] == 0 for k in SLOT_KEYS),
                               "kv_cache_usage": out["end_max"]["kv_cache_usage"] == 0,
                               "queue": out["end_max"]["running"] == 0 and out["end_max"]["waiting"] == 0}
    else:
        out["back_to_zero"] = {"slots": False, "kv_cache_usage": False, "queue": False}
    return out


def soak_compare(configs: list[dict], baseline: str = "cpu_attn") -> dict | None:
    """Each configuration's RSS growth per role next to the baseline's (vLLM's own backend)."""
    base = next((c for c in configs if c["name"] == baseline and "soak" in c), None)
    if base is None or "rss_growth_mib" not in base["soak"]:
        return None
    bg = base["soak"]["rss_growth_mib"]
    out = {}
    for c in configs:
        g = c.get("soak", {}).get("rss_growth_mib")
        if g is None or c is base:
            continue
        out[c["name"]] = {k: {"growth_mib": g[k], "baseline_growth_mib": bg[k],
                              "excess_mib": round(g[k] - bg[k], 1)} for k in g}
        out[c["name"]]["total_not_larger_than_baseline"] = g["total"] <= bg["total"]
    return {"baseline": baseline, "by_config": out}


def server_env(pid: int) -> dict[str, str]:
    """The environment variables of the server that change what it runs (for the record)."""
    import psutil

    try:
        env = psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return {}
    return {k: v for k, v in sorted(env.items())
            if k.startswith(("VLLM_CPU", "SPEEDSFI_", "TRITON_", "OMP_", "VLLM_USE", "MALLOC_"))}


def speedsfi_events(base_url: str) -> dict[str, int]:
    import re

    import httpx

    pat = re.compile(r'^speedsfi_events_total\{event="([^"]+)"\} (\S+)$')
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if m := pat.match(line):
            out[m.group(1)] = int(float(m.group(2)))
    return out


def healthy(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(base_url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarise(recs: list[dict], wall_s: float) -> dict:
    """Latencies, throughput and exact match of the requests answered in full (no error, not dropped
    by the client on purpose); errors and client drops counted."""
    ok = [r for r in recs if r["error"] is None and not r.get("aborted")]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    checked = [r for r in ok if "correct" in r]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {
        "requests": len(recs), "errors": sum(r["error"] is not None for r in recs),
        "aborted": sum(bool(r.get("aborted")) for r in recs),
        "aborted_with_error": sum(bool(r.get("aborted")) and r["error"] is not None for r in recs),
        "error_messages": sorted({r["error"] for r in recs if r["error"]})[:10],
        "wall_s": round(wall_s, 2),
        "request_throughput_per_s": round(len(ok) / wall_s, 3),
        "output_tokens_per_s": round(out_tokens / wall_s, 2),
        "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in ok) / wall_s, 1),
        "ttft_ms": {"p50": ms(pct(ttft, 50)), "p99": ms(pct(ttft, 99)), "mean": ms(sum(ttft) / len(ttft)) if ttft else None},
        "tpot_ms": {"p50": ms(pct(tpot, 50)), "p99": ms(pct(tpot, 99)), "mean": ms(sum(tpot) / len(tpot)) if tpot else None},
        "e2e_ms": {"p50": ms(pct([r["e2e_s"] for r in ok], 50)), "p99": ms(pct([r["e2e_s"] for r in ok], 99))},
        "exact_match": round(sum(r["correct"] for r in checked) / len(checked), 4) if checked else None,
    }


def counter_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    d = {k: v for k, v in sorted(d.items()) if v}
    ctx = d.get("sfi.fast_context_tokens", 0)
    return {"events": d,
            "sfi_fast_retained_fraction": round(d.get("sfi.fast_retained_tokens", 0) / ctx, 4) if ctx else None,
            "fallbacks": {k: v for k, v in d.items() if k.startswith("fallback.")}}


def trace_counters(trace_dir: str) -> dict[str, int]:
    """SPEEDSFI's counters of a server this script started, summed over its processes (their trace
    files: the same numbers /metrics exports, independent of the exposition format)."""
    from vllm_ext.metrics import read_traces

    total: dict[str, int] = {}
    for counts in read_traces(trace_dir).values():
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total


def run_config(name: str, base_url: str, model: str, pid: int | None, args, passes, warm,
               counters=None) -> dict:
    """``passes``: the measured workload, one list of requests per pass (sent one pass after the
    other; resident memory is recorded at the end of each)."""
    counters = counters or (lambda: speedsfi_events(base_url))
    res: dict = {"name": name, "rss_ready": tree_rss(pid)}
    timeline = Timeline(pid, base_url).start() if args.soak else None
    if warm:
        log(f"{name}: warm-up, {len(warm)} requests")
        wrecs, _ = asyncio.run(drive(base_url, model, warm, min(args.concurrency, len(warm)),
                                     args.request_timeout))
        res["warmup_errors"] = sum(r["error"] is not None for r in wrecs)
    res["rss_after_warmup"] = tree_rss(pid)
    # the warm-up's last slots come back after its last answer reached the client: wait for them, or
    # their release would count in the measured run (a race a loaded machine loses)
    before, deadline = counters(), time.monotonic() + 30
    while warm and not _idle(before) and time.monotonic() < deadline:
        time.sleep(0.5)
        before = counters()
    done = []
    half = {}
    n_total = sum(len(w) for w in passes)

    def on_done(rec):
        done.append(rec)
        if timeline is not None:
            timeline.done = len(done)
        if len(done) == n_total // 2:
            half["rss"] = tree_rss(pid)

    if timeline is not None:
        timeline.phase, timeline.t_run = "run", time.perf_counter()

    res["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    recs, wall, res["passes"] = [], 0.0, []
    with RssSampler(pid) as sampler:
        for p, work in enumerate(passes):
            log(f"{name}: {len(work)} requests, concurrency {args.concurrency}"
                + (f" (pass {p + 1} of {len(passes)})" if len(passes) > 1 else ""))
            precs, pwall = asyncio.run(drive(base_url, model, work, args.concurrency,
                                             args.request_timeout, on_done))
            for r in precs:
                r["pass"] = p
            recs += precs
            wall += pwall
            res["passes"].append({"requests": len(precs), "errors": sum(r["error"] is not None for r in precs),
                                  "wall_s": round(pwall, 2), "rss_end": tree_rss(pid)})
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    res["healthy_after"] = healthy(base_url)
    if timeline is not None:                 # the end state: wait until idle, then sample a while
        timeline.phase = "drain"
        t_drain = time.perf_counter()
        deadline = time.monotonic() + args.idle_timeout
        while time.monotonic() < deadline and not is_idle(timeline.sample()):
            time.sleep(1.0)
        res["idle_after_s"] = round(time.perf_counter() - t_drain, 1)
        res["idle_reached"] = time.monotonic() < deadline
        timeline.phase = "end"
        time.sleep(args.end_sample_s)
        timeline.stop()
    deadline = time.monotonic() + 30                         # the last steps' counters, slots back
    while True:
        time.sleep(0.5)
        after = counters()
        if _idle(after) or time.monotonic() > deadline:
            break
    res["rss_middle"] = half.get("rss")
    res["rss_end"] = tree_rss(pid)
    res["rss_timeline_mib"] = sampler.samples
    res.update(summarise(recs, wall))
    res["speedsfi"] = counter_delta(before, after)
    res["slots_idle_after"] = _idle(after)
    if timeline is not None:
        res["timeline"] = timeline.samples
        res["soak"] = soak_summary(timeline.samples, recs, wall)
        res["soak"]["idle_after_s"], res["soak"]["idle_reached"] = res["idle_after_s"], res["idle_reached"]
        sk = res["soak"]
        log(f"{name}: soak: {sk['requests']} requests, {sk['aborted']} aborted, {sk['failures']} failures; "
            f"RSS growth {sk.get('rss_growth_mib')} MiB; end {sk.get('end')}; back to zero {sk['back_to_zero']}")
    res["requests_detail"] = recs
    s = res
    log(f"{name}: {s['requests']} requests, {s['errors']} errors, {s['wall_s']} s; "
        f"TTFT p50 {s['ttft_ms']['p50']} / p99 {s['ttft_ms']['p99']} ms; "
        f"TPOT p50 {s['tpot_ms']['p50']} / p99 {s['tpot_ms']['p99']} ms; exact match {s['exact_match']}; "
        f"RSS {_mib(res['rss_ready'])} -> {_mib(res['rss_after_warmup'])} -> {_mib(res['rss_end'])} MiB")
    return res


def _idle(c: dict) -> bool:
    return (c.get("slots.acquired", 0) == c.get("slots.released", 0)
            and c.get("sfi.slots_assigned", 0) == c.get("sfi.slots_released", 0)
            and c.get("critiprefill.slots_assigned", 0) == c.get("critiprefill.slots_released", 0))


def _mib(r):
    return None if r is None else r["total_mib"]


def code_state(args) -> dict:
    """The code served: a commit given on the command line (e.g. a snapshot of it was served), or
    this tree's git HEAD and its modified paths."""
    import subprocess

    if args.code_commit:
        return {"commit": args.code_commit, "source": "given (--code-commit)"}
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.split("\n")
        return {"commit": head, "modified": [ln[3:] for ln in dirty if ln.strip()]}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None}


def machine_info(args) -> dict:
    import torch

    model_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        vllm_v = version("vllm")
        try:
            vllm_dist = f"vllm-cpu {version('vllm-cpu')}"
        except Exception:
            vllm_dist = f"vllm {vllm_v}"
    except Exception:
        vllm_dist = "unknown"
    cores = os.cpu_count()
    cuda = torch.cuda.is_available()
    desc = args.machine or (f"{cores}-core {platform.machine()} CPU ({model_name}), "
                            f"torch {torch.__version__}, {vllm_dist}"
                            + (f", GPU {torch.cuda.get_device_name(0)}" if cuda else ""))
    return {"description": desc, "cpu": model_name, "cores": cores, "torch": torch.__version__,
            "vllm": vllm_dist, "python": platform.python_version(),
            "load_average_at_start": list(os.getloadavg()),
            "note": "load_average_at_start > 0 means other jobs shared the cores during the run"}


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = data["configs"]
    names = [c["name"] for c in cfgs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(names))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (client-side, streamed)"),
                           (axes[1], "tpot_ms", "TPOT (client-side, streamed)")):
        p50 = [c[key]["p50"] or 0 for c in cfgs]
        p99 = [c[key]["p99"] or 0 for c in cfgs]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        for i, (a, b) in enumerate(zip(p50, p99)):
            ax.text(i - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names)
        if min(p50) > 0 and max(p99) / min(p50) > 20:
            ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    ax = axes[2]
    for c in cfgs:
        tl = c.get("rss_timeline_mib") or []
        if tl:
            ax.plot([t for t, _ in tl], [m for _, m in tl], label=c["name"])
    ax.set_xlabel("s into the measured run")
    ax.set_ylabel("server RSS, MiB (API server + engine core)")
    ax.set_title("server memory")
    ax.legend()
    w = data["workload"]
    fig.suptitle(f"vllm serve --attention-backend speedsfi: {w['num_requests']} requests, concurrency "
                 f"{w['concurrency']}, prompts {w['lengths']} tokens\n{data['machine']['description']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_soak(data: dict, path: str) -> None:
    """One panel per quantity over the measured run (s since it began; the drain and the end state
    after it), configurations overlaid: RSS of each server process role and the total, vLLM's
    KV-cache usage and queue, SPEEDSFI's request, SFI and CritiPrefill slots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rss", "api_server", "RSS API server (MiB)"), ("rss", "engine_core", "RSS engine core (MiB)"),
              ("rss", "worker", "RSS worker (MiB)"), ("rss", "total", "RSS all server processes (MiB)"),
              ("m", "kv_cache_usage", "vLLM KV-cache usage (%)"), ("m", "queue", "requests running + waiting"),
              ("m", "request_slots", "SPEEDSFI request slots in use"),
              ("m", "sfi_slots", "SFI slots (solid), CritiPrefill slots (dashed)")]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ci, c in enumerate(data["configs"]):
        tl = [s for s in c.get("timeline") or [] if s["t"] is not None]
        color = colors[ci % len(colors)]
        run_end = max((s["t"] for s in tl if s["phase"] == "run"), default=None)
        for ax, (kind, key, title) in zip(axes.flat, panels):
            if kind == "rss":
                pts = [(s["t"], s["rss_mib"][key]) for s in tl if s.get("rss_mib")]
            elif key == "queue":
                pts = [(s["t"], s["running"] + s["waiting"]) for s in tl if "running" in s]
            elif key == "kv_cache_usage":
                pts = [(s["t"], 100 * s[key]) for s in tl if key in s]
            else:
                pts = [(s["t"], s[key]) for s in tl if key in s]
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], color=color, lw=1, label=c["name"])
            if key == "sfi_slots":
                pts = [(s["t"], s["critiprefill_slots"]) for s in tl if "critiprefill_slots" in s]
                ax.plot([t for t, _ in pts], [v for _, v in pts], color=color, lw=1, ls="--")
            if run_end is not None:
                ax.axvline(run_end, color=color, lw=0.6, ls=":")
            ax.set_title(title, fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("s since the measured run began (dotted: its last request)")
    axes[0][0].legend(fontsize=8)
    w = data["workload"]
    fig.suptitle(f"soak, vllm serve: {w['num_requests']} requests, concurrency {w['concurrency']}, "
                 f"prompts {w['lengths']} tokens, {w['aborts_planned']} dropped by the client, "
                 f"{w['repeats']} repeated prompts\n{data['machine']['description']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def soak_table(data: dict) -> str:
    rows = ["| config | requests | aborted | failures | wall s | RSS growth MiB: API / engine core / worker / "
            "total | end: request / SFI / CritiPrefill slots | end KV usage | back to zero |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in data["configs"]:
        sk = c.get("soak") or {}
        g = sk.get("rss_growth_mib") or {}
        e = sk.get("end") or {}
        rows.append(f"| {c['name']} | {sk.get('requests')} | {sk.get('aborted')} | {sk.get('failures')} | "
                    f"{sk.get('wall_s')} | {g.get('api_server')} / {g.get('engine_core')} / {g.get('worker')}"
                    f" / {g.get('total')} | {e.get('request_slots')} / {e.get('sfi_slots')} / "
                    f"{e.get('critiprefill_slots')} | {e.get('kv_cache_usage')} | "
                    f"{'yes' if all(sk.get('back_to_zero', {'x': False}).values()) else 'NO'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    vocab = None
    if args.random_ids:                  # ids below the model's vocabulary (1000 when it is not here)
        try:
            with open(os.path.join(args.model, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
        except (OSError, KeyError, ValueError):
            vocab = 1000
    # pass p draws its own prompts (seed + 7919 p): the same mix, no prefix-cache hits across passes
    passes = [make_workload(args.num_requests, lengths, args.extra_tokens, args.seed + 7919 * p,
                            args.random_ids, vocab) for p in range(args.passes)]
    for p, ws in enumerate(passes):
        if args.abort_fraction or args.repeat_fraction:
            add_soak_traits(ws, args.abort_fraction, args.repeat_fraction, args.seed + 7919 * p)
    work = [w for ws in passes for w in ws]
    warm = make_workload(args.warmup, lengths, args.extra_tokens, args.seed + 1, args.random_ids, vocab)
    data = {
        "what": "client-side streamed TTFT / TPOT under concurrent load, vllm serve + SPEEDSFI",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT)
                                                    if sys.executable.startswith(ROOT) else sys.executable,
                                                    os.path.relpath(os.path.abspath(__file__), ROOT),
                                                    *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(args),
        "code": code_state(args),
        "model": os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model,
        "workload": {"num_requests": args.num_requests * args.passes, "passes": args.passes,
                     "concurrency": args.concurrency,
                     "lengths": lengths, "extra_tokens": args.extra_tokens, "warmup": args.warmup,
                     "seed": args.seed, "prompts": "random ids" if args.random_ids else
                     "vllm_ext/quality/tasks.py make_sample (tasks and depths mixed)",
                     "prompt_tokens_total": sum(len(w["prompt_ids"]) for w in work),
                     "output_tokens_total": sum(w["max_tokens"] for w in work),
                     "abort_fraction": args.abort_fraction, "repeat_fraction": args.repeat_fraction,
                     "aborts_planned": sum("abort_after_chunks" in w for w in work),
                     "repeats": sum("repeat_of" in w for w in work),
                     "sampling": "greedy, ignore_eos, stream, stream_options.include_usage"},
        "configs": [],
    }
    if args.base_url:
        import httpx

        base = args.base_url.rstrip("/")
        model = args.served_model_name or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        res = run_config(args.label, base, model, args.server_pid, args, passes, warm)
        res.update(serve_command=None, attached=base)
        data["configs"].append(res)
    else:
        from tests.e2e.served import vllm_serve

        os.makedirs(args.out, exist_ok=True)
        for name, section, serve_args in resolve_configs(args.configs):
            log_path = os.path.join(args.out, f"{args.name}_{name}_server.log")
            sargs = ("--max-model-len", str(args.max_model_len), "--max-num-seqs",
                     str(max(args.concurrency, 1)), *serve_args, *shlex.split(args.serve_args))
            t0 = time.perf_counter()
            extra = None if section is None else {"speedsfi": section}
            served = args.model
            if (section or {}).get("speed", {}).get("enabled") and args.model == DEFAULT_MODEL \
                    and os.path.isfile(os.path.join(SPEED_MODEL, "model.safetensors")):
                served = SPEED_MODEL
                log(f"{name}: serving {os.path.relpath(served, ROOT)} (fine-tuned for SPEED)")
            log(f"{name}: starting vllm serve ({json.dumps(extra)} {' '.join(serve_args)})")
            trace_dir = tempfile.mkdtemp(prefix=f"load_test-{name}-")
            try:
                with vllm_serve(served, log_path, additional_config=extra, args=sargs,
                                env={"SPEEDSFI_TRACE_DIR": trace_dir},
                                startup_timeout_s=args.startup_timeout) as server:
                    startup = time.perf_counter() - t0
                    res = run_config(name, server.base, server.model_name, server.proc.pid, args,
                                     passes, warm, counters=lambda: trace_counters(trace_dir))
                    res["serve_command"] = " ".join(shlex.quote(a) for a in server.proc.args)
                    res["speedsfi_config"] = section
                    res["model"] = os.path.relpath(served, ROOT) if served.startswith(ROOT) else served
                    res["serve_env"] = server_env(server.proc.pid)
                    res["startup_s"] = round(startup, 1)
                    res["healthy_after"] = res["healthy_after"] and server.healthy()
            except Exception as e:                   # a server that did not start: recorded, go on
                log(f"{name}: FAILED: {type(e).__name__}: {str(e)[-2000:]}")
                data["configs"].append({"name": name, "speedsfi_config": section,
                                        "failure": f"{type(e).__name__}: {str(e)[-4000:]}",
                                        "server_log": log_path})
                continue
            soak_ok = not args.soak or all(res["soak"]["back_to_zero"].values())
            if not res["errors"] and res["healthy_after"] and soak_ok:
                os.unlink(log_path)                      # kept only when something went wrong
            else:
                res["server_log"] = log_path
            data["configs"].append(res)
    failures = [c for c in data["configs"] if "failure" in c]
    data["configs"] = [c for c in data["configs"] if "failure" not in c]
    data["failed_configs"] = failures
    failed = bool(failures)
    for c in data["configs"]:
        c["rss_growth_mib"] = {
            "ready_to_end": _delta(c["rss_ready"], c["rss_end"]),
            "after_warmup_to_end": _delta(c["rss_after_warmup"], c["rss_end"]),
            "middle_to_end": _delta(c["rss_middle"], c["rss_end"]),
        }
        failed |= bool(c["errors"] or c.get("warmup_errors") or not c["healthy_after"])
        if args.soak:
            failed |= not all(c["soak"]["back_to_zero"].values())
    if args.soak:
        data["soak_comparison"] = soak_compare(data["configs"])
    os.makedirs(args.out, exist_ok=True)
    jpath = os.path.join(args.out, f"{args.name}.json")
    with open(jpath, "w") as f:
        # compact: per-request detail and the RSS timeline make an indented file 1.4x larger, and
        # results travel with the tree to the GPU machine (64 MiB per call)
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    log(f"wrote {jpath}")
    if not data["configs"]:
        log("FAILED: no configuration ran")
        return 1
    if not args.no_plot:
        ppath = os.path.join(args.out, f"{args.name}.png")
        (plot_soak if args.soak else plot)(data, ppath)
        log(f"wrote {ppath}")
    print(table(data))
    if args.soak:
        print(soak_table(data))
    if failed:
        log("FAILED: request errors or an unhealthy server (see the JSON)")
    return 1 if failed else 0


def _delta(a, b):
    return None if a is None or b is None else round(b["total_mib"] - a["total_mib"], 1)


def table(data: dict) -> str:
    rows = ["| config | requests | errors | TTFT p50 / p99 ms | TPOT p50 / p99 ms | out tok/s | exact match "
            "| fast-step retained | RSS ready / after warm-up / end MiB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in data["configs"]:
        em = "-" if c["exact_match"] is None else f"{100 * c['exact_match']:.1f}%"
        ret = c["speedsfi"]["sfi_fast_retained_fraction"]
        rows.append(f"| {c['name']} | {c['requests']} | {c['errors']} | {c['ttft_ms']['p50']} / "
                    f"{c['ttft_ms']['p99']} | {c['tpot_ms']['p50']} / {c['tpot_ms']['p99']} | "
                    f"{c['output_tokens_per_s']} | {em} | {'-' if ret is None else f'{ret:.3f}'} | "
                    f"{_mib(c['rss_ready'])} / {_mib(c['rss_after_warmup'])} / {_mib(c['rss_end'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
