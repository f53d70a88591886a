"""Bad input against a running server: every malformed or hostile request gets a
4xx that names the field, and the server keeps answering valid requests exactly as before. Real
``vllm serve --attention-backend speedsfi`` (CPU build) with every method on: SFI, SPEED and
CritiPrefill, on a 4-layer tiny Qwen3."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.served import vllm_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECTION = {"sfi": {"enabled": True, "k": 64, "n_recent": 64},
           "speed": {"enabled": True, "l_cut": 3},
           "critiprefill": {"enabled": True, "segment_size": 128, "block_size": 16, "budget": 256,
                            "min_len": 256}}
ARGS = ("--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--no-enable-prefix-caching")
PROMPT = list(range(10, 410))                                   # 400 tokens: every method runs


def _xargs(overrides) -> dict:
    return {"vllm_xargs": {"speedsfi": overrides if isinstance(overrides, (int, float)) else json.dumps(overrides)}}


BAD = [
    # (case, extra request fields, text the error must contain)
    ("k of a wrong type", _xargs({"sfi": {"k": "many"}}), "speedsfi.sfi.k: expected an integer"),
    ("negative k", _xargs({"sfi": {"k": -5}}), "speedsfi.sfi.k"),
    ("k above the server's", _xargs({"sfi": {"k": 100000}}), "must be <= the server's sfi.k (64)"),
    ("unknown field", _xargs({"sfi": {"n_recnt": 4}}), "did you mean 'n_recent'"),
    ("unknown section", _xargs({"quest": {}}), "speedsfi.quest: unknown field"),
    ("engine-wide field", _xargs({"critiprefill": {"budget": 16}}), "speedsfi.critiprefill.budget is engine-wide"),
    ("preset per request", _xargs({"preset": "dense"}), "speedsfi.preset cannot be overridden"),
    ("overrides not JSON", {"vllm_xargs": {"speedsfi": "{sfi: "}}, "not valid JSON"),
    ("overrides not a mapping", {"vllm_xargs": {"speedsfi": 7}}, "must be a mapping"),
    ("prompt logprobs with SPEED", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("longer than max_model_len", {"prompt": list(range(5, 1100))}, "maximum context length"),
    ("empty prompt", {"prompt": []}, "prompt"),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
]


def _post(server, body: dict):
    import httpx

    payload = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True}
    payload.update(body)
    return httpx.post(server.base + "/v1/completions", json=payload, timeout=300)


def _tokens(r) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_ext.tools.tiny_models import make_model

    root = tmp_path_factory.mktemp("bad_requests")
    model = make_model(str(root / "tiny-qwen3-4l"), "qwen3", num_layers=4)
    with vllm_serve(model, str(root / "server.log"), additional_config={"speedsfi": SECTION},
                    args=ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    return _tokens(_post(server, {}))


@pytest.mark.parametrize("case, body, message", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_refused_with_the_field_named(server, reference, case, body, message):
    r = _post(server, body)
    assert 400 <= r.status_code < 500, f"{case}: {r.status_code} {r.text[:300]}"
    assert message in r.text, f"{case}: {r.text[:500]}"
    assert _tokens(_post(server, {})) == reference             # the next valid request: unharmed


def test_documented_edge_cases_are_served(server, reference):
    # k above the context: allowed, the request decodes densely until its context outgrows it
    short = _tokens(_post(server, {"prompt": PROMPT[:20], **_xargs({"sfi": {"k": 64}})}))
    dense = _tokens(_post(server, {"prompt": PROMPT[:20], **_xargs({"sfi": {"enabled": False}})}))
    assert short == dense
    # a request may turn SFI off or lower its k
    assert len(_tokens(_post(server, _xargs({"sfi": {"enabled": False}})))) == 8
    assert len(_tokens(_post(server, _xargs({"sfi": {"k": 48}})))) == 8        # >= k_min (32)
    assert _tokens(_post(server, {})) == reference


def test_abort_storm_leaves_the_server_answering(server, reference):
    """40 streamed requests dropped after their first chunk or before it, all at once."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    def dropped(i):
        payload = {"model": server.model_name, "prompt": PROMPT[i % 7:], "max_tokens": 200,
                   "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=payload, timeout=300) as r:
            if i % 2:
                for _ in r.iter_lines():
                    break
        return True

    with ThreadPoolExecutor(40) as pool:
        assert all(pool.map(dropped, range(40)))
    assert _tokens(_post(server, {})) == reference
    assert server.healthy()
    deadline = time.monotonic() + 120
    while True:
        m = server.metrics()
        if m.get("speedsfi_request_slots_in_use") == 0 and m.get("speedsfi_sfi_slots_in_use") == 0:
            break
        assert time.monotonic() < deadline, (f"slots still held: request {m.get('speedsfi_request_slots_in_use')}, "
                                                  f"SFI {m.get('speedsfi_sfi_slots_in_use')}")
        time.sleep(0.5)
    assert not {k for k in server.events() if k.startswith("fallback.")}
