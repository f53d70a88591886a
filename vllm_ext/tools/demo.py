"""The main job: serve a model with ``vllm serve --attention-backend speedsfi`` and ask it through the
OpenAI client; print the answers and the backend's counters; stop the server(s).

    python -m vllm_ext.tools.demo                      # the method on the committed retrieval model
    python -m vllm_ext.tools.demo --model DIR_OR_HF_ID [--additional-config JSON] [-- serve args]
    python -m vllm_ext.tools.demo --model DIR_OR_HF_ID --compare      # the method on any model

By default it serves ``models/retrieval-llama`` (a 4-layer Llama trained in this repository to find a
needle in up to 2K tokens; ``bench/QUALITY.md``) once per method (dense: every method off, then SFI,
SPEED and CritiPrefill, each alone), asks each the same long-context retrieval question and prints the
question, the expected answer, every method's answer, the KV it kept and its counters. SPEED uses
``models/retrieval-llama-speed`` (the same model fine-tuned under SPEED's visibility rule) when it is
present. ``--compare`` does the same for any ``--model`` with a RULER text prompt sized by its
tokenizer. With ``--model`` alone it asks one prompt of one server (``--additional-config``), as
before; ``--tiny`` serves an embedded tiny Qwen3 built locally (random weights: it answers gibberish,
but every token went through SPEEDSFI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RETRIEVAL_MODEL = REPO / "models" / "retrieval-llama"
SPEED_MODEL = REPO / "models" / "retrieval-llama-speed"     # fine-tuned for SPEED, when present

# method -> (speedsfi section, extra `vllm serve` arguments, one line saying what it keeps)
METHODS: dict[str, tuple[dict, tuple[str, ...], str]] = {
    "dense": ({}, (), "SPEEDSFI with every method off (the reference)"),
    "sfi": ({"sfi": {"enabled": True, "k": 256, "n_recent": 64, "select_span": 4}}, (),
            "sparse decode: fast steps read sink 4 + 256 selected (each with the 3 tokens after it) "
            "+ the last 64 tokens; dense slow steps at sentence ends"),
    "speed": ({"speed": {"enabled": True}}, ("--no-enable-prefix-caching",),
              "the prompt's KV only in the lower 3/4 of the layers; prompt tokens skip the upper ones"),
    "critiprefill": ({"critiprefill": {"enabled": True, "segment_size": 128, "block_size": 16,
                                       "budget": 256, "min_len": 0}}, (),
                     "block-sparse prefill: each 128-query segment reads the sink block, 256 keys "
                     "chosen by criticality and its own diagonal"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_cli() -> list[str]:
    exe = shutil.which("vllm", path=os.path.dirname(sys.executable)) or shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vllm serve was not healthy after {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class ServeFailed(RuntimeError):
    """``vllm serve`` exited or never became healthy; ``reason`` is the line of its log that says why."""

    def __init__(self, message: str, reason: str | None, log_tail: str):
        super().__init__(message)
        self.reason, self.log_tail = reason, log_tail


class _Server:
    def __init__(self, base: str, proc: subprocess.Popen, trace_dir: str, log_path: str):
        self.base, self.proc, self.trace_dir, self.log_path = base, proc, trace_dir, log_path

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=1800)

    def counters(self) -> dict[str, int]:
        """SPEEDSFI's counters summed over the server's processes (their trace files)."""
        from vllm_ext.metrics import read_traces

        total: dict[str, int] = {}
        for counts in read_traces(self.trace_dir).values():
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def wait_idle(self, before: dict[str, int], n_requests: int = 1, timeout_s: float = 20) -> dict[str, int]:
        """Counters once the request's slot is back (its last step's counters are in then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.counters()
            released = now.get("slots.released", 0) - before.get("slots.released", 0)
            if released >= n_requests or time.monotonic() > deadline:
                return now
            time.sleep(0.2)

    def exported(self) -> list[str]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return [line for line in r.read().decode().splitlines() if line.startswith("speedsfi_")]


def _reason(log_text: str) -> str | None:
    for line in reversed(log_text.splitlines()):
        if "ConfigError" in line or "Error:" in line:
            return line.strip()[-400:]
    return None


