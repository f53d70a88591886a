"""Traffic independence as users meet it: a real ``vllm serve --attention-backend
speedsfi`` with SFI on (a small budget, so that most decode steps are fast) and an OpenAI client.

40 mixed-length prompts (20-1,500 tokens) one at a time, then all 40 at once together with 8 streamed
requests that the client drops after a few chunks, then a few one at a time again. Under load the
prompts are chunked differently (512-token budget shared by up to 16 requests), prefix-cache hits
appear (the same prompts again) and rows move between decode and mixed steps; still every completed
answer equals its one-at-a-time answer, no request fails, the server stays healthy, and once the
traffic is gone every request slot and SFI slot is back and the SFI counters stand still.

Run twice: SFI alone (prefix caching on), and every method on: SFI + SPEED + CritiPrefill on a 4-layer
Qwen3 (SPEED needs prefix caching off; CritiPrefill's 128-query segments with the 512-token budget
shared by up to 16 requests, so chunks would cut segments without the scheduler's rules)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.served import vllm_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8,
       "max_requests": 16}
SERVE_ARGS = ("--max-model-len", "2048", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
              "--block-size", "32", "--enable-prefix-caching")
N_PROMPTS, N_DROPPED, N_AGAIN = 40, 8, 5
MAX_TOKENS = 16
DENSE_UP_TO = SFI["n_sink"] + SFI["n_recent"] + SFI["k"]     # no prefill-end selection at or below


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [20, 1500] + [rng.choice((rng.randint(20, 120), rng.randint(120, 600),
                                        rng.randint(600, 1500))) for _ in range(n - 2)]
    return [[rng.randrange(4, 500) for _ in range(n_tok)] for n_tok in lengths]


PROMPTS = _prompts(N_PROMPTS, seed=1)
DROPPED = _prompts(N_DROPPED, seed=2)


def _complete(client, model, prompt):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    return list(r.choices[0].token_ids)


def _dropped_stream(client, model, prompt, chunks=3):
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == chunks:
            break
    stream.close()                      # the client goes away mid-answer
    return got


def _wait_for(predicate, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


ALL_ON = {"sfi": SFI, "speed": {"enabled": True, "l_cut": 3},
          "critiprefill": {"enabled": True, "segment_size": 128, "block_size": 16, "budget": 256,
                           "min_len": 256}}
ALL_ON_ARGS = tuple(a for a in SERVE_ARGS if a != "--enable-prefix-caching") + ("--no-enable-prefix-caching",)


@pytest.mark.parametrize("methods", ["sfi", "all_on"])
def test_concurrent_answers_equal_one_at_a_time_answers(tiny_models, tmp_path, methods):
    if methods == "sfi":
        model, section, args = tiny_models["qwen3"], {"sfi": SFI}, SERVE_ARGS
    else:
        from vllm_ext.tools.tiny_models import make_model

        model = make_model(str(tmp_path / "tiny-qwen3-4l"), "qwen3", num_layers=4)
        section, args = ALL_ON, ALL_ON_ARGS
    with vllm_serve(model, str(tmp_path / "server.log"),
                    additional_config={"speedsfi": section}, args=args,
                    env={"SPEEDSFI_TRACE_DIR": str(tmp_path / "trace")}) as server:
        client, model = server.client(max_retries=0, timeout=300), server.model_name
        alone = [_complete(client, model, p) for p in PROMPTS]

        with ThreadPoolExecutor(N_PROMPTS + N_DROPPED) as pool:
            dropped = [pool.submit(_dropped_stream, client, model, p) for p in DROPPED]
            together = [pool.submit(_complete, client, model, p) for p in PROMPTS]
            together = [f.result() for f in together]          # re-raises any request error
            dropped = [f.result() for f in dropped]
        assert dropped == [3] * N_DROPPED
        for i, (a, b) in enumerate(zip(alone, together)):
            assert a == b, f"prompt {i} ({len(PROMPTS[i])} tokens): concurrent answer differs"

        again = [_complete(client, model, p) for p in PROMPTS[:N_AGAIN]]
        assert again == alone[:N_AGAIN]
        assert server.healthy()

        def idle():
            e = server.events()
            return (e.get("slots.acquired", -1) == e.get("slots.released")
                    and e.get("sfi.slots_assigned", -1) == e.get("sfi.slots_released"))

        _wait_for(idle, "every request slot and SFI slot to be released")
        events = server.events()
        sent = PROMPTS + PROMPTS + DROPPED + PROMPTS[:N_AGAIN]
        vllm_metrics = server.metrics()
        preempted = sum(v for k, v in vllm_metrics.items() if k.startswith("vllm:num_preemptions_total"))
        assert preempted == 0                  # so each request held exactly one slot
        assert events["slots.acquired"] == len(sent) == events["sfi.slots_assigned"]
        # every request whose prompt outgrows the dense budget made exactly one prefill-end selection
        # (the dropped streams too: they were answering), and SFI really ran fast steps
        assert events["sfi.prefill_end_selections"] == sum(len(p) > DENSE_UP_TO for p in sent)
        assert events["sfi.fast_steps"] > events["sfi.slow_steps"] > 0
        if methods == "sfi":
            assert events.get("sfi.prefix_hit_tokens_cut", 0) > 0      # the cache was hit, and cut
        else:
            assert events["critiprefill.sparse_segments"] > 0 and events["speed.upper_tokens_skipped"] > 0
            assert events.get("sched.critiprefill_chunk_cuts", 0) > 0  # the rules were needed
        assert not {k for k in events if k.startswith("fallback.")}
        # the same in Prometheus form: gauges of the slots in use, the retained-fraction histogram
        assert vllm_metrics["speedsfi_sfi_slots_in_use"] == 0 == vllm_metrics["speedsfi_request_slots_in_use"]
        hist = "speedsfi_sfi_fast_retained_fraction"
        assert vllm_metrics[f"{hist}_count"] == events["sfi.fast_steps"]
        assert vllm_metrics[hist + '_bucket{le="+Inf"}'] == events["sfi.fast_steps"]
        assert 0 < vllm_metrics[f"{hist}_sum"] < events["sfi.fast_steps"]
        assert vllm_metrics["speedsfi_sfi_fast_context_tokens_total"] == events["sfi.fast_context_tokens"]
        # idle: nothing moves any more
        sfi_counters = {k: v for k, v in events.items() if k.startswith("sfi.")}
        time.sleep(2)
        assert server.healthy()
        assert {k: v for k, v in server.events().items() if k.startswith("sfi.")} == sfi_counters
