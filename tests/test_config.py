"""The speedsfi configuration: defaults from ALGORITHMS.md, presets, strict parsing, clear errors."""

import dataclasses
import math

import pytest

from vllm_ext.config import ConfigError, SpeedSfiConfig, check_request_overrides, load_preset, preset_names, request_overrides
from vllm_ext.methods.sfi.config import SfiConfig


def test_defaults_match_algorithms_md():
    cfg = SpeedSfiConfig.from_dict(None)
    assert not cfg.any_enabled
    s = cfg.sfi
    assert (s.k, s.k_min, s.n_sink, s.n_recent, s.refresh, s.w_prefill) == (2048, 32, 4, 256, 32, 16)
    assert (s.alpha, s.gamma_k, s.pos_power, s.pos_eta, s.w_k, s.w_pos) == (0.5, 0.5, 1.8, 0.4, 1.0, 0.7)
    assert s.pos_beta == pytest.approx(-math.log(0.6) / 0.9) and s.pos_beta == pytest.approx(0.5676, abs=1e-4)
    assert (s.lambda_max, s.nms_radius, s.mu, s.cross_head_temperature, s.lam_x) == (0.02, 16, 0.5, 2.0, 0.35)
    assert set(s.trigger_chars) == {".", "?", "!", ";", "\n", "。", "？", "！"}
    assert s.maintenance_rows is None          # resolved at start-up (docs/sfi.md, "Slow-row maintenance in chunks")
    c = cfg.critiprefill
    assert (c.segment_size, c.block_size, c.budget, c.alpha, c.min_len) == (512, 32, 2048, 0.25, 4096)
    assert (c.score, c.fusion, c.sink_block, c.dense_layers) == ("code", "ema", False, (0,))
    assert cfg.speed.resolved_l_cut(32) == 24 and cfg.speed.anchor == "bos"


def test_explicit_fields_override_preset():
    cfg = SpeedSfiConfig.from_dict({"preset": "sfi-paper", "sfi": {"k": 512}})
    assert cfg.sfi.enabled and cfg.sfi.k == 512 and cfg.sfi.n_recent == 256 and cfg.preset == "sfi-paper"


def test_boundary_schedule_fields():
    from vllm_ext.methods.sfi.config import SfiConfig

    # the defaults keep our schedule: fire at the step after a trigger, no cooldown, no gap
    s = SpeedSfiConfig.from_dict(None).sfi
    assert (s.schedule, s.fire_at, s.sentence_cooldown, s.min_boundary_gap) == ("boundary", "sentence_end", 0, 0)
    # the sfi presets mirror the authors' RefreshTriggerConfig defaults
    for name, k in (("sfi-paper", 2048), ("sfi-quality", 4096)):
        s = SpeedSfiConfig.from_dict({"preset": name}).sfi
        assert (s.enabled, s.k, s.n_sink, s.n_recent, s.refresh) == (True, k, 4, 256, 32), name
        assert (s.schedule, s.fire_at, s.sentence_cooldown, s.min_boundary_gap) == \
            ("boundary", "sentence_start", 2, 16), name
    # explicit fields override the preset (back to our schedule)
    s = SpeedSfiConfig.from_dict({"preset": "sfi-paper", "sfi": {"fire_at": "sentence_end", "sentence_cooldown": 0,
                                                            "min_boundary_gap": 0}}).sfi
    assert (s.fire_at, s.sentence_cooldown, s.min_boundary_gap) == ("sentence_end", 0, 0)
    # a dataclass built in code is validated too
    with pytest.raises(ConfigError, match="speedsfi.sfi.fire_at must be 'sentence_end' or 'sentence_start'"):
        SfiConfig(fire_at="later").validate()
    with pytest.raises(ConfigError, match="speedsfi.sfi.sentence_cooldown must be >= 0"):
        SfiConfig(sentence_cooldown=-3).validate()


def test_every_shipped_preset_parses():
    names = preset_names()
    assert {"dense", "sfi", "speed", "critiprefill", "all"} <= set(names)
    for name in names:
        SpeedSfiConfig.from_dict({"preset": name})
    assert not SpeedSfiConfig.from_dict({"preset": "dense"}).any_enabled


