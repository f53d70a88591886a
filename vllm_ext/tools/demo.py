"""The main job: serve a model with ``vllm serve --attention-backend speedsfi``, ask it one question
through the OpenAI client, print the answer and the backend's counters, stop the server.

    python -m vllm_ext.tools.demo [--model DIR_OR_HF_ID] [--additional-config JSON] [-- extra serve args]

Without ``--model`` an embedded tiny Qwen3 checkpoint is built locally (offline, a few seconds); it
answers gibberish, but every token of it went through SPEEDSFI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or Hugging Face id (default: embedded tiny model)")
    ap.add_argument("--prompt", default="the quick brown fox jumps over the lazy dog. the paged kv cache")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--additional-config", default=None,
                    help='e.g. \'{"speedsfi": {"preset": "dense"}}\'')
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="speedsfi-demo-")
    model = args.model
    if model is None:
        from vllm_ext.tools.tiny_models import make_model

        cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                             "vllm-speedsfi", "tiny-qwen3")
        model = make_model(cache, "qwen3")
        print(f"[demo] embedded tiny model: {model}")

    port = _free_port()
    trace_dir = os.path.join(work, "trace")
    env = dict(os.environ, VLLM_EXT_TRACE_DIR=trace_dir, VLLM_EXT_TRACE_INTERVAL_S="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cmd = _vllm_cli() + ["serve", model, "--attention-backend", "speedsfi", "--host", "127.0.0.1",
                         "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
                         "--served-model-name", "speedsfi-demo"]
    if args.additional_config:
        json.loads(args.additional_config)            # fail here on malformed JSON
        cmd += ["--additional-config", args.additional_config]
    extra = [a for a in args.serve_args if a != "--"]
    cmd += extra
    log_path = args.log or os.path.join(work, "server.log")
    print("[demo] $ " + " ".join(cmd))
    print(f"[demo] server log: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        _wait_healthy(base, proc, args.timeout)
        print(f"[demo] server healthy after {time.monotonic() - t0:.1f} s")
        from openai import OpenAI

        client = OpenAI(base_url=base + "/v1", api_key="unused")
        t0 = time.monotonic()
        resp = client.completions.create(model="speedsfi-demo", prompt=args.prompt,
                                         max_tokens=args.max_tokens, temperature=0)
        dt = time.monotonic() - t0
        text = resp.choices[0].text
        print(f"[demo] prompt: {args.prompt!r}")
        print(f"[demo] answer ({resp.usage.completion_tokens} tokens in {dt:.2f} s): {text!r}")
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            exported = [line for line in r.read().decode().splitlines()
                        if line.startswith("speedsfi_events_total")]
        print("[demo] /metrics: " + ("; ".join(exported) or "(no speedsfi_events_total lines)"))
    except Exception:
        _stop(proc)
        with open(log_path) as f:
            sys.stderr.write(f.read()[-6000:])
        raise
    _stop(proc)
    from vllm_ext.metrics import read_traces

    traces = read_traces(trace_dir)
    total: dict[str, int] = {}
    for counts in traces.values():
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    print(f"[demo] SPEEDSFI counters over {len(traces)} process(es): {json.dumps(total, sort_keys=True)}")
    if not total.get("steps.built"):
        print("[demo] ERROR: the SPEEDSFI backend never built a step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
