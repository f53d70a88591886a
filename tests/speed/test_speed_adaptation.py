"""SPEED self-distillation (vllm_ext.methods.speed.adaptation, scripts/adapt_speed.py) on tiny models:
the training-time forwards implement the backend's visibility rule (against the independent Hugging
Face reference, and against SPEED in real vLLM on the CPU build: greedy tokens and log-probabilities
within fp32 tolerance), training lowers the distillation loss, and the merged checkpoint is the
trained model, loads in vLLM as the base does and is cached."""

import json
import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_ext.methods.speed import adaptation as A  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS, L_CUT = 4, 3


def _prompts(lengths=(150, 37, 260), seed=5):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 500) for _ in range(n - 1)] for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vllm_ext.tools.tiny_models import make_model

    root = tmp_path_factory.mktemp("adapt_models")
    return {arch: make_model(str(root / arch), arch, num_layers=LAYERS) for arch in ("llama", "qwen2", "qwen3")}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _speed_greedy_by_masks(model, prompt, n, anchor_end=1):
    masks = A.SpeedAttentionMasks(model, L_CUT, anchor_end)
    ids = list(prompt)
    try:
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(A.speed_logits(model, masks, ids, len(prompt))[-1].argmax()))
    finally:
        masks.remove()
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("anchor", ["bos", "none"])
def test_both_training_forwards_are_the_reference_rule(models, arch, anchor):
    """The masked whole-sequence forward and the upper stack on kept tokens give the same logits
    at every decode-phase row (continuation and in-prompt cuts), and the masked forward's greedy
    decoding is the independent reference's."""
    from tests.speed.speed_reference import speed_greedy

    model = _load(models[arch])
    anchor_end = 1 if anchor == "bos" else 0
    masks = A.SpeedAttentionMasks(model, L_CUT, anchor_end)
    prompt = _prompts((180,))[0]
    records, generated = A.teacher_records(model, prompt, "t", l_cut=L_CUT, anchor_end=anchor_end,
                                           new_tokens=10, eos_ids=set(), inner_splits=[(60, 9), (2, 5)])
    assert len(records) == 3 and len(generated) == 10
    with torch.no_grad():
        for r in records:
            assert r.positions.tolist() == list(range(anchor_end)) * (r.prompt_len > 1) + \
                list(range(r.prompt_len - 1, len(r.ids)))
            compact = A.upper_stack_logits(model, r.h_cut, r.positions, L_CUT)[-r.decode_rows:]
            full = A.speed_logits(model, masks, r.ids, r.prompt_len)[r.prompt_len - 1:]
            torch.testing.assert_close(compact, full, rtol=1e-4, atol=1e-4)
            dense = model(torch.tensor([r.ids])).logits[0, r.prompt_len - 1:]
            torch.testing.assert_close(model.lm_head(r.final), dense, rtol=1e-4, atol=1e-4)
            # the rule changes the outputs unless it hides no position (P - 1 <= the anchors)
            assert ((full - dense).abs().max() > 0.1) == (r.prompt_len - 1 > anchor_end)
    masks.remove()
    assert _speed_greedy_by_masks(model, prompt, 6, anchor_end) == \
        speed_greedy(models[arch], [prompt], 6, L_CUT, anchor=anchor)[0]


def test_the_dense_keeping_term_is_zero_on_the_original_and_sees_an_upper_layer_change(models):
    """dense_keep_loss runs the upper layers over every position from the dense input to ``l_cut``:
    on the unadapted model that is the teacher's own dense pass (KL 0, both the continuation record
    and an in-prompt cut), and a change to an upper layer moves it."""
    model = _load(models["llama"])
    records, _ = A.teacher_records(model, _prompts((120,))[0], "t", l_cut=L_CUT, anchor_end=1, new_tokens=6,
                                   eos_ids=set(), inner_splits=[(60, 8)], keep_dense=True)
    assert len(records) == 2 and all(r.h_dense.shape[0] == len(r.ids) for r in records)
    with torch.no_grad():
        for r in records:
            assert A.dense_keep_loss(model, r, l_cut=L_CUT, lm_head=model.lm_head).item() < 1e-6
        w = model.model.layers[L_CUT].mlp.down_proj.weight
        w.mul_(1.5)
        assert A.dense_keep_loss(model, records[0], l_cut=L_CUT, lm_head=model.lm_head).item() > 1e-4
    plain, _ = A.teacher_records(model, _prompts((40,))[0], "t", l_cut=L_CUT, anchor_end=1, new_tokens=3,
                                 eos_ids=set())
    with pytest.raises(ValueError, match="h_dense"):
        A.dense_keep_loss(model, plain[0], l_cut=L_CUT, lm_head=model.lm_head)


def test_kl_is_zero_when_the_rule_changes_nothing(models):
    """At ``l_cut`` = the number of layers the student is the teacher."""
    model = _load(models["qwen2"])
    prompt = _prompts((90,))[0]
    records, _ = A.teacher_records(model, prompt, "t", l_cut=LAYERS - 1, anchor_end=1, new_tokens=6,
                                   eos_ids=set())
    masks = A.SpeedAttentionMasks(model, LAYERS, 1)
    with torch.no_grad():
        kl, agree = A.record_loss(model, records[0], l_cut=LAYERS, anchor_end=1, lm_head=model.lm_head,
                                  masks=masks)
    assert kl.item() < 1e-6 and agree.item() == 1.0