def test_preset_by_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("speedsfi:\n  sfi: {enabled: true, k: 64, n_recent: 8}\n")
    cfg = SpeedSfiConfig.from_dict({"preset": str(p)})
    assert cfg.sfi.k == 64 and cfg.sfi.n_recent == 8
    assert load_preset(str(p))["sfi"]["k"] == 64


@pytest.mark.parametrize("raw, field", [
    ({"sfi": {"n_recnt": 3}}, "speedsfi.sfi.n_recnt: unknown field (did you mean 'n_recent'?)"),
    ({"sfii": {}}, "speedsfi.sfii: unknown field"),
    ({"sfi": {"k": "big"}}, "speedsfi.sfi.k: expected an integer"),
    ({"sfi": {"k": 2.5}}, "speedsfi.sfi.k: expected an integer"),
    ({"sfi": {"enabled": "yes"}}, "speedsfi.sfi.enabled: expected true or false"),
    ({"sfi": {"n_recent": -1}}, "speedsfi.sfi.n_recent must be >= 0"),
    ({"sfi": {"k": 0}}, "speedsfi.sfi.k must be > 0"),
    ({"sfi": {"k": 16, "k_min": 32}}, "speedsfi.sfi.k_min (32) must be <= sfi.k (16)"),
    ({"sfi": {"schedule": "sometimes"}}, "speedsfi.sfi.schedule: expected one of"),
    ({"sfi": {"alpha": 0}}, "speedsfi.sfi.alpha must be in (0, 1]"),
    ({"sfi": {"lambda_max": float("nan")}}, "speedsfi.sfi.lambda_max: expected a finite number"),
    ({"sfi": {"trigger_chars": ["..", "?"]}}, "speedsfi.sfi.trigger_chars: each entry must be one character"),
    ({"sfi": {"select_span": -1}}, "speedsfi.sfi.select_span must be >= 0"),
    ({"sfi": {"select_span": 33}}, "speedsfi.sfi.select_span + sfi.select_span_back (33 + 0) must be <= 32"),
    ({"sfi": {"select_span": 20, "select_span_back": 13}},
     "speedsfi.sfi.select_span + sfi.select_span_back (20 + 13) must be <= 32"),
    ({"sfi": {"k": 256, "keep_prefill": 240}}, "speedsfi.sfi.keep_prefill (240) must be <= sfi.k - sfi.k_min"),
    ({"sfi": {"keep_prefill": -1}}, "speedsfi.sfi.keep_prefill"),
    ({"sfi": {"fire_at": "sentence_middle"}},
     "speedsfi.sfi.fire_at: expected one of 'sentence_end', 'sentence_start', got 'sentence_middle'"),
    ({"sfi": {"sentence_cooldown": -1}}, "speedsfi.sfi.sentence_cooldown must be >= 0, got -1"),
    ({"sfi": {"sentence_cooldown": 1.5}}, "speedsfi.sfi.sentence_cooldown: expected an integer"),
    ({"sfi": {"sentence_cooldown": 1 << 21}}, "speedsfi.sfi.sentence_cooldown (2097152) must be <= 1048576"),
    ({"sfi": {"min_boundary_gap": -2}}, "speedsfi.sfi.min_boundary_gap must be >= 0, got -2"),
    ({"sfi": {"selector": "h2o"}}, "speedsfi.sfi.selector: expected one of 'sfi', 'quest', got 'h2o'"),
    ({"sfi": {"page_size": 0}}, "speedsfi.sfi.page_size must be > 0, got 0"),
    ({"sfi": {"maintenance_rows": 0}}, "speedsfi.sfi.maintenance_rows must be > 0, got 0"),
    ({"sfi": {"page_size": 512}}, "speedsfi.sfi.page_size (512) must be <= 256"),
    ({"sfi": {"selector": "quest", "k": 100}},
     "speedsfi.sfi.k (100) must be a multiple of sfi.page_size (16) with selector 'quest'"),
    ({"sfi": {"selector": "quest", "k": 256, "select_span": 4}},
     "speedsfi.sfi.select_span and select_span_back must be 0 with selector 'quest'"),
    ({"sfi": {"selector": "quest", "k": 256, "schedule": "always_slow"}},
     "speedsfi.sfi.schedule 'always_slow' (dense decode) does not apply to selector 'quest'"),
    ({"speed": {"l_cut": 0}}, "speedsfi.speed.l_cut must be > 0"),
    ({"speed": {"anchor": "eos"}}, "speedsfi.speed.anchor: expected one of 'bos', 'none'"),
    ({"critiprefill": {"budget": 100}}, "must be a multiple of critiprefill.block_size"),
    ({"critiprefill": {"dense_layers": [0, "one"]}}, "speedsfi.critiprefill.dense_layers[1]: expected an integer"),
    ({"preset": "no-such-preset"}, "speedsfi.preset: no preset named 'no-such-preset'"),
    ({"sfi": 3}, "speedsfi.sfi: expected a mapping"),
])
def test_bad_input_names_the_field(raw, field):
    with pytest.raises(ConfigError) as e:
        SpeedSfiConfig.from_dict(raw)
    assert field in str(e.value)


