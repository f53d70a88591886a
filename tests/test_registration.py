"""Plugin registration: the entry point, idempotence, case-insensitive names, pickling by reference
(spawned processes unpickle the config before loading plugins), the CPU selector patch."""

import pickle
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.e2e


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("speedsfi") == "vllm_ext:register"


def test_register_is_idempotent_and_names_are_case_insensitive():
    import vllm_ext
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_ext.register()
    vllm_ext.register()
    member = AttentionBackendEnum["SPEEDSFI"]
    assert member.get_path() == vllm_ext.BACKEND_PATH
    assert [m for m in AttentionBackendEnum.__members__ if m == "SPEEDSFI"] == ["SPEEDSFI"]
    for spelling in ("speedsfi", "SpeedSfi", "SPEEDSFI"):
        assert AttentionConfig(backend=spelling).backend is member
    from vllm_ext.backend.backend import SpeedSfiBackend

    assert member.get_class() is SpeedSfiBackend and SpeedSfiBackend.get_name() == "SPEEDSFI"


def test_member_pickles_by_reference_into_a_fresh_process(tmp_path):
    """A fresh interpreter that never imported vllm_ext unpickles the member (like a spawned worker)."""
    import vllm_ext
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_ext.register()
    blob = tmp_path / "member.pkl"
    blob.write_bytes(pickle.dumps({"backend": AttentionBackendEnum["SPEEDSFI"]}))
    code = textwrap.dedent(f"""
        import pickle, sys
        assert "vllm_ext" not in sys.modules
        obj = pickle.loads(open({str(blob)!r}, "rb").read())
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert obj["backend"] is AttentionBackendEnum["SPEEDSFI"]
        print("OK", obj["backend"].get_path())
    """)
    env_plugins = {"VLLM_PLUGINS": ""}          # no plugin loading: unpickling alone must register
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env_plugins})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK vllm_ext.backend.backend.SpeedSfiBackend" in out.stdout


def test_builtin_members_still_pickle_by_value():
    import vllm_ext
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_ext.register()
    assert pickle.loads(pickle.dumps(AttentionBackendEnum.CPU_ATTN)) is AttentionBackendEnum.CPU_ATTN
    assert "vllm_ext" not in pickle.dumps(AttentionBackendEnum.CPU_ATTN).decode("latin1")


def test_cpu_selector_honours_speedsfi_and_validates():
    import torch
    import vllm_ext
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    vllm_ext.register()
    plat = type(current_platform)
    ok = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    assert plat.get_attn_backend_cls(AttentionBackendEnum["SPEEDSFI"], ok) == vllm_ext.BACKEND_PATH
    assert plat.get_attn_backend_cls(None, ok).endswith("CPUAttentionBackend")
    for bad, reason in [(ok._replace(has_sliding_window=True), "sliding window not supported"),
                        (ok._replace(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype not supported"),
                        (ok._replace(attn_type="encoder_decoder"), "attention type"),
                        (ok._replace(head_size=48), "head_size not supported"),
                        (ok._replace(has_sink=True), "attention sinks not supported"),
                        (ok._replace(use_mla=True), "MLA not supported")]:
        with pytest.raises(ValueError, match=reason):
            plat.get_attn_backend_cls(AttentionBackendEnum["SPEEDSFI"], bad)


def test_flash_attn_delegate_is_refused_where_fa_cannot_run():
    """``speedsfi.dense_delegate = "flash_attn"`` stops start-up naming what FLASH_ATTN refuses, and
    says on the CPU build that it does not apply there."""
    from types import SimpleNamespace

    from vllm_ext.backend.dense_delegate import check_flash_attn_delegate
    from vllm_ext.config import ConfigError

    def cfg(head=128, cache="auto"):
        return SimpleNamespace(model_config=SimpleNamespace(get_head_size=lambda: head),
                               cache_config=SimpleNamespace(cache_dtype=cache))

    check_flash_attn_delegate(cfg(head=1000), on_cpu=True, capability=None)      # CPU: not used
    check_flash_attn_delegate(cfg(), on_cpu=False, capability=None)
    with pytest.raises(ConfigError, match="head size 1000"):
        check_flash_attn_delegate(cfg(head=1000), on_cpu=False, capability=None)
