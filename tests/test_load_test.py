"""``scripts/load_test.py`` without a server: the workload it sends, the statistics it reports, the
configurations it starts. (The script end to end against a real server: tests/e2e/test_load_test_e2e.py.)"""

import importlib.util
import json
import os

import pytest

from vllm_ext.quality import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def lt():
    spec = importlib.util.spec_from_file_location("load_test", os.path.join(ROOT, "scripts", "load_test.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_workload_is_seeded_mixed_and_checkable(lt):
    lengths = [64, 128, 256, 512]
    work = lt.make_workload(200, lengths, extra=8, seed=0, random_ids=False)
    assert work == lt.make_workload(200, lengths, extra=8, seed=0, random_ids=False)
    assert work != lt.make_workload(200, lengths, extra=8, seed=1, random_ids=False)
    assert [w["i"] for w in work] == list(range(200))
    assert {len(w["prompt_ids"]) for w in work} == set(lengths)          # every length drawn
    assert {w["task"] for w in work} == set(T.TASKS)
    for w in work:
        assert len(w["prompt_ids"]) == w["length"] and w["prompt_ids"][0] == T.BOS
        # the sample the request came from: the same prompt, and the answer it is checked against
        s = T.make_sample(w["task"], w["length"], w["depth"], seed=w["i"])
        assert s.prompt_ids == w["prompt_ids"] and s.answer_ids == w["answer_ids"]
        assert len(w["answer_ids"]) <= w["max_tokens"] <= len(w["answer_ids"]) + 8
        if w["length"] < 256:                   # no room for 12 distractor needles
            assert w["task"] in ("niah_single", "kv_lookup")
    outs = {w["max_tokens"] for w in work}
    assert len(outs) > 10                       # output lengths vary too


def test_random_id_workload(lt):
    work = lt.make_workload(20, [100, 300], extra=4, seed=3, random_ids=True, vocab_size=290)
    assert all(4 <= t < 290 for w in work for t in w["prompt_ids"])
    assert all(w["answer_ids"] is None and 8 <= w["max_tokens"] <= 12 for w in work)
    assert {len(w["prompt_ids"]) for w in work} == {100, 300}


def test_summary_percentiles_errors_and_exact_match(lt):
    recs = [{"error": None, "ttft_s": i / 1000, "tpot_s": 2 * i / 1000, "e2e_s": 1.0,
             "completion_tokens": 10, "prompt_tokens": 100, "correct": i % 4 != 0} for i in range(1, 101)]
    recs.append({"error": "APIConnectionError: boom", "ttft_s": None, "tpot_s": None, "e2e_s": 3.0,
                 "completion_tokens": 0, "prompt_tokens": 100})
    s = lt.summarise(recs, wall_s=10.0)
    assert s["requests"] == 101 and s["errors"] == 1
    assert s["error_messages"] == ["APIConnectionError: boom"]
    assert s["ttft_ms"]["p50"] == 50.5 and s["ttft_ms"]["p99"] == 99.0
    assert s["tpot_ms"]["p50"] == 101.0 and s["tpot_ms"]["p99"] == 198.0
    assert s["exact_match"] == 0.75                       # failed requests are not scored
    assert s["output_tokens_per_s"] == 100.0 and s["request_throughput_per_s"] == 10.0


def test_counter_delta(lt):
    before = {"sfi.fast_context_tokens": 1000, "sfi.fast_retained_tokens": 500, "slots.acquired": 3}
    after = {"sfi.fast_context_tokens": 5000, "sfi.fast_retained_tokens": 1500, "slots.acquired": 13,
             "fallback.sfi_capacity": 2}
    d = lt.counter_delta(before, after)
    assert d["sfi_fast_retained_fraction"] == 0.25
    assert d["events"]["slots.acquired"] == 10 and d["fallbacks"] == {"fallback.sfi_capacity": 2}
    assert lt.counter_delta({}, {})["sfi_fast_retained_fraction"] is None


def test_configurations(lt):
    names = [c[0] for c in lt.resolve_configs("cpu_attn,dense,sfi,speed")]
    assert names == ["cpu_attn", "dense", "sfi", "speed"]
    by = {c[0]: c for c in lt.resolve_configs("cpu_attn,dense,sfi,speed")}
    assert by["cpu_attn"][1] is None and by["cpu_attn"][2] == ("--attention-backend", "CPU_ATTN")
    assert by["dense"][1] == {} and by["sfi"][1]["sfi"]["enabled"] is True
    assert "--no-enable-prefix-caching" in by["speed"][2]          # SPEED refuses prefix caching
    custom = lt.resolve_configs(json.dumps({"a": {"sfi": {"enabled": True}},
                                            "b": {"speedsfi": {}, "serve_args": ["--x", "1"]}}))
    assert custom == [("a", {"sfi": {"enabled": True}}, ()), ("b", {}, ("--x", "1"))]
    with pytest.raises(SystemExit):
        lt.resolve_configs("dense,nope")
    # every built-in speedsfi section is a valid configuration
    from vllm_ext.config import SpeedSfiConfig

    for _, section, _ in lt.resolve_configs("dense,sfi,speed"):
        SpeedSfiConfig.from_dict(section)


# ------------------------------------------------------------------------------------------------
# Soak: client drops, repeated prompts, the /metrics values sampled, the summary
# ------------------------------------------------------------------------------------------------
def test_soak_traits_seeded_fraction_and_repeats(lt):
    base = lambda: lt.make_workload(400, [64, 256], extra=2, seed=0, random_ids=False)  # noqa: E731
    plain = base()
    work = lt.add_soak_traits(base(), abort_fraction=0.1, repeat_fraction=0.2, seed=0)
    assert work == lt.add_soak_traits(base(), 0.1, 0.2, seed=0)               # seeded: same for every config
    assert work != lt.add_soak_traits(base(), 0.1, 0.2, seed=1)
    aborts = [w for w in work if "abort_after_chunks" in w]
    repeats = [w for w in work if "repeat_of" in w]
    assert 20 <= len(aborts) <= 60 and 50 <= len(repeats) <= 110
    assert {w["abort_after_chunks"] for w in aborts} == {0, 1, 2, 3}
    for w, p in zip(work, plain):
        assert w["i"] == p["i"]
        if "repeat_of" in w:                     # an earlier request's prompt and answer, recent
            src = work[w["repeat_of"]]
            assert w["i"] - 64 <= src["i"] < w["i"] and w["prompt_ids"] == src["prompt_ids"]
            assert w["answer_ids"] == src["answer_ids"] and w["max_tokens"] >= len(w["answer_ids"])
        else:
            assert w["prompt_ids"] == p["prompt_ids"]
        if "abort_after_chunks" in w:           # asks for more, so that the drop is mid-generation
            assert w["max_tokens"] >= lt.ABORT_EXTRA_TOKENS + len(w["answer_ids"])
    assert lt.add_soak_traits(base(), 0.0, 0.0, seed=0) == plain                 # off: unchanged


class _Stream:
    def __init__(self, tokens):
        from types import SimpleNamespace as NS

        self.chunks = [NS(usage=None, choices=[NS(token_ids=[t], text=f"t{t}")]) for t in tokens]
        self.chunks.append(NS(usage=NS(completion_tokens=len(tokens)), choices=[]))
        self.closed = self.read = 0

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self.chunks:
            self.read += 1
            yield c

    async def close(self):
        self.closed += 1


class _Client:
    def __init__(self, tokens):
        from types import SimpleNamespace as NS

        self.streams = []
        self.tokens = tokens

        async def create(**kw):
            self.streams.append(_Stream(self.tokens[:kw["max_tokens"]]))
            return self.streams[-1]

        self.completions = NS(create=create)


@pytest.mark.parametrize("abort_after", [None, 0, 1, 3])
def test_one_request_drops_the_stream_after_n_chunks(lt, abort_after):
    import asyncio

    req = {"i": 7, "task": "kv_lookup", "prompt_ids": [1, 5, 6], "answer_ids": [9, 9], "max_tokens": 6}
    if abort_after is not None:
        req["abort_after_chunks"] = abort_after
    client = _Client([9, 9, 4, 4, 4, 4])
    rec = asyncio.run(lt.one_request(client, "m", req, timeout=5))
    (stream,) = client.streams
    assert rec["error"] is None
    if abort_after is None:                      # read to the end, checked
        assert not rec.get("aborted") and rec["completion_tokens"] == 6 and rec["correct"] is True
        assert stream.closed == 0
    else:                                        # closed after n token chunks, not checked, no error
        assert rec["aborted"] and rec["abort_after_chunks"] == abort_after and "correct" not in rec
        assert stream.closed == 1 and stream.read == abort_after
        assert rec["completion_tokens"] == abort_after
        assert (rec["ttft_s"] is None) == (abort_after == 0)


def test_summary_leaves_dropped_streams_out_of_latencies(lt):
    recs = [{"error": None, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.0, "completion_tokens": 10,
             "prompt_tokens": 100, "correct": True} for _ in range(8)]
    recs += [{"error": None, "aborted": True, "ttft_s": 9.0, "tpot_s": None, "e2e_s": 9.0,
              "completion_tokens": 1, "prompt_tokens": 100}] * 2
    s = lt.summarise(recs, wall_s=1.0)
    assert s["requests"] == 10 and s["errors"] == 0 and s["aborted"] == 2
    assert s["ttft_ms"]["p99"] == 100.0 and s["exact_match"] == 1.0 and s["output_tokens_per_s"] == 80.0


METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
speedsfi_events_total{event="critiprefill.slots_assigned"} 9.0
speedsfi_events_total{event="critiprefill.slots_released"} 7.0
speedsfi_events_total{event="slots.acquired"} 40.0
speedsfi_request_slots_in_use 5.0
speedsfi_sfi_slots_in_use 4.0
"""


def test_parse_metrics(lt):
    m = lt.parse_metrics(METRICS)
    assert m["kv_cache_usage"] == 0.25 and m["running"] == 3 and m["waiting"] == 2
    assert m["request_slots"] == 5 and m["sfi_slots"] == 4 and m["critiprefill_slots"] == 2
    assert m["preemptions"] == 1 and m["prefix_cache_hits"] == 250 and m["prefix_cache_queries"] == 1000
    assert m["finished"] == {"length": 7, "stop": 1}
    # a server without the gauges (counters only): slots from the counters; none at all: zero
    m = lt.parse_metrics('speedsfi_events_total{event="slots.acquired"} 4\n'
                         'speedsfi_events_total{event="slots.released"} 3\n')
    assert m["request_slots"] == 1 and m["sfi_slots"] == 0 and m["critiprefill_slots"] == 0
    assert [lt.role_of("python", True), lt.role_of("VLLM::EngineCore", False),
            lt.role_of("VLLM::Worker", False), lt.role_of("python", False)] == \
        ["api_server", "engine_core", "worker", "other"]


def _sample(phase, done, api, engine, worker, **gauges):
    g = dict(kv_cache_usage=0.0, running=0, waiting=0, request_slots=0, sfi_slots=0, critiprefill_slots=0)
    g.update(gauges)
    return {"t": 0.0, "phase": phase, "done": done, **g,
            "rss_mib": {"api_server": api, "engine_core": engine, "worker": worker, "other": 10.0,
                        "total": api + engine + worker + 10.0}}


def test_soak_summary_growth_end_state_and_comparison(lt):
    samples = [_sample("warmup", 0, 600, 580, 1700, running=4, request_slots=4)]
    # the measured run: the worker grows 1 MiB per 10 requests in its second half, the others flat
    samples += [_sample("run", d, 600, 580, 1800 + max(0, d - 100) / 10, running=32, kv_cache_usage=0.02,
                        request_slots=32, sfi_slots=30, critiprefill_slots=2) for d in range(0, 201, 20)]
    samples += [_sample("drain", 200, 601, 580, 1810, running=1, request_slots=1)]
    samples += [_sample("end", 200, 601, 580, 1812)] * 3
    recs = [{"error": None} for _ in range(190)] + [{"error": None, "aborted": True}] * 9 + [{"error": "boom"}]
    s = lt.soak_summary(samples, recs, wall_s=50.0)
    assert s["requests"] == 200 and s["aborted"] == 9 and s["failures"] == 1 and s["failure_messages"] == ["boom"]
    assert s["rss_after_warmup_mib"]["worker"] == 1800            # the first sample of the measured run
    assert s["rss_growth_mib"] == {"api_server": 1.0, "engine_core": 0.0, "worker": 12.0, "other": 0.0,
                                   "total": 13.0}
    assert s["rss_second_half_slope_mib_per_1000_requests"]["worker"] == 100.0
    assert s["rss_second_half_slope_mib_per_1000_requests"]["engine_core"] == 0.0
    assert s["peak"]["request_slots"] == 32 and s["peak"]["critiprefill_slots"] == 2
    assert s["end"]["request_slots"] == 0 and s["end"]["kv_cache_usage"] == 0.0
    assert s["back_to_zero"] == {"slots": True, "kv_cache_usage": True, "queue": True}
    # a slot that never comes back, or KV blocks still in use, is reported
    leaky = samples[:-3] + [_sample("end", 200, 601, 580, 1812, sfi_slots=1, kv_cache_usage=0.001)] * 3
    b = lt.soak_summary(leaky, recs, 50.0)["back_to_zero"]
    assert b == {"slots": False, "kv_cache_usage": False, "queue": True}
    # no end-state sample (e.g. /metrics unreachable): not back to zero
    assert not any(lt.soak_summary(samples[:-3], recs, 50.0)["back_to_zero"].values())
    assert lt.is_idle(samples[-1]) and not lt.is_idle(samples[-4])

    cfgs = [{"name": "cpu_attn", "soak": s},
            {"name": "all_on", "soak": {"rss_growth_mib": {"api_server": 0.0, "engine_core": 0.0, "worker": 20.0,
                                                           "other": 0.0, "total": 20.0}}}]
    cmp = lt.soak_compare(cfgs)
    assert cmp["baseline"] == "cpu_attn"
    assert cmp["by_config"]["all_on"]["worker"] == {"growth_mib": 20.0, "baseline_growth_mib": 12.0,
                                                    "excess_mib": 8.0}
    assert cmp["by_config"]["all_on"]["total_not_larger_than_baseline"] is False
    assert lt.soak_compare(cfgs[1:]) is None


def test_soak_configurations(lt):
    by = {c[0]: c for c in lt.resolve_configs("cpu_attn,all_on,sfi_critiprefill_pc")}
    on = by["all_on"][1]
    assert on["sfi"]["enabled"] and on["speed"]["enabled"] and on["critiprefill"]["enabled"]
    assert "--no-enable-prefix-caching" in by["all_on"][2]          # SPEED refuses prefix caching
    pc = by["sfi_critiprefill_pc"][1]
    assert pc["sfi"]["enabled"] and pc["critiprefill"]["enabled"] and "speed" not in pc
    assert "--enable-prefix-caching" in by["sfi_critiprefill_pc"][2]
    from vllm_ext.config import SpeedSfiConfig

    for name in ("all_on", "sfi_critiprefill_pc"):
        cfg = SpeedSfiConfig.from_dict(by[name][1])
        # CritiPrefill is sparse from 384 tokens on, so the soak's 1024-token prompts exercise it
        cp = cfg.critiprefill
        assert cp.segment_size == 128 and cp.budget == 256 and cp.min_len <= 1024
