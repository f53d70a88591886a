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