def test_quest_selector_accepted():
    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "selector": "quest", "k": 96, "page_size": 32,
                                            "schedule": "periodic", "refresh": 1}})
    assert cfg.sfi.selector == "quest" and cfg.sfi.page_size == 32
    assert SpeedSfiConfig.from_dict({}).sfi.selector == "sfi"      # the paper's selector by default
    # a per-request budget that breaks the page rule is refused like any invalid override
    with pytest.raises(ConfigError, match="multiple of sfi.page_size"):
        cfg.with_overrides({"sfi": {"k": 100}})


def test_model_dependent_checks():
    cfg = SpeedSfiConfig.from_dict({"speed": {"enabled": True, "l_cut": 30}})
    cfg.validate_for_model(num_layers=32)
    with pytest.raises(ConfigError, match=r"speedsfi.speed.l_cut \(30\) must be <= the model's number of layers \(24\)"):
        cfg.validate_for_model(num_layers=24)
    cfg = SpeedSfiConfig.from_dict({"critiprefill": {"enabled": True, "dense_layers": [0, 40]}})
    with pytest.raises(ConfigError, match="dense_layers: layer 40 does not exist"):
        cfg.validate_for_model(num_layers=32)


def test_per_request_overrides_are_validated():
    base = SpeedSfiConfig.from_dict({"preset": "sfi-paper"})
    assert base.with_overrides({"sfi": {"k": 128}}).sfi.k == 128
    # the default keeps 512 prefill-end tokens: a request's k below that must say which field binds
    with pytest.raises(ConfigError, match=r"keep_prefill \(512\) must be <= sfi.k - sfi.k_min"):
        SpeedSfiConfig.from_dict({"preset": "sfi"}).with_overrides({"sfi": {"k": 128}})
    assert base.with_overrides({"sfi": {"enabled": False}}).sfi.enabled is False
    assert base.with_overrides(None) is base
    with pytest.raises(ConfigError, match="speedsfi.sfi.kk: unknown field"):
        base.with_overrides({"sfi": {"kk": 1}})
    with pytest.raises(ConfigError, match="cannot be overridden per request"):
        base.with_overrides({"preset": "dense"})


def test_trigger_chars_accepts_a_string():
    assert SpeedSfiConfig.from_dict({"sfi": {"trigger_chars": ".?"}}).sfi.trigger_chars == (".", "?")


def test_sfi_enabled_alone_is_the_sfi_preset():
    """`sfi: {enabled: true}` with no other field gives the default selection (the `sfi` preset,
    chosen on a real model); any other field starts from the published constants."""
    alone = SpeedSfiConfig.from_dict({"sfi": {"enabled": True}}).sfi
    preset = SpeedSfiConfig.from_dict({"preset": "sfi"}).sfi
    assert alone == preset and alone.enabled
    from vllm_ext.methods.sfi.config import SfiConfig

    paper = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "n_sink": 4}}).sfi
    assert paper == dataclasses.replace(SfiConfig(), enabled=True)
    assert not SpeedSfiConfig.from_dict({"sfi": {"enabled": False}}).sfi.enabled
    # the other sections keep theirs
    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True}, "speed": {"enabled": True}})
    assert cfg.sfi == preset and cfg.speed.enabled


