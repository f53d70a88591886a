"""No warnings we cause: ``vllm serve`` with SPEEDSFI (every method off, and SFI
on) logs no warning that the same server with vLLM's own ``CPU_ATTN`` does not log, and never vLLM's
"Unknown vLLM environment variable" (our variables are ``SPEEDSFI_*``). Warnings are compared
without their timestamps, process names and numbers."""

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


def _served_warnings(model, tmp_path, name, **kwargs) -> set[str]:
    log = tmp_path / f"{name}.log"
    with vllm_serve(model, str(log), **kwargs) as server:
        server.client(max_retries=0, timeout=120).completions.create(
            model=server.model_name, prompt=[5, 6, 7, 8], max_tokens=4)
    return _warnings(log.read_text())


def test_speedsfi_adds_no_warning_to_plain_vllm(tiny_models, tmp_path):
    model = tiny_models["llama"]
    plain = _served_warnings(model, tmp_path, "cpu_attn", backend="CPU_ATTN")
    for name, section in (("all_off", {}), ("sfi", {"sfi": SFI})):
        ours = _served_warnings(model, tmp_path, name, additional_config={"speedsfi": section})
        # an unknown VLLM_* variable the test process inherited warns in both servers; ours may add none
        unknown = [w for w in ours - plain if "Unknown vLLM environment variable" in w]
        assert not unknown, unknown
        assert ours - plain == set(), f"{name}: warnings plain vLLM does not print: {sorted(ours - plain)}"
