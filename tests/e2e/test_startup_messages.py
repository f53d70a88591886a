"""No warnings we cause: ``vllm serve`` with SPEEDSFI (SFI on: its short request decodes through the
dense delegate, its start-up plans every method's kernels) logs no warning that the same server with
vLLM's own ``CPU_ATTN`` does not log, and never vLLM's "Unknown vLLM environment variable" (our
variables are ``SPEEDSFI_*``). Warnings are compared without their timestamps, process names and
numbers. SPEEDSFI's start-up line (what the engine runs) is in the log once, at INFO; its wording for
every other configuration: tests/test_startup_line.py."""

from __future__ import annotations

import re

import pytest

from tests.e2e.served import vllm_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8, "max_requests": 4}


def _warnings(log: str) -> set[str]:
    out = set()
    for line in log.splitlines():
        if "WARNING" not in line and "Warning" not in line:
            continue
        line = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line)
        line = re.sub(r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]", "WARNING", line)
        out.add(re.sub(r"\d+(\.\d+)?", "N", line).strip())
    return out


STARTUP_LINE = "SPEEDSFI attention backend: "


def _served_warnings(model, tmp_path, name, **kwargs) -> tuple[set[str], list[str]]:
    """The server's warnings and its start-up lines."""
    log = tmp_path / f"{name}.log"
    with vllm_serve(model, str(log), **kwargs) as server:
        server.client(max_retries=0, timeout=120).completions.create(
            model=server.model_name, prompt=[5, 6, 7, 8], max_tokens=4)
        # the log up to here: the teardown signals the whole process group at once, and whether
        # Python's resource tracker then reports leaked semaphores depends on which process exits first
        text = log.read_text()
    return _warnings(text), [line for line in text.splitlines() if STARTUP_LINE in line]


def test_speedsfi_adds_no_warning_to_plain_vllm(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain, none = _served_warnings(model, tmp_path, "cpu_attn", backend="CPU_ATTN")
    assert none == []
    ours, startup = _served_warnings(model, tmp_path, "sfi", additional_config={"speedsfi": {"sfi": SFI}})
    assert len(startup) == 1, startup                    # once per engine: not the scheduler's copy too
    assert " INFO " in startup[0] and "methods on: sfi; sfi k=16 n_sink=4 n_recent=16 " in startup[0], startup
    assert startup[0].endswith("; dense rows: CPU_ATTN (CPU build)"), startup
    # an unknown VLLM_* variable the test process inherited warns in both servers; ours may add none
    unknown = [w for w in ours - plain if "Unknown vLLM environment variable" in w]
    assert not unknown, unknown
    assert ours - plain == set(), f"warnings plain vLLM does not print: {sorted(ours - plain)}"
