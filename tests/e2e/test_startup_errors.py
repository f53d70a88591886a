"""Bad configurations and unsupported models stop start-up with a message that names the problem."""

import os

import pytest

from tests.e2e.engine import engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _start(model, **kwargs):
    with engine(model, "SPEEDSFI", **kwargs):
        pass


@pytest.mark.parametrize("section, message", [
    ({"sfi": {"n_recnt": 4}}, "speedsfi.sfi.n_recnt: unknown field (did you mean 'n_recent'?)"),
    ({"sfi": {"n_recent": -1}}, "speedsfi.sfi.n_recent must be >= 0"),
    ({"sfi": {"k": "many"}}, "speedsfi.sfi.k: expected an integer"),
    ({"speed": {"enabled": True, "l_cut": 3}}, "speedsfi.speed.l_cut (3) must be <= the model's number of layers (2)"),
    ({"preset": "nope"}, "speedsfi.preset: no preset named 'nope'"),
    ({"critiprefill": {"enabled": True, "segment_size": 256}},
     "speedsfi.critiprefill.segment_size (256) needs --max-num-batched-tokens > 256 (it is 128)"),
])
def test_bad_speedsfi_config(tiny_models, section, message):
    with pytest.raises(Exception) as e:
        _start(tiny_models["qwen3"], additional_config={"speedsfi": section})
    assert message in str(e.value)


def test_enabling_an_unavailable_method_is_refused(tiny_models, monkeypatch):
    """A build that lacks a method stops start-up instead of running it densely (every method is
    in this build: the check is exercised with the list emptied; the engine runs in-process)."""
    from vllm_ext.backend import startup

    monkeypatch.setattr(startup, "IMPLEMENTED_METHODS", frozenset())
    with pytest.raises(Exception, match="speedsfi.sfi.enabled: sfi is not available"):
        _start(tiny_models["qwen3"], additional_config={"speedsfi": {"sfi": {"enabled": True}}})


def test_quantized_kv_cache_is_refused(tiny_models):
    with pytest.raises(Exception, match="kv_cache_dtype not supported"):
        _start(tiny_models["qwen3"], kv_cache_dtype="fp8", dtype="bfloat16")


def _tiny(tmp_path, cfg_cls, model_cls, **cfg):
    import torch

    torch.manual_seed(0)
    out = str(tmp_path / cfg_cls.__name__)
    model_cls(cfg_cls(**cfg)).save_pretrained(out)
    return out


def test_sliding_window_model_is_refused(tmp_path, tiny_models):
    from transformers import MistralConfig, MistralForCausalLM

    path = _tiny(tmp_path, MistralConfig, MistralForCausalLM, vocab_size=512, hidden_size=128,
                 intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, sliding_window=64, max_position_embeddings=1024)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(tiny_models["qwen3"], f), os.path.join(path, f))
    with pytest.raises(Exception, match="sliding window not supported"):
        _start(path)


def test_alibi_model_is_refused(tmp_path, tiny_models):
    from transformers import BloomConfig, BloomForCausalLM

    path = _tiny(tmp_path, BloomConfig, BloomForCausalLM, vocab_size=512, hidden_size=128, n_layer=2,
                 n_head=4)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(tiny_models["qwen3"], f), os.path.join(path, f))
    with pytest.raises(Exception, match="ALiBi"):
        _start(path)