@contextmanager
def _served(model: str, additional_config: str | None, extra: list[str], *, timeout: float,
            max_model_len: int = 2048, log_path: str | None = None, quiet: bool = False):
    work = tempfile.mkdtemp(prefix="speedsfi-demo-")
    port = _free_port()
    trace_dir = os.path.join(work, "trace")
    env = dict(os.environ, VLLM_EXT_TRACE_DIR=trace_dir, VLLM_EXT_TRACE_INTERVAL_S="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cmd = _vllm_cli() + ["serve", model, "--attention-backend", "speedsfi", "--host", "127.0.0.1",
                         "--port", str(port), "--max-model-len", str(max_model_len), "--enforce-eager",
                         "--served-model-name", "speedsfi-demo"]
    if additional_config:
        json.loads(additional_config)            # fail here on malformed JSON
        cmd += ["--additional-config", additional_config]
    cmd += [a for a in extra if a != "--"]
    log_path = log_path or os.path.join(work, "server.log")
    print("[demo] $ " + " ".join(shlex.quote(a) for a in cmd))
    if not quiet:
        print(f"[demo] server log: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = _Server(f"http://127.0.0.1:{port}", proc, trace_dir, log_path)
    try:
        t0 = time.monotonic()
        try:
            _wait_healthy(server.base, proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            _stop(proc)
            with open(log_path, errors="replace") as f:
                text = f.read()
            raise ServeFailed(str(e), _reason(text), text[-6000:]) from None
        print(f"[demo] server healthy after {time.monotonic() - t0:.1f} s")
        yield server
    except ServeFailed:
        raise
    except BaseException:
        _stop(proc)
        with open(log_path, errors="replace") as f:
            sys.stderr.write(f.read()[-6000:])
        raise
    finally:
        _stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or Hugging Face id (default: the committed "
                                    "retrieval model, once per method)")
    ap.add_argument("--tiny", action="store_true", help="serve an embedded tiny Qwen3 (random weights), "
                                                        "one prompt")
    ap.add_argument("--compare", action="store_true",
                    help="with --model: every method on a RULER text prompt sized by its tokenizer")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"methods to compare, comma-separated (default: {','.join(METHODS)})")
    ap.add_argument("--task", default="niah_multikey", help="retrieval task (vllm_ext/quality/tasks.py)")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens of the retrieval question")
    ap.add_argument("--depth", type=float, default=0.5, help="where the needle sits, 0 (start) to 1 (end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=None,
                    help="one-server mode: the prompt (default: a short sentence)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="one-server mode: 32; comparison: the answer's length + 2 (text prompts: 24)")
    ap.add_argument("--additional-config", default=None,
                    help='one-server mode, e.g. \'{"speedsfi": {"preset": "dense"}}\'')
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for each server")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")
    args = ap.parse_args(argv)
    one_server = args.tiny or args.prompt is not None or args.additional_config is not None or (
        args.model is not None and not args.compare)
    if not one_server and args.model is None and not RETRIEVAL_MODEL.is_dir():
        print(f"[demo] {RETRIEVAL_MODEL} is not here (an installed wheel, not the repository): "
              "serving the embedded tiny model instead")
        args.tiny, one_server = True, True
    if one_server:
        return _one_server(args)
    return _compare(args)


def _one_server(args) -> int:
    model = args.model
    if model is None:
        from vllm_ext.tools.tiny_models import make_model

        cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                             "vllm-speedsfi", "tiny-qwen3")
        model = make_model(cache, "qwen3")
        print(f"[demo] embedded tiny model: {model}")
    prompt = args.prompt or "the quick brown fox jumps over the lazy dog. the paged kv cache"
    max_tokens = args.max_tokens or 32
    with _served(model, args.additional_config, args.serve_args, timeout=args.timeout,
                 log_path=args.log) as server:
        t0 = time.monotonic()
        resp = server.client().completions.create(model="speedsfi-demo", prompt=prompt,
                                                  max_tokens=max_tokens, temperature=0)
        dt = time.monotonic() - t0
        text = resp.choices[0].text
        print(f"[demo] prompt: {prompt!r}")
        print(f"[demo] answer ({resp.usage.completion_tokens} tokens in {dt:.2f} s): {text!r}")
        exported = [line for line in server.exported() if line.startswith("speedsfi_events_total")]
        print("[demo] /metrics: " + ("; ".join(exported) or "(no speedsfi_events_total lines)"))
        server.wait_idle({}, 1, timeout_s=5)
    total = server.counters()
    print(f"[demo] SPEEDSFI counters: {json.dumps(total, sort_keys=True)}")
    if not total.get("steps.built"):
        print("[demo] ERROR: the SPEEDSFI backend never built a step", file=sys.stderr)
        return 1
    return 0