@pytest.fixture(scope="module")
def adapted(models, tmp_path_factory):
    """scripts/adapt_speed.py on the tiny Llama (a few steps), and its result JSON."""
    pytest.importorskip("peft")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import adapt_speed

    work = tmp_path_factory.mktemp("adapt_work")
    out = str(work / "adapted")
    argv = ["--model", models["llama"], "--l-cut", str(L_CUT), "--prompts", "3", "--heldout", "1",
            "--min-length", "1800", "--max-length", "2000", "--new-tokens", "8", "--inner-tokens", "6",
            "--steps", "12", "--batch", "3", "--lr", "3e-3", "--warmup", "2", "--threads", "1",
            "--work-dir", str(work / "records"), "--out", out, "--results", str(work / "result.json")]
    assert adapt_speed.main(argv) == out
    with open(work / "result.json") as f:
        result = json.load(f)
    return out, result, argv


@pytest.mark.slow
def test_the_dense_keeping_term_trains_with_the_speed_term(models, tmp_path):
    """--dense-weight: the records keep the dense input to the upper layers, each step logs the dense
    term beside SPEED's, the run's spec records the weight; adapters below l_cut refuse it."""
    pytest.importorskip("peft")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import adapt_speed

    argv = ["--model", models["llama"], "--l-cut", str(L_CUT), "--prompts", "2", "--heldout", "1",
            "--min-length", "1800", "--max-length", "2000", "--new-tokens", "6", "--inner-tokens", "6",
            "--steps", "4", "--batch", "2", "--lr", "3e-3", "--warmup", "1", "--threads", "1", "--log-every", "2",
            "--work-dir", str(tmp_path / "records"), "--out", str(tmp_path / "adapted"),
            "--results", str(tmp_path / "result.json"), "--dense-weight", "0.5"]
    adapt_speed.main(argv)
    with open(tmp_path / "result.json") as f:
        result = json.load(f)
    assert result["spec"]["dense_weight"] == 0.5
    assert [h["step"] for h in result["history"]] == [2, 4]
    assert all(h["dense_kl"] >= 0 for h in result["history"])
    with pytest.raises(SystemExit, match="dense-weight"):
        adapt_speed.main(argv + ["--lora-layers", "all"])


@pytest.mark.slow
def test_adaptation_trains_merges_and_caches(models, adapted, capsys):
    out, result, argv = adapted
    base = models["llama"]
    # the loss went down on the training records (12 steps, every record seen 4 times)
    hist = result["history"]
    assert hist[-1]["kl"] < hist[0]["kl"]
    assert result["steps"] == 12 and result["training_prompts"] == 3
    assert result["teacher_prompt_tokens"] > 3 * 1700 and result["decode_rows_trained"] > 0
    # the checkpoint: the base's config and tokenizer, float32 safetensors, a card with checksums
    with open(os.path.join(base, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(base, name), "rb") as f, open(os.path.join(out, name), "rb") as g:
            assert f.read() == g.read()
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, A.CARD)) as f:
        card = json.load(f)
    assert card["l_cut"] == L_CUT and card["spec"]["lora_layers"] == "upper"
    # the merged weights: the lower layers are the base's, the upper ones moved
    b, a = _load(base).state_dict(), _load(out).state_dict()
    assert set(a) == set(b)
    for name in a:
        same = torch.equal(a[name], b[name])
        upper_linear = f"layers.{L_CUT}." in name and name.endswith("proj.weight")
        assert same != upper_linear, name
    # a second run with the same settings finds the cache
    import adapt_speed

    capsys.readouterr()
    assert adapt_speed.main(argv) == out
    assert "cached" in capsys.readouterr().out


def _vllm_speed_run(model, prompts, max_tokens, top):
    from tests.e2e.engine import engine
    from vllm import SamplingParams

    cfg = {"speedsfi": {"speed": {"enabled": True, "l_cut": L_CUT}}}
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
    with engine(model, "SPEEDSFI", additional_config=cfg, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("which", ["adapted_llama", "qwen2", "qwen3"])
def test_training_forwards_equal_the_backend_in_vllm(models, adapted, which):
    """SPEED in real vLLM (CPU build; chunked prompts, prefills and decodes in one step) against
    the training-time forwards on the tokens vLLM generated: the same greedy tokens and the same
    top-5 log-probabilities (fp32 tolerance). The adapted checkpoint loads in vLLM as is."""
    pytest.importorskip("vllm")
    path = adapted[0] if which == "adapted_llama" else models[which]
    prompts, n, top = _prompts(), 8, 5
    runs = _vllm_speed_run(path, prompts, n, top)
    model = _load(path)
    masks = A.SpeedAttentionMasks(model, L_CUT, 1)
    with torch.no_grad():
        for prompt, (tokens, logprobs) in zip(prompts, runs):
            ids = prompt + tokens[:-1]
            full = torch.log_softmax(A.speed_logits(model, masks, ids, len(prompt))[len(prompt) - 1:], -1)
            keep = torch.tensor(A.kept_positions(len(prompt), len(ids), 1))
            h_cut = _dense_h_cut(model, ids)[keep]
            compact = torch.log_softmax(A.upper_stack_logits(model, h_cut, keep, L_CUT), -1)
            compact = compact[-len(tokens):]
            assert full.argmax(-1).tolist() == tokens
            assert compact.argmax(-1).tolist() == tokens
            for row, step in enumerate(logprobs):
                for token, lp in step.items():
                    assert abs(full[row, token].item() - lp.logprob) < 2e-3, (row, token)
                    assert abs(compact[row, token].item() - lp.logprob) < 2e-3, (row, token)
    masks.remove()


def _dense_h_cut(model, ids):
    """The dense model's input to layer ``L_CUT`` at every position."""
    cap = A.HiddenCapture(model, L_CUT)
    try:
        model(torch.tensor([ids]))
    finally:
        cap.remove()
    return cap.h_cut