def test_sfi_default_is_the_selection_measured_on_the_real_model():
    """The `sfi` preset is what bench/QUALITY.md ("A real model") measured as the default; a fast step
    reads at most 20 % of a dense step's KV at 8K tokens."""
    s = SpeedSfiConfig.from_dict({"preset": "sfi"}).sfi
    assert s.enabled and s.selector == "sfi"
    assert (s.k, s.n_recent, s.select_span, s.select_span_back, s.keep_prefill) == (1024, 128, 12, 2, 512)
    assert (s.n_sink + s.k + s.n_recent) / 8000 <= 0.20
    # sparse decode from twice the budget on (a fast step then reads at most half the context)
    assert s.min_len == 2 * (s.n_sink + s.k + s.n_recent)


# ------------------------------------------------------------------ per-request overrides
_SFI_ENGINE = {"sfi": {"enabled": True, "k": 256, "n_recent": 64}}


@pytest.mark.parametrize("engine, overrides, message", [
    (_SFI_ENGINE, {"sfi": {"k": "many"}}, "speedsfi.sfi.k: expected an integer"),
    (_SFI_ENGINE, {"sfi": {"k": -5}}, "speedsfi.sfi.k"),
    (_SFI_ENGINE, {"sfi": {"k": 10 ** 9}}, "speedsfi.sfi.k (1000000000) must be <= the server's sfi.k (256)"),
    (_SFI_ENGINE, {"sfi": {"kk": 5}}, "speedsfi.sfi.kk: unknown field (did you mean 'k'?)"),
    (_SFI_ENGINE, {"sfii": {}}, "speedsfi.sfii: unknown field"),
    (_SFI_ENGINE, {"sfi": {"n_recent": 8}}, "speedsfi.sfi.n_recent is engine-wide"),
    (_SFI_ENGINE, {"critiprefill": {"enabled": True}}, "speedsfi.critiprefill.enabled is engine-wide"),
    (_SFI_ENGINE, {"speed": {"enabled": True}}, "speedsfi.speed.enabled is engine-wide"),
    (_SFI_ENGINE, {"preset": "sfi"}, "speedsfi.preset cannot be overridden per request"),
    (_SFI_ENGINE, {"dense_decode": "delegate"}, "speedsfi.dense_decode is engine-wide"),
    (_SFI_ENGINE, {"sfi": {"enabled": "yes"}}, "speedsfi.sfi.enabled"),
    (_SFI_ENGINE, {"sfi": 3}, "speedsfi.sfi"),
    ({}, {"sfi": {"enabled": True}}, "speedsfi.sfi.enabled: this server was started without SFI"),
])
def test_bad_request_overrides_name_the_field(engine, overrides, message):
    with pytest.raises(ConfigError) as e:
        check_request_overrides(SpeedSfiConfig.from_dict(engine), overrides)
    assert message in str(e.value)


def test_good_request_overrides():
    engine = SpeedSfiConfig.from_dict(_SFI_ENGINE)
    assert check_request_overrides(engine, None) is engine
    assert check_request_overrides(engine, {"sfi": {"enabled": False}}).sfi.enabled is False
    assert check_request_overrides(engine, {"sfi": {"k": 128}}).sfi.k == 128
    assert check_request_overrides(engine, {"sfi": {"k": 256}}).sfi.k == 256     # above any context: dense


