"""Metrics are current when the server is idle: against a real ``vllm serve`` with
SFI on and the counters' default write interval (1 s), a request's counters and gauges are on
``/metrics`` within about a second of its last token with no further request or step, and the SFI
and request slots in use return to 0. Before, the counters a request bumped last (its slots'
release, in the step vLLM runs to hand finished requests back) waited for the next request's steps."""

from __future__ import annotations

import random
import time

import pytest

from tests.e2e.served import vllm_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8, "max_requests": 4}
# the write interval in use; a second of slack for the shared test machine's scheduling
INTERVAL_S, SLACK_S = 1.0, 1.0


def _events_after(server, deadline: float, want) -> dict[str, int]:
    events = server.events()
    while not want(events) and time.monotonic() < deadline:
        time.sleep(0.05)
        events = server.events()
    return events


def test_a_request_is_on_metrics_within_a_second_and_slots_return_to_zero(tiny_models, tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in (300, 500)]
    with vllm_serve(tiny_models["llama"], str(tmp_path / "server.log"),
                    additional_config={"speedsfi": {"sfi": SFI}}, args=("--max-model-len", "1024"),
                    env={"SPEEDSFI_TRACE_DIR": str(tmp_path / "trace"),
                         "SPEEDSFI_TRACE_INTERVAL_S": str(INTERVAL_S)}) as server:
        client = server.client(max_retries=0, timeout=300)
        for n, prompt in enumerate(prompts, start=1):
            client.completions.create(model=server.model_name, prompt=prompt, max_tokens=24,
                                      temperature=0.0)
            answered = time.monotonic()
            events = _events_after(server, answered + INTERVAL_S + SLACK_S,
                                   lambda e: e.get("sfi.slots_released", 0) == n)
            metrics = server.metrics()
            assert events.get("slots.released") == events.get("slots.acquired") == n, events
            assert events.get("sfi.slots_released") == events.get("sfi.slots_assigned") == n, events
            assert metrics["speedsfi_sfi_slots_in_use"] == 0 == metrics["speedsfi_request_slots_in_use"]
            assert events["sfi.fast_steps"] > 0 and events["sfi.slow_steps"] > 0
            # nothing of the request was still on its way: the idle server's counters stand still
            time.sleep(INTERVAL_S + SLACK_S)
            assert server.events() == events
            if n == 1:
                first = events
        assert events["sfi.fast_steps"] > first["sfi.fast_steps"]       # the second request's own steps
