"""The committed retrieval model: intact (checksums), the architecture the harness promises, and a
tokenizer that agrees with the task generators' vocabulary (no vLLM needed)."""

import hashlib
import json
import os

import pytest

from vllm_ext.quality import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "retrieval-llama")


def test_checksums():
    with open(os.path.join(MODEL, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    assert {"model.safetensors", "config.json", "tokenizer.json", "TRAINING.md"} <= set(sums)
    for name, digest in sums.items():
        with open(os.path.join(MODEL, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"{name} changed since training"


def test_architecture():
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]            # GQA
    assert cfg["max_position_embeddings"] >= 2048 + 128
    assert cfg["vocab_size"] == len(T.VOCAB)


def test_tokenizer_matches_the_task_vocabulary():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    assert tok.convert_ids_to_tokens(list(range(len(T.VOCAB)))) == list(T.VOCAB)
    sample = T.make_sample("niah_single", 512, 0.5, 3)
    # the generator's ids are the tokenizer's: decoding them and encoding the text gives them back
    text = " ".join(T.words_of(sample.prompt_ids[1:]))
    assert tok(text, add_special_tokens=True)["input_ids"] == sample.prompt_ids
    for trigger in (".", ";", "?", "\n"):                # SFI's trigger set is not empty
        assert len(tok(trigger, add_special_tokens=False)["input_ids"]) == 1
