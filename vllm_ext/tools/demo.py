"""The main job: serve a model with ``vllm serve --attention-backend speedsfi`` and ask it through the
OpenAI client; print the answers and the backend's counters; stop the server(s).

    python -m vllm_ext.tools.demo                      # a real model, a question about a long document,
                                                       # then a batch of long requests timed
    python -m vllm_ext.tools.demo --batch-only [--batch-requests 8 --batch-length 8000]
    python -m vllm_ext.tools.demo --retrieval-model    # the committed retrieval model, every method
    python -m vllm_ext.tools.demo --model DIR_OR_HF_ID [--additional-config JSON] [-- serve args]
    python -m vllm_ext.tools.demo --model DIR_OR_HF_ID --compare      # the method on any model

By default it serves the real pretrained model of ``vllm_ext.tools.real_model`` (SmolLM2-135M-Instruct,
built from a PyPI wheel into ``.cache/real_model``) for each method: dense (every method off), SFI's
default preset (``{"speedsfi": {"preset": "sfi"}}``) and CritiPrefill (a section sparse at this
length); dense is a request with SFI off on SFI's server (:func:`server_plan`). It asks each,
through the chat completions endpoint (the model's chat template), the same question about a
~5K-token document a person can read (``vllm_ext/quality/document.py``: a survey logbook with one
locker number in it) and prints the question, the expected answer, every answer, whether it is
right, the fraction of the KV each method read (from SPEEDSFI's counters), the time of each request
(the request only; each server's start-up is printed separately) and a summary table. When the
model cannot be had (no network on a fresh machine), it says why and runs the retrieval demo
instead. Then (``--no-batch`` skips it, ``--batch-only`` runs it alone, on ``--model`` when given)
it times a batch of long requests decoding together, with SFI off for them and with the preset, and
prints the tokens per second of each and their ratio (``vllm_ext.tools.demo_batch``, in a child
process: one in-process engine; its log goes to a file, its ``[demo]`` lines here).

``--retrieval-model`` serves ``models/retrieval-llama`` (a 4-layer Llama trained in this repository to
find a needle in up to 2K tokens; ``bench/QUALITY.md``) for each method (dense, SFI, SPEED and
CritiPrefill, each alone; dense on SFI's server as above) and asks each the same long-context
retrieval question. SPEED uses
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
                     "block-sparse prefill: each 128-query segment reads 256 keys chosen by "
                     "criticality and its own diagonal"),
}

# The real-model demo (the default): method -> (speedsfi section, extra `vllm serve` arguments). SFI
# and CritiPrefill are their presets, by name (what a preset holds is configs/'s business). CritiPrefill's
# follows its authors' code: sparse from position 4096 on, the last segment dense, so at ~5K tokens it
# makes one 512-query segment sparse (a more aggressive setting, sparse from the first token, missed
# this question at every budget tried on SmolLM2-135M: bench/QUALITY.md, "The demo's question").
DOCUMENT_METHODS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "dense": ({}, ()),
    "sfi": ({"preset": "sfi"}, ()),
    "critiprefill": ({"preset": "critiprefill"}, ()),
}
DOCUMENT_LENGTH = 5000          # prompt tokens, chat template included
DOCUMENT_MAX_TOKENS = 24

SFI_OFF = {"sfi": {"enabled": False}}


def server_plan(methods: list[str]) -> list[tuple[str, list[tuple[str, dict | None]]]]:
    """The servers the demo starts, in order, and what is asked of each: (the method whose section
    the server runs, [(method, the request's speedsfi overrides)]). Dense rides on SFI's server as a
    request with SFI off (every method off for that request: what the README's examples compare, and
    the same tokens as dense: tests/e2e/test_sfi_e2e.py), so asking both starts one server (its prefix
    cache off: :func:`_shared_args`); SPEED and CritiPrefill are engine-wide and get a server each."""
    plan: list[tuple[str, list[tuple[str, dict | None]]]] = []
    for name in methods:
        if name == "dense" and "sfi" in methods:
            continue
        asks = [("dense", SFI_OFF)] if name == "sfi" and "dense" in methods else []
        plan.append((name, asks + [(name, None)]))
    return plan


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
        self.start_s: float | None = None        # `vllm serve` launched -> /health answered

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
    trace_dir = os.path.join(work, "trace")
    env = dict(os.environ, SPEEDSFI_TRACE_DIR=trace_dir, SPEEDSFI_TRACE_INTERVAL_S="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if additional_config:
        json.loads(additional_config)            # fail here on malformed JSON
    log_path = log_path or os.path.join(work, "server.log")
    if not quiet:
        print(f"[demo] server log: {log_path}")
    t0 = time.monotonic()
    # the port is free when picked and bound by the server seconds later; another process may take it
    # in between, and then the server is started again on another port
    for attempt in range(3):
        port = _free_port()
        cmd = _vllm_cli() + ["serve", model, "--attention-backend", "speedsfi", "--host", "127.0.0.1",
                             "--port", str(port), "--max-model-len", str(max_model_len), "--enforce-eager",
                             "--served-model-name", "speedsfi-demo"]
        if additional_config:
            cmd += ["--additional-config", additional_config]
        cmd += [a for a in extra if a != "--"]
        print("[demo] $ " + " ".join(shlex.quote(a) for a in cmd))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        server = _Server(f"http://127.0.0.1:{port}", proc, trace_dir, log_path)
        try:
            _wait_healthy(server.base, proc, timeout)
            break
        except (RuntimeError, TimeoutError) as e:
            _stop(proc)
            with open(log_path, errors="replace") as f:
                text = f.read()
            if "Address already in use" in text and attempt < 2:
                print(f"[demo] port {port} was taken before the server bound it: starting it on another")
                continue
            raise ServeFailed(str(e), _reason(text), text[-6000:]) from None
        except BaseException:
            _stop(proc)
            raise
    try:
        server.start_s = time.monotonic() - t0
        print(f"[demo] server healthy after {server.start_s:.1f} s (server start)")
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
    ap.add_argument("--model", help="checkpoint directory or Hugging Face id (default: the real model "
                                    "of vllm_ext.tools.real_model, a document question per method)")
    ap.add_argument("--retrieval-model", action="store_true",
                    help="the committed retrieval model (models/retrieval-llama), a retrieval question "
                         "per method (dense, SFI, SPEED, CritiPrefill)")
    ap.add_argument("--tiny", action="store_true", help="serve an embedded tiny Qwen3 (random weights), "
                                                        "one prompt")
    ap.add_argument("--compare", action="store_true",
                    help="with --model: every method on a RULER text prompt sized by its tokenizer")
    ap.add_argument("--methods", default=None,
                    help="methods to compare, comma-separated (default: "
                         f"{','.join(DOCUMENT_METHODS)} on the real model, {','.join(METHODS)} otherwise)")
    ap.add_argument("--task", default="niah_multikey", help="retrieval task (vllm_ext/quality/tasks.py)")
    ap.add_argument("--length", type=int, default=None,
                    help=f"prompt tokens of the question (default: {DOCUMENT_LENGTH} for the document, "
                         "chat template included; 2048 otherwise)")
    ap.add_argument("--depth", type=float, default=0.5,
                    help="where the fact / needle sits, 0 (start) to 1 (end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default=None,
                    help="one-server mode: the prompt (default: a short sentence)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"one-server mode: 32; document: {DOCUMENT_MAX_TOKENS}; retrieval: the answer's "
                         "length + 2 (text prompts: 24)")
    ap.add_argument("--additional-config", default=None,
                    help='one-server mode, e.g. \'{"speedsfi": {"preset": "dense"}}\'')
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for each server")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    ap.add_argument("--batch-only", action="store_true",
                    help="only the batch section: requests decoding together, SFI off vs the preset "
                         "(the real model, or --model)")
    ap.add_argument("--no-batch", action="store_true", help="skip the batch section after the document question")
    ap.add_argument("--batch-requests", type=int, default=None,
                    help="batch section: requests decoding together (default 4)")
    ap.add_argument("--batch-length", type=int, default=None,
                    help="batch section: prompt tokens of each request (default 3500)")
    ap.add_argument("--batch-steps", type=int, default=None,
                    help="batch section: timed decode steps of each run (default 64)")
    ap.add_argument("--batch-threads", type=int, default=None,
                    help="batch section, CPU build: OpenMP threads while decoding (default 1: thread CPU "
                         "time; 0: every core, wall time)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")
    args = ap.parse_args(argv)
    if args.batch_only:
        model = args.model
        if model is None:
            from vllm_ext.tools import real_model

            try:
                model = str(real_model.ensure(log=lambda m: print(f"[demo] {m}", flush=True)))
            except Exception as e:                              # noqa: BLE001 - said, then stop
                print(f"[demo] the real model is not available: {e}", file=sys.stderr)
                return 1
        return _batch(args, model)
    one_server = args.tiny or args.prompt is not None or args.additional_config is not None or (
        args.model is not None and not args.compare)
    if one_server:
        return _one_server(args)
    if args.model is not None:
        return _compare(args)
    if not args.retrieval_model:
        from vllm_ext.tools import real_model

        try:
            model_dir = real_model.ensure(log=lambda m: print(f"[demo] {m}", flush=True))
        except Exception as e:                                  # noqa: BLE001 - any cause falls back
            kind = "" if isinstance(e, real_model.RealModelError) else f"{type(e).__name__}: "
            print(f"[demo] the real model is not available: {kind}{e}")
            print("[demo] falling back to the committed retrieval model demo (--retrieval-model)")
        else:
            rc = _document(args, str(model_dir))
            if args.no_batch:
                return rc
            print()
            return _batch(args, str(model_dir)) or rc
    if not RETRIEVAL_MODEL.is_dir():
        print(f"[demo] {RETRIEVAL_MODEL} is not here (an installed wheel, not the repository): "
              "serving the embedded tiny model instead")
        args.tiny = True
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
    if args.length is None:
        args.length = 2048
    methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
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
    for server_name, asks in server_plan(methods):
        section, serve_args, _ = METHODS[server_name]
        enabled = [m for m, sec in section.items() if isinstance(sec, dict) and sec.get("enabled")]
        missing = [m for m in enabled if m not in IMPLEMENTED_METHODS]
        if missing:
            for name, _ in asks:
                print(f"[demo] ---- {name}: {METHODS[name][2]}")
                print(f"[demo] {name}: skipped, not in this build yet")
                rows.append((name, "(not in this build)", "-", "-", "-", ""))
            continue
        served = model
        if server_name == "speed" and not text and (SPEED_MODEL / "model.safetensors").is_file():
            served = str(SPEED_MODEL)
        config = json.dumps({"speedsfi": section})
        print(f"[demo] ---- {asks[0][0]}: {_what(asks[0], METHODS[asks[0][0]][2], server_name)}")
        try:
            with _served(served, config, _shared_args(asks, [*serve_args, *args.serve_args]),
                         timeout=args.timeout, max_model_len=max_model_len, quiet=True) as server:
                for i, (name, overrides) in enumerate(asks):
                    if i:
                        print(f"[demo] ---- {name}: {_what(asks[i], METHODS[name][2], server_name)}")
                    if name == "speed" and served != model:
                        print(f"[demo] {name}: serving {os.path.relpath(served, REPO)} (fine-tuned for SPEED)")
                    elif name == "speed":
                        print(f"[demo] {name}: note: {os.path.basename(served)} was not fine-tuned for SPEED "
                              "(ALGORITHMS.md §2), so its upper layers lose the prompt")
                    before = server.counters()
                    t0 = time.monotonic()
                    resp = server.client().completions.create(
                        model="speedsfi-demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                        extra_body={"return_token_ids": True, "ignore_eos": True, **_xargs(overrides)})
                    dt = time.monotonic() - t0
                    after = server.wait_idle(before)
                    d = _request_counters(before, after)
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
                    fallbacks, built = _report_counters(name, d)
                    failed |= not built
                    rows.append((name, answer, correct, kept, f"{dt:.1f} s", fallbacks))
        except ServeFailed as e:                       # raised before the server answers anything
            for name, _ in asks:
                print(f"[demo] {name}: refused at start-up: {e.reason or e}")
                rows.append((name, "(refused at start-up)", "-", "-", "-", ""))
            failed = True
    print()
    print("[demo] summary (greedy; 'kept': the fraction of the KV each method reads or keeps, from "
          "its counters; 'time': the request only, server start excluded)")
    width = max(len(r[1]) for r in rows) if rows else 10
    print(f"    {'method':<13} {'answer':<{width}}  {'correct':<8} {'kept':<6} {'time':<8} fallbacks")
    for name, answer, correct, kept, dt, fb in rows:
        print(f"    {name:<13} {answer:<{width}}  {correct:<8} {kept:<6} {dt:<8} {fb or '-'}")
    return 1 if failed else 0


def _request_counters(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters one request moved (the server's totals after it minus before), sorted, zeros out."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(d.items()) if v}


def _report_counters(name: str, d: dict[str, int]) -> tuple[str, bool]:
    """Print a request's counters and say whether SPEEDSFI built a step for it (an error line when
    not); returns (its fallbacks, comma-separated, "" for none; built)."""
    print(f"[demo] {name}: counters {json.dumps(d)}")
    built = bool(d.get("steps.built"))
    if not built:
        print(f"[demo] ERROR: the SPEEDSFI backend never built a step for {name}", file=sys.stderr)
    return ", ".join(k for k in d if k.startswith("fallback.")), built


def _shared_args(asks: list, serve_args: list[str]) -> list[str]:
    """A server asked more than once prefills each request whole: with vLLM's prefix cache on, the
    second request would reuse the first one's prompt KV and its time would say nothing about its
    method."""
    if len(asks) > 1 and "--no-enable-prefix-caching" not in serve_args:
        return [*serve_args, "--no-enable-prefix-caching"]
    return list(serve_args)


def _xargs(overrides: dict | None) -> dict:
    """A request's speedsfi overrides as the OpenAI endpoints take them (``vllm_xargs``)."""
    return {"vllm_xargs": {"speedsfi": json.dumps(overrides)}} if overrides else {}


def _what(ask: tuple[str, dict | None], what: str, server_name: str) -> str:
    """The header of a method's run: what it does, or, for dense on another method's server, how."""
    name, overrides = ask
    if overrides == SFI_OFF and name != server_name:
        return (f"SFI off for this request, on the {server_name} server (every method off for it: "
                "the reference)")
    return what


def _describe(section: dict) -> str:
    """One line saying what a document-demo section does, read from its resolved config (a preset's
    fields come from the preset file)."""
    from vllm_ext.config import SpeedSfiConfig

    cfg = SpeedSfiConfig.from_dict(section)
    parts = []
    if cfg.sfi.enabled:
        c = cfg.sfi
        parts.append(f"sparse decode: fast steps read sink {c.n_sink} + {c.k} selected + the last "
                     f"{c.n_recent} tokens; dense slow steps ({c.schedule} schedule)")
    if cfg.speed.enabled:
        parts.append("SPEED: the prompt's KV only in the lower layers")
    if cfg.critiprefill.enabled:
        c = cfg.critiprefill
        sink = "the sink block, " if c.sink_block else ""
        parts.append(f"block-sparse prefill: each {c.segment_size}-query segment reads {sink}"
                     f"{c.budget} keys in {c.block_size}-key blocks chosen by criticality and its own "
                     f"diagonal (segments from position {c.min_len} on, the last one dense; layer(s) "
                     f"{','.join(map(str, c.dense_layers)) or 'none'} dense)")
    where = f"preset {section['preset']!r}: " if "preset" in section else ""
    return where + ("; ".join(parts) or "SPEEDSFI with every method off (the reference)")


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:                                           # noqa: BLE001
        return True


def _document(args, model: str) -> int:
    """The default: the real model, a question about a long document, asked of each method."""
    from transformers import AutoTokenizer

    from vllm_ext.quality.document import make_document_question

    methods = [m.strip() for m in (args.methods or ",".join(DOCUMENT_METHODS)).split(",") if m.strip()]
    unknown = [m for m in methods if m not in DOCUMENT_METHODS]
    if unknown:
        print(f"[demo] unknown method(s) {unknown}; known on the real model: "
              f"{', '.join(DOCUMENT_METHODS)} (--retrieval-model for SPEED)", file=sys.stderr)
        return 2
    length = args.length or DOCUMENT_LENGTH
    max_tokens = args.max_tokens or DOCUMENT_MAX_TOKENS
    tok = AutoTokenizer.from_pretrained(model)
    q = make_document_question(tok, length, args.depth, args.seed)
    n_prompt = q.prompt_tokens(tok)
    positions = _max_positions(model) or 8192
    max_model_len = min(positions, n_prompt + max_tokens + 64)
    if n_prompt + max_tokens > max_model_len:
        print(f"[demo] a {n_prompt}-token prompt and {max_tokens} answer tokens do not fit the model's "
              f"{positions} positions; ask for a shorter --length", file=sys.stderr)
        return 2
    n_days = q.document.count("\n\n") + 1
    print(f"[demo] model: {model} ({_num_layers(model)} layers; vllm_ext.tools.real_model)")
    print(f"[demo] document: a survey logbook of {n_days} days, {len(q.document.split()):,} words; the "
          f"prompt is {n_prompt:,} tokens with the chat template; one fact at {args.depth:.0%} of it "
          f"(seed {args.seed}):")
    print("    " + q.document[:300].replace("\n\n", " / ") + " [...]")
    print(f"[demo] the fact: {q.fact!r}")
    print(f"[demo] question (chat completions, one user turn: the question, the document, the question "
          f"again): {q.question!r}")
    print(f"[demo] expected answer: {q.answer}")
    serve_args = list(args.serve_args)
    if _on_cpu() and "--dtype" not in serve_args:
        serve_args = ["--dtype", "float32", *serve_args]     # the CPU path's tested dtype (bf16 on disk)
    print()
    rows, failed = [], False
    for server_name, asks in server_plan(methods):
        section, extra = DOCUMENT_METHODS[server_name]
        print(f"[demo] ---- {asks[0][0]}: {_what(asks[0], _describe(DOCUMENT_METHODS[asks[0][0]][0]), server_name)}")
        config = json.dumps({"speedsfi": section})
        start = "-"
        try:
            with _served(model, config, _shared_args(asks, [*extra, *serve_args]), timeout=args.timeout,
                         max_model_len=max_model_len, quiet=True) as server:
                start = f"{server.start_s:.1f}"
                for i, (name, overrides) in enumerate(asks):
                    if i:
                        print(f"[demo] ---- {name}: "
                              f"{_what(asks[i], _describe(DOCUMENT_METHODS[name][0]), server_name)}")
                    before = server.counters()
                    t0 = time.monotonic()
                    resp = server.client().chat.completions.create(
                        model="speedsfi-demo", messages=q.messages(), max_tokens=max_tokens,
                        temperature=0, extra_body=_xargs(overrides))
                    dt = time.monotonic() - t0
                    after = server.wait_idle(before)
                    d = _request_counters(before, after)
                    answer = (resp.choices[0].message.content or "").strip()
                    correct = "yes" if q.correct(answer) else "no"
                    kept, kept_what = _kept(name, d, _num_layers(model))
                    print(f"[demo] {name}: answer {answer!r}  correct: {correct}")
                    print(f"[demo] {name}: request {dt:.1f} s ({resp.usage.prompt_tokens:,} prompt + "
                          f"{resp.usage.completion_tokens} answer tokens; the request only), server start {start} s"
                          f"{'' if i == 0 else ' (shared)'}")
                    print(f"[demo] {name}: KV read {kept} {kept_what}")
                    fallbacks, built = _report_counters(name, d)
                    failed |= not built
                    rows.append((name, answer, correct, kept, f"{dt:.1f}", start if i == 0 else "shared",
                                 fallbacks))
        except ServeFailed as e:                       # raised before the server answers anything
            for name, _ in asks:
                print(f"[demo] {name}: refused at start-up: {e.reason or e}")
                rows.append((name, "(refused at start-up)", "-", "-", "-", start, ""))
            failed = True
    print()
    print(f"[demo] summary: {os.path.basename(model)}, a {n_prompt:,}-token document question, greedy, "
          f"expected answer {q.answer}")
    print("    'KV read': the fraction of the KV each method read, from SPEEDSFI's counters (dense: all "
          "of it; sfi: of the context, on its fast decode steps; critiprefill: of the candidate key "
          "blocks, in its sparse prefill segments)")
    print("    'request s': the chat completion request only (prefill + decode, as the client saw it), "
          "server start excluded; 'start s': `vllm serve` until healthy ('shared': the row above's "
          "server, dense being a request with SFI off on SFI's)")
    width = max([len(r[1]) for r in rows] + [6])
    print(f"    {'method':<13} {'answer':<{width}}  {'correct':<8} {'KV read':<8} {'request s':<10} "
          f"{'start s':<8} fallbacks")
    for name, answer, correct, kept, dt, start, fb in rows:
        print(f"    {name:<13} {answer:<{width}}  {correct:<8} {kept:<8} {dt:<10} {start:<8} {fb or '-'}")
    return 1 if failed else 0


def _batch(args, model: str) -> int:
    """The batch section (``vllm_ext.tools.demo_batch``) in a child process: its ``[demo]`` lines are
    printed here (progress redrawn in place on a terminal), everything else goes to its log file."""
    from vllm_ext.tools import demo_batch

    if os.path.exists(model):
        model = os.path.abspath(model)                # the child runs in the repository
    cmd = [sys.executable, "-m", "vllm_ext.tools.demo_batch", "--model", model]
    for flag, value in (("--requests", args.batch_requests), ("--length", args.batch_length),
                        ("--steps", args.batch_steps), ("--threads", args.batch_threads)):
        if value is not None:
            cmd += [flag, str(value)]
    fd, log_path = tempfile.mkstemp(prefix="speedsfi-demo-batch-", suffix=".log")
    os.close(fd)
    print(f"[demo] ---- batch: requests decoding together, SFI off for them and the `sfi` preset; "
          f"log: {log_path}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    inline = sys.stdout.isatty()
    pending = False                                   # a progress line drawn without its newline
    with open(log_path, "w", buffering=1) as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=str(REPO), start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                if not line.startswith("[demo]"):
                    continue
                if inline and line.startswith(demo_batch.PROGRESS):
                    sys.stdout.write("\r\033[K" + line.rstrip("\n"))
                    pending = True
                else:
                    sys.stdout.write(("\n" if pending else "") + line)
                    pending = False
                sys.stdout.flush()
            proc.wait()
        except BaseException:
            _stop(proc)
            raise
    if pending:
        print()
    if proc.returncode:
        with open(log_path, errors="replace") as f:
            sys.stderr.write(f.read()[-6000:])
        print(f"[demo] batch: failed (exit {proc.returncode}); log: {log_path}", file=sys.stderr)
        return 1
    return 0


def _max_positions(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
