"""Every block of the README and ``docs/`` marked runnable runs as written on the CPU build,
after the README's environment block, against the real model that set-up builds (or a tiny
checkpoint where the block says ``runnable: tiny``). A ``vllm serve`` block is started, waited for
and then answers its client blocks (or one chat request when it has none); the only change made to
what the reader types is the port (a free one instead of 8000, so parallel test runs do not collide).
The harness's own variables (``VLLM_*``, ``TRITON_*``, ``SPEEDSFI_*`` set for the other tests) are
removed, so the blocks see what a reader's shell would."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests import doc_blocks
from tests.e2e.served import free_port, stop_process_group

REAL_MODEL = doc_blocks.ROOT / doc_blocks.REAL_MODEL
RUNNABLE = [b for b in doc_blocks.all_blocks()
            if b.is_code and b.kind in ("runnable", "runnable: tiny", "runnable: server")]


def _reader_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "TRITON_", "SPEEDSFI_", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(doc_blocks.ROOT)          # this checkout's vllm_ext, whatever .venv installed
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"       # the test machine is shared by parallel workers
    return env


def _script(code: str) -> str:
    return f"set -euo pipefail\ncd {doc_blocks.ROOT}\n{doc_blocks.setup_script()}\n{code}"


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", _script(code)], env=_reader_env(), capture_output=True,
                          text=True, timeout=timeout)


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _serve(block, port: int, log):
    command = doc_blocks.one_line(block.code).strip() + f" --port {port}"
    return subprocess.Popen(["bash", "-c", _script("exec " + command)], env=_reader_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _one_chat(model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    return f"curl -sf localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


@pytest.fixture(scope="module")
def real_model():
    if not (REAL_MODEL / "config.json").exists():
        pytest.skip(f"the real model is not built ({doc_blocks.REAL_MODEL}: scripts/setup_env.sh)")
    return REAL_MODEL


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_runnable_block_runs_as_written(block, real_model, tiny_models, tmp_path):
    code = block.code
    if block.kind == "runnable: tiny":
        code = code.replace(doc_blocks.REAL_MODEL, tiny_models["llama"])
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        r = _run(f"python {script}", timeout=600)
        assert r.returncode == 0, f"{block.id} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        assert r.stdout.strip()                                    # it printed its answers
        return
    if block.kind != "runnable: server":
        r = _run(code, timeout=600)
        assert r.returncode == 0, f"{block.id} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        return
    port = free_port()
    doc = doc_blocks.ROOT / block.path
    clients = doc_blocks.clients_of(doc_blocks.blocks(doc), block) or None
    client_code = ("\n".join(c.code for c in clients) if clients
                   else _one_chat(doc_blocks.served_model(block.code)))
    with open(tmp_path / "serve.log", "w") as log:
        proc = _serve(block, port, log)
    try:
        deadline = time.monotonic() + 420
        while not _healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{block.id}: vllm serve did not come up:\n{(tmp_path / 'serve.log').read_text()[-6000:]}"
            time.sleep(1)
        r = _run(client_code.replace("localhost:8000", f"localhost:{port}"), timeout=300)
        assert r.returncode == 0, f"{block.id}'s client failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert '"choices"' in r.stdout, r.stdout[-3000:]
        if clients and "/metrics" in client_code:
            assert "speedsfi_events_total" in r.stdout, r.stdout[-3000:]
    finally:
        stop_process_group(proc)
