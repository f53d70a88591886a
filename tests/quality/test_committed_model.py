"""The committed retrieval models: intact (checksums), the architecture the harness promises, and a
tokenizer that agrees with the task generators' vocabulary (no vLLM needed).

``retrieval-llama`` (LlamaForCausalLM, plain haystacks) and ``retrieval-qwen3`` (Qwen3ForCausalLM,
q/k RMSNorm, GQA group 4, plain and prose haystacks): the second model is there so that quality
conclusions do not rest on one model."""

import hashlib
import json
import os

import pytest

from vllm_ext.quality import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {"retrieval-llama": "LlamaForCausalLM", "retrieval-qwen3": "Qwen3ForCausalLM"}
MODEL = os.path.join(ROOT, "models", "retrieval-llama")


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return request.param, os.path.join(ROOT, "models", request.param)


def test_checksums(model):
    _, path = model
    with open(os.path.join(path, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    assert {"model.safetensors", "config.json", "tokenizer.json", "TRAINING.md"} <= set(sums)
    for name, digest in sums.items():
        with open(os.path.join(path, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"{name} changed since training"
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 8 << 20       # small enough to commit


def test_architecture(model):
    name, path = model
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [MODELS[name]]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]            # GQA
    assert cfg["max_position_embeddings"] >= 2048 + 128
    assert cfg["vocab_size"] == len(T.VOCAB)


def test_the_two_models_differ_in_shape():
    cfgs = {}
    for name in MODELS:
        with open(os.path.join(ROOT, "models", name, "config.json")) as f:
            cfgs[name] = json.load(f)
    a, b = cfgs["retrieval-llama"], cfgs["retrieval-qwen3"]
    group = [c["num_attention_heads"] // c["num_key_value_heads"] for c in (a, b)]
    assert group[0] != group[1] and b["model_type"] == "qwen3"


@pytest.mark.parametrize("filler", T.FILLERS)
def test_tokenizer_matches_the_task_vocabulary(model, filler):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(model[1])
    assert tok.convert_ids_to_tokens(list(range(len(T.VOCAB)))) == list(T.VOCAB)
    sample = T.make_sample("niah_single", 512, 0.5, 3, filler=filler)
    # the generator's ids are the tokenizer's: decoding them and encoding the text gives them back
    text = " ".join(T.words_of(sample.prompt_ids[1:]))
    assert tok(text, add_special_tokens=True)["input_ids"] == sample.prompt_ids
    for trigger in (".", ";", "?", "\n"):                # SFI's trigger set is not empty
        assert len(tok(trigger, add_special_tokens=False)["input_ids"]) == 1
