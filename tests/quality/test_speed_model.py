"""The committed SPEED-adapted retrieval model (models/retrieval-llama-speed): intact (checksums), the
base model's architecture and tokenizer, and under SPEED's visibility rule (the independent Hugging
Face reference of tests/speed) it answers where the base model does not. The training script's
masks are the reference's rule. No vLLM, no training; a few seconds."""

import hashlib
import json
import os
import sys

import pytest

from vllm_ext.quality import tasks as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "models", "retrieval-llama")
MODEL = os.path.join(ROOT, "models", "retrieval-llama-speed")
L_CUT = 3
# seeds away from every evaluation (0.., 900, 10000.., 20000..) and from training (1 000 000 + ...)
SAMPLES = [T.make_sample(t, 512, 0.5, 777) for t in ("niah_single", "kv_lookup")]


def test_checksums():
    with open(os.path.join(MODEL, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    assert {"model.safetensors", "config.json", "tokenizer.json", "TRAINING.md",
            "training_log.json"} <= set(sums)
    for name, digest in sums.items():
        with open(os.path.join(MODEL, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"{name} changed since training"


def test_same_architecture_and_tokenizer_as_the_base():
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(BASE, "config.json")) as f:
        base = json.load(f)
    assert cfg == base
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(MODEL, name), "rb") as a, open(os.path.join(BASE, name), "rb") as b:
            assert a.read() == b.read(), name
    with open(os.path.join(MODEL, "training_log.json")) as f:
        log = json.load(f)
    assert log["l_cut"] == L_CUT and log["anchor"] == "bos"


def test_answers_under_speed_where_the_base_model_does_not():
    pytest.importorskip("transformers")
    from tests.speed.speed_reference import speed_greedy

    prompts = [s.prompt_ids for s in SAMPLES]
    n = max(len(s.answer_ids) for s in SAMPLES)
    adapted = speed_greedy(MODEL, prompts, n, L_CUT)
    base = speed_greedy(BASE, prompts, n, L_CUT)
    assert all(T.exact_match(s, out) for s, out in zip(SAMPLES, adapted))
    assert not any(T.exact_match(s, out) for s, out in zip(SAMPLES, base))


def test_training_masks_are_the_reference_rule():
    """scripts/finetune_speed_model.py's per-layer masks (SDPA, hooks) decode exactly like the
    reference (eager attention, additive masks) on the adapted model."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from finetune_speed_model import SpeedMasks, load

    from tests.speed.speed_reference import speed_greedy

    model = load(MODEL).eval()
    masks = SpeedMasks(model, L_CUT)
    outs = []
    with torch.no_grad():
        for s in SAMPLES:
            ids = list(s.prompt_ids)
            masks.set_prompt_len(len(s.prompt_ids))
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(s.prompt_ids):])
    masks.remove()
    assert outs == speed_greedy(MODEL, [s.prompt_ids for s in SAMPLES], 6, L_CUT)
