"""A real ``vllm serve --attention-backend speedsfi`` process for tests (CPU build), its OpenAI client
and its ``/metrics``; torn down on exit (the process group is signalled, nothing else)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager


# Ports for test servers come from below Linux's ephemeral range (32768 and up), one slice per pytest-xdist
# worker: a port the OS hands out for port 0 (vLLM's own engine and distributed ports, another worker's
# clients) can then never be the one a server is about to bind, and two workers never pick the same one.
_PORTS_BASE, _PORTS_PER_WORKER = 20000, 1500


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = _PORTS_BASE + (index % 8) * _PORTS_PER_WORKER
    for port in random.sample(range(low, low + _PORTS_PER_WORKER), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + _PORTS_PER_WORKER - 1}")


class Server:
    def __init__(self, base: str, model_name: str, proc: subprocess.Popen, log_path: str):
        self.base, self.model_name, self.proc, self.log_path = base, model_name, proc, log_path

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key="unused", **kwargs)

    def healthy(self) -> bool:
        import httpx

        try:
            return (self.proc.poll() is None
                    and httpx.get(self.base + "/health", timeout=10).status_code == 200)
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name{labels}: value} (comments dropped)."""
        import httpx

        text = httpx.get(self.base + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def events(self) -> dict[str, int]:
        """SPEEDSFI's counters (``speedsfi_events_total{event=...}``), summed over the processes."""
        pat = re.compile(r'^speedsfi_events_total\{event="([^"]+)"\}$')
        return {m.group(1): int(v) for k, v in self.metrics().items() if (m := pat.match(k))}

    def log_tail(self, n: int = 6000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session: SIGINT, then SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


SERVED_NAME = "speedsfi-test"


def _serve_command(model: str, port: int, *, backend: str, additional_config: dict | None,
                   args: tuple[str, ...], env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--attention-backend", backend, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME, "--enforce-eager", "--dtype", "float32", *args]
    if additional_config is not None:
        cmd += ["--additional-config", json.dumps(additional_config)]
    # every server its own counters directory: the test process may hold one in its environment (the
    # plugin sets it when an in-process test loads vLLM), and a directory shared with earlier servers
    # sums their processes' counters (slots a killed server held, its fallbacks) into this one's /metrics
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                    SPEEDSFI_FORCE_TORCH_KERNELS="1", SPEEDSFI_TRACE_INTERVAL_S="0",
                    SPEEDSFI_TRACE_DIR=tempfile.mkdtemp(prefix="speedsfi-served-"))
    full_env.update(env or {})
    return cmd, full_env


def serve_until_exit(model: str, log_path: str, *, backend: str = "speedsfi",
                     additional_config: dict | None = None, args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None, timeout_s: float = 300) -> tuple[float, int]:
    """Run ``vllm serve`` expecting it to stop by itself (a refused start-up): (seconds from launch
    to exit, exit code). A server still running after ``timeout_s`` is stopped and the test fails."""
    cmd, full_env = _serve_command(model, free_port(), backend=backend, additional_config=additional_config,
                                   args=args, env=env)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        raise AssertionError(f"vllm serve was still running after {timeout_s:.0f} s") from None
    return time.monotonic() - start, code


@contextmanager
def vllm_serve(model: str, log_path: str, *, backend: str = "speedsfi", additional_config: dict | None = None,
               args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               startup_timeout_s: float = 300):
    port = free_port()
    name = SERVED_NAME
    cmd, full_env = _serve_command(model, port, backend=backend, additional_config=additional_config,
                                   args=args, env=env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", name, proc, log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not become healthy (exit code {proc.poll()}):\n"
                                   + server.log_tail())
            time.sleep(0.5)
        yield server
    finally:
        stop_process_group(proc)
