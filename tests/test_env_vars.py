"""SPEEDSFI's environment variables start with ``SPEEDSFI_`` (vLLM warns about unknown ``VLLM_*``
ones); the deprecated ``VLLM_EXT_*`` names work too, with a note logged once; Ray copies ``SPEEDSFI_*``."""

from __future__ import annotations

import logging

from vllm_ext import env_vars


def test_new_name_wins_and_old_name_still_works(monkeypatch, caplog):
    monkeypatch.delenv(env_vars.TRACE_DIR, raising=False)
    monkeypatch.setenv("VLLM_EXT_TRACE_DIR", "/old")
    monkeypatch.setattr(env_vars, "_noted", set())
    with caplog.at_level(logging.WARNING, logger="vllm_ext"):
        assert env_vars.get(env_vars.TRACE_DIR) == "/old"
        assert env_vars.get(env_vars.TRACE_DIR) == "/old"
    notes = [r for r in caplog.records if "VLLM_EXT_TRACE_DIR is deprecated" in r.getMessage()]
    assert len(notes) == 1 and "SPEEDSFI_TRACE_DIR" in notes[0].getMessage()
    monkeypatch.setenv(env_vars.TRACE_DIR, "/new")
    assert env_vars.get(env_vars.TRACE_DIR) == "/new"


def test_default_when_neither_is_set(monkeypatch):
    for name in (env_vars.LOG_INTERVAL_S, env_vars.OLD_NAMES[env_vars.LOG_INTERVAL_S]):
        monkeypatch.delenv(name, raising=False)
    assert env_vars.get(env_vars.LOG_INTERVAL_S, "30") == "30"


def test_every_name_is_ours_and_no_old_name_is_vllms():
    names = [env_vars.TRACE_DIR, env_vars.TRACE_INTERVAL_S, env_vars.LOG_INTERVAL_S, env_vars.ROW_COUNTERS]
    assert all(n.startswith(env_vars.PREFIX) for n in names)
    assert set(env_vars.OLD_NAMES) == set(names)


def test_ray_copies_our_prefix_once(monkeypatch):
    monkeypatch.setenv(env_vars.RAY_PREFIXES, "MY_")
    env_vars.forward_to_ray()
    env_vars.forward_to_ray()
    import os

    assert os.environ[env_vars.RAY_PREFIXES] == "MY_,SPEEDSFI_"
    monkeypatch.delenv(env_vars.RAY_PREFIXES)
    env_vars.forward_to_ray()
    assert os.environ[env_vars.RAY_PREFIXES] == "SPEEDSFI_"