def _abbreviate(words: list[str], head: int = 14, tail: int = 34) -> str:
    show = [("\\n" if w == "\n" else w) for w in words]
    if len(show) <= head + tail:
        return " ".join(show)
    return (" ".join(show[:head]) + f"  [... {len(show) - head - tail:,} tokens ...]  "
            + " ".join(show[-tail:]))


def _kept(name: str, d: dict[str, int], num_layers: int | None) -> tuple[str, str]:
    """(the fraction kept, what it is) for a method, from its counters."""
    if name == "sfi":
        ctx = d.get("sfi.fast_context_tokens", 0)
        if not ctx:
            return "1.00", "no fast decode step (the history fits the budget)"
        return (f"{d.get('sfi.fast_retained_tokens', 0) / ctx:.3f}",
                f"of the KV read on fast decode steps ({d.get('sfi.fast_steps', 0)} fast, "
                f"{d.get('sfi.slow_steps', 0)} slow dense steps)")
    if name == "critiprefill":
        cand = d.get("critiprefill.key_blocks_candidate", 0)
        if not cand:
            return "1.00", "no sparse prefill segment"
        return (f"{d.get('critiprefill.key_blocks_read', 0) / cand:.3f}",
                f"of the candidate key blocks read in {d.get('critiprefill.sparse_segments', 0)} "
                "sparse prefill segments")
    if name == "speed":
        cut = METHODS["speed"][0]["speed"].get("l_cut")
        if num_layers:
            cut = cut or max(1, 3 * num_layers // 4)
            return (f"{cut / num_layers:.3f}",
                    f"of the prompt's KV (layers 0-{cut - 1} of {num_layers}; above: BoS + decode "
                    f"tokens; {d.get('speed.blocks_saved', 0)} blocks never allocated, "
                    f"{d.get('speed.upper_tokens_skipped', 0)} prompt tokens skipped the upper layers)")
        return "-", f"{d.get('speed.blocks_saved', 0)} KV blocks never allocated"
    return "1.000", "all of it"


def _num_layers(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get("num_hidden_layers")
    except (OSError, ValueError):
        return None


def _compare(args) -> int:
    from vllm_ext.backend.startup import IMPLEMENTED_METHODS
    from vllm_ext.quality import tasks as T

    text = args.model is not None
    model = args.model or str(RETRIEVAL_MODEL)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"[demo] unknown method(s) {unknown}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if text:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        sample = T.make_text_sample(args.task, args.length, args.depth, args.seed, tok)
        prompt: str | list[int] = sample.prompt
        max_tokens = args.max_tokens or 24
        n_prompt = len(tok(sample.prompt, add_special_tokens=True)["input_ids"])
        print(f"[demo] model: {model}")
        print(f"[demo] question ({args.task}, {n_prompt:,} tokens, the needle at {args.depth:.0%} "
              "of the context):")
        print("    " + (sample.prompt[:240] + " [...] " + sample.prompt[-400:]).replace("\n", " / "))
        print(f"[demo] expected answer: {sample.answer}")
    else:
        sample = T.make_sample(args.task, args.length, args.depth, args.seed)
        prompt = sample.prompt_ids
        max_tokens = args.max_tokens or len(sample.answer_ids) + 2
        words = T.words_of(sample.prompt_ids)
        s0, s1 = sample.target_spans[0]
        print(f"[demo] model: {os.path.relpath(model, REPO)} (4-layer Llama, 0.67 M parameters, trained "
              "here to retrieve; bench/QUALITY.md)")
        print(f"[demo] question ({args.task}, {len(words):,} tokens; the needle at {args.depth:.0%} of "
              f"the context{', among distractor needles' if sample.meta.get('n_needles', 1) > 1 else ''}):")
        print("    " + _abbreviate(words))
        print(f"[demo] the needle, at tokens {s0}-{s1 - 1}: {' '.join(T.words_of(sample.prompt_ids[s0:s1]))!r}")
        print(f"[demo] expected answer: {' '.join(T.words_of(sample.answer_ids))!r}")
    print()
    rows, failed = [], False
    max_model_len = args.length + max(max_tokens, 32) + (256 if text else 0)
    for name in methods:
        section, serve_args, what = METHODS[name]
        enabled = [m for m, sec in section.items() if isinstance(sec, dict) and sec.get("enabled")]
        missing = [m for m in enabled if m not in IMPLEMENTED_METHODS]
        print(f"[demo] ---- {name}: {what}")
        if missing:
            print(f"[demo] {name}: skipped, not in this build yet")
            rows.append((name, "(not in this build)", "-", "-", "-", ""))
            continue
        served = model
        if name == "speed" and not text and (SPEED_MODEL / "model.safetensors").is_file():
            served = str(SPEED_MODEL)
            print(f"[demo] {name}: serving {os.path.relpath(served, REPO)} (fine-tuned for SPEED)")
        elif name == "speed":
            print(f"[demo] {name}: note: {os.path.basename(served)} was not fine-tuned for SPEED "
                  "(ALGORITHMS.md §2), so its upper layers lose the prompt")
        config = json.dumps({"speedsfi": section})
        try:
            with _served(served, config, [*serve_args, *args.serve_args], timeout=args.timeout,
                         max_model_len=max_model_len, quiet=True) as server:
                before = server.counters()
                t0 = time.monotonic()
                resp = server.client().completions.create(
                    model="speedsfi-demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True})
                dt = time.monotonic() - t0
                after = server.wait_idle(before)
        except ServeFailed as e:
            print(f"[demo] {name}: refused at start-up: {e.reason or e}")
            rows.append((name, "(refused at start-up)", "-", "-", "-", ""))
            failed = True
            continue
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        d = {k: v for k, v in sorted(d.items()) if v}
        choice = resp.choices[0]
        if text:
            answer = choice.text.strip()
            score = T.text_score(sample, choice.text)
            correct = "yes" if score == 1 else f"{score:.0%}"
        else:
            ids = list(choice.token_ids or [])
            answer = " ".join(T.words_of(ids[:len(sample.answer_ids)]))
            correct = "yes" if T.exact_match(sample, ids) else "no"
        kept, kept_what = _kept(name, d, _num_layers(served))
        print(f"[demo] {name}: answer {answer!r}  correct: {correct}  ({resp.usage.completion_tokens} "
              f"tokens in {dt:.1f} s)")
        print(f"[demo] {name}: kept {kept} {kept_what}")
        print(f"[demo] {name}: counters {json.dumps(d)}")
        if not d.get("steps.built"):
            print(f"[demo] ERROR: the SPEEDSFI backend never built a step for {name}", file=sys.stderr)
            failed = True
        fallbacks = {k: v for k, v in d.items() if k.startswith("fallback.")}
        rows.append((name, answer, correct, kept, f"{dt:.1f} s", ", ".join(fallbacks) or ""))
    print()
    print("[demo] summary (greedy; 'kept': the fraction of the KV each method reads or keeps, from "
          "its counters)")
    width = max(len(r[1]) for r in rows) if rows else 10
    print(f"    {'method':<13} {'answer':<{width}}  {'correct':<8} {'kept':<6} {'time':<8} fallbacks")
    for name, answer, correct, kept, dt, fb in rows:
        print(f"    {name:<13} {answer:<{width}}  {correct:<8} {kept:<6} {dt:<8} {fb or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
