"""``speedsfi.dense_delegate = "auto"`` hands the dense rows to the backend vLLM's own
selector picks (what ``vllm serve MODEL`` runs), and says so at start-up."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_ext import metrics  # noqa: E402
from vllm_ext.backend.dense_delegate import resolve_dense_delegate, vllm_default_backend  # noqa: E402
from vllm_ext.config import SpeedSfiConfig  # noqa: E402


def _vllm_config(head=128, dtype=torch.bfloat16, cache="auto", block=16, user_block=False):
    model = SimpleNamespace(get_head_size=lambda: head, dtype=dtype, use_mla=False,
                            get_num_attention_heads=lambda parallel: 32)
    return SimpleNamespace(model_config=model, parallel_config=None,
                           cache_config=SimpleNamespace(cache_dtype=cache, block_size=block,
                                                        user_specified_block_size=user_block))


@pytest.mark.parametrize("picked,expected", [("FLASH_ATTN", "flash_attn"), ("TRITON_ATTN", "triton")])
def test_auto_follows_vllms_pick(picked, expected, caplog):
    cfg = SpeedSfiConfig.from_dict({"preset": "sfi", "dense_delegate": "auto"})
    with caplog.at_level(logging.INFO, logger="vllm_ext"):
        got = resolve_dense_delegate(cfg, _vllm_config(), on_cpu=False, pick=lambda vc: picked)
    assert got == expected
    assert any(picked in r.getMessage() and "vLLM's pick" in r.getMessage() for r in caplog.records)


def test_auto_with_a_pick_we_cannot_delegate_to_runs_triton_logged_and_counted():
    cfg = SpeedSfiConfig.from_dict({"dense_delegate": "auto"})
    before = metrics.snapshot().get("fallback.dense_delegate_auto", 0)
    assert resolve_dense_delegate(cfg, _vllm_config(), on_cpu=False, pick=lambda vc: "FLASHINFER") == "triton"
    assert metrics.snapshot()["fallback.dense_delegate_auto"] == before + 1


def test_explicit_choices_and_the_cpu_build_never_ask_the_selector():
    def refuse(vc):
        raise AssertionError("the selector was asked")

    for name in ("triton", "flash_attn"):
        cfg = SpeedSfiConfig.from_dict({"dense_delegate": name})
        assert resolve_dense_delegate(cfg, _vllm_config(), on_cpu=False, pick=refuse) == name
    cfg = SpeedSfiConfig.from_dict({"dense_delegate": "auto"})
    assert resolve_dense_delegate(cfg, _vllm_config(), on_cpu=True, pick=refuse) == "auto"


def test_vllm_default_backend_asks_the_platform_for_this_model_with_no_backend_named(monkeypatch):
    """What vLLM's selector sees: the model's head size and dtype, the cache dtype, the block size
    only when the user named one, and no selected backend (vLLM's default, as ``vllm serve`` runs)."""
    from vllm.platforms import current_platform

    seen = {}

    def fake(selected, attn_selector_config, num_heads=None):
        seen.update(selected=selected, sel=attn_selector_config, num_heads=num_heads)
        return "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"

    monkeypatch.setattr(current_platform, "get_attn_backend_cls", fake)
    assert vllm_default_backend(_vllm_config(head=64, cache="fp8")) == "FLASH_ATTN"
    assert seen["selected"] is None and seen["num_heads"] == 32
    sel = seen["sel"]
    assert (sel.head_size, sel.dtype, sel.kv_cache_dtype, sel.block_size) == (64, torch.bfloat16, "fp8", None)
    vllm_default_backend(_vllm_config(block=32, user_block=True))
    assert seen["sel"].block_size == 32


def test_an_unresolved_auto_never_reaches_the_delegate_classes():
    from vllm_ext.backend.dense_delegate import dense_delegate_impl_cls

    with pytest.raises(RuntimeError, match="not resolved"):
        dense_delegate_impl_cls("auto")