def test_request_overrides_from_json_text():
    assert request_overrides({"speedsfi": '{"sfi": {"k": 128}}'}) == {"sfi": {"k": 128}}
    assert request_overrides({"other": 1}) is None and request_overrides(None) is None
    with pytest.raises(ConfigError, match="not valid JSON"):
        request_overrides({"speedsfi": "{sfi"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        request_overrides({"speedsfi": "[1, 2]"})


def test_dense_delegate_is_an_engine_wide_choice():
    from vllm_ext.config import ConfigError, SpeedSfiConfig, check_request_overrides

    # "triton" stays the default until a GPU run has checked "auto" token for token
    assert SpeedSfiConfig.from_dict(None).dense_delegate == "triton"
    assert SpeedSfiConfig.from_dict({"dense_delegate": "auto"}).dense_delegate == "auto"
    cfg = SpeedSfiConfig.from_dict({"preset": "sfi", "dense_delegate": "flash_attn"})
    assert cfg.dense_delegate == "flash_attn" and cfg.sfi.enabled
    with pytest.raises(ConfigError, match="dense_delegate"):
        SpeedSfiConfig.from_dict({"dense_delegate": "flashinfer"})
    with pytest.raises(ConfigError, match="engine-wide"):
        check_request_overrides(cfg, {"dense_delegate": "triton"})


def test_the_copy_trigger_is_on_by_default_and_off_in_the_paper_presets():
    """copy_ngram 2, copy_max_matches 1, copy_once by default (SfiConfig's and the `sfi`
    preset's); the presets that are the paper say copy_ngram 0."""
    s = SfiConfig()
    assert (s.copy_ngram, s.resolved_copy_ngram, s.copy_max_matches, s.copy_once) == (None, 2, 1, True)
    preset = SpeedSfiConfig.from_dict({"preset": "sfi"}).sfi
    assert (preset.copy_ngram, preset.copy_max_matches, preset.copy_once) == (2, 1, True)
    assert load_preset("sfi")["sfi"]["copy_ngram"] == 2
    for name in ("sfi-paper", "sfi-quality"):
        assert load_preset(name)["sfi"]["copy_ngram"] == 0
        assert SpeedSfiConfig.from_dict({"preset": name}).sfi.resolved_copy_ngram == 0
    assert SpeedSfiConfig.from_dict({"preset": "all"}).sfi.resolved_copy_ngram == 2


@pytest.mark.parametrize("sfi", [{"schedule": "always_slow"}, {"refresh": 1}, {"schedule": "periodic", "refresh": 1},
                                 {"selector": "quest", "page_size": 16, "k": 256, "schedule": "periodic",
                                  "refresh": 1}])
def test_the_default_copy_trigger_is_inert_where_every_step_is_slow(sfi):
    """Unset, copy_ngram resolves to 0 where every decode step is slow already (no history group, no
    per-step launches), so a configuration that leaves the copy trigger unset is valid, alone and on
    top of the `sfi` preset (whose copy_ngram 2 gives way like the default)."""
    for raw in ({"sfi": {"enabled": True, **sfi}}, {"preset": "sfi", "sfi": dict(sfi)}):
        if "selector" in sfi and "preset" in raw:
            raw["sfi"].update(keep_prefill=0, select_span=0, select_span_back=0)
        cfg = SpeedSfiConfig.from_dict(raw).sfi
        assert cfg.resolved_copy_ngram == 0, raw


def test_an_explicit_copy_trigger_that_cannot_apply_is_refused():
    for raw in ({"sfi": {"enabled": True, "schedule": "always_slow", "copy_ngram": 2}},
                {"preset": "sfi", "sfi": {"schedule": "always_slow", "copy_ngram": 3}}):
        with pytest.raises(ConfigError, match=r"sfi.copy_ngram \(\d\) applies to schedules 'boundary' and "
                                              r"'periodic'.*leave it unset or set it to 0"):
            SpeedSfiConfig.from_dict(raw)
    # explicit 0 is always fine; an explicit n-gram where every step is slow anyway stays valid (as before)
    assert SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "schedule": "always_slow",
                                             "copy_ngram": 0}}).sfi.resolved_copy_ngram == 0
    assert SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "refresh": 1,
                                             "copy_ngram": 3}}).sfi.resolved_copy_ngram == 3
    # Quest with a schedule that has fast steps: the trigger applies (a copying step is a selection step)
    q = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "selector": "quest", "k": 256, "refresh": 4,
                                          "schedule": "periodic"}}).sfi
    assert q.resolved_copy_ngram == 2


def test_the_unset_copy_trigger_survives_replace_and_overrides():
    """Unset stays unset (resolved where read), so a derived configuration resolves it again."""
    s = SfiConfig(enabled=True)
    assert dataclasses.replace(s, schedule="always_slow").resolved_copy_ngram == 0
    dataclasses.replace(s, schedule="always_slow").validate()
    engine = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 256, "n_recent": 64}})
    assert engine.with_overrides({"sfi": {"k": 128}}).sfi == dataclasses.replace(engine.sfi, k=128)
    # a request asking for always_slow on a `sfi`-preset server: the field it set is named
    with pytest.raises(ConfigError, match="speedsfi.sfi.schedule is engine-wide"):
        check_request_overrides(SpeedSfiConfig.from_dict({"preset": "sfi"}), {"sfi": {"schedule": "always_slow"}})
