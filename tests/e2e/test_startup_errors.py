"""Bad configurations and unsupported models stop start-up with a message that names the problem."""

import os

import pytest

from tests.e2e.engine import engine
from tests.e2e.served import serve_until_exit

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


@pytest.mark.parametrize("section, message", [
    ({"sfi": {"n_recnt": 5}}, "speedsfi.sfi.n_recnt: unknown field (did you mean 'n_recent'?)"),
    ({"speed": {"enabled": True, "l_cut": 3}}, "speedsfi.speed.l_cut (3) must be <= the model's number of layers (2)"),
])
def test_offline_config_mistake_stops_in_the_front_end(tiny_models, section, message):
    """``LLM(...)`` raises the ``ConfigError`` itself, before it spawns an engine process (a mistake
    found there would arrive as vLLM's "Engine core initialization failed")."""
    from vllm_ext.config import ConfigError

    with pytest.raises(ConfigError) as e:
        with engine(tiny_models["qwen3"], "SPEEDSFI", multiprocessing=True,
                    additional_config={"speedsfi": section}):
            pass
    assert message in str(e.value)


@pytest.fixture(scope="module")
def vllm_own_argument_error_s(tiny_models, tmp_path_factory) -> float:
    """How long ``vllm serve`` takes to refuse an argument it does not know (import, parse, exit):
    the floor for a refusal in the front-end process on this machine, under its current load."""
    log = tmp_path_factory.mktemp("serve") / "unknown_flag.log"
    seconds, code = serve_until_exit(tiny_models["qwen3"], str(log), args=("--no-such-flag",), timeout_s=180)
    assert code != 0, log.read_text()[-3000:]
    return seconds


@pytest.mark.parametrize("section, message", [
    ({"sfi": {"n_recnt": 5}}, "ConfigError: speedsfi.sfi.n_recnt: unknown field (did you mean 'n_recent'?)"),
    # needs the model's layer count: checked once vLLM has read the model's config, still before any engine
    ({"speed": {"enabled": True, "l_cut": 3}},
     "ConfigError: speedsfi.speed.l_cut (3) must be <= the model's number of layers (2)"),
])
def test_serve_stops_at_once_with_the_config_error_last(tiny_models, tmp_path, vllm_own_argument_error_s,
                                                        section, message):
    """``vllm serve`` with a mistake in ``--additional-config`` exits with status 1 about as soon as
    it refuses an unknown flag (no engine or worker process is started, no weights load), and the
    last line it prints is the one ``ConfigError`` line naming the field."""
    log = tmp_path / "serve.log"
    seconds, code = serve_until_exit(tiny_models["qwen3"], str(log), additional_config={"speedsfi": section},
                                     timeout_s=180)
    out = log.read_text()
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 1, out[-3000:]
    assert lines[-1] == message, out[-3000:]
    assert sum("ConfigError" in line for line in lines) == 1, out[-3000:]     # no traceback around it
    for engine_sign in ("EngineCore", "Worker", "Loading weights", "Traceback"):
        assert engine_sign not in out, engine_sign
    assert seconds < vllm_own_argument_error_s + 10, (seconds, vllm_own_argument_error_s)


def test_enabling_an_unavailable_method_is_refused(tiny_models, monkeypatch):
    """A build that lacks a method stops start-up instead of running it densely (every method is
    in this build: the check is exercised with the list emptied; the engine runs in-process)."""
    from vllm_ext.backend import startup

    monkeypatch.setattr(startup, "IMPLEMENTED_METHODS", frozenset())
    with pytest.raises(Exception, match="speedsfi.sfi.enabled: sfi is not available"):
        _start(tiny_models["qwen3"], additional_config={"speedsfi": {"sfi": {"enabled": True}}})


def test_quantized_kv_cache_is_refused(tiny_models):
    """Quantised caches other than per-tensor fp8 (fp8: tests/e2e/test_fp8_e2e.py)."""
    with pytest.raises(Exception, match="kv_cache_dtype not supported"):
        _start(tiny_models["qwen3"], kv_cache_dtype="int8_per_token_head", dtype="bfloat16")


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
