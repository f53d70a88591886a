"""Dispatch rules of triton_utils, and a guard that the kernel tests really exercise Triton."""

import os

import pytest
import torch

from vllm_ext.kernels import triton_utils as tu


def test_kernel_tests_run_triton():
    """On CPU the conftest turns the interpreter on before any kernel module is imported; if some
    other import came first, every 'kernel vs twin' test would silently compare the twin with
    itself. Fail loudly instead."""
    if not tu.has_triton():
        pytest.skip("triton is not installed")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert tu.use_triton(torch.zeros(1, device=dev))


def test_use_triton_rules(monkeypatch):
    if not tu.has_triton():
        assert not tu.use_triton("cpu")
        return
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    assert not tu.use_triton("cpu")
    assert not tu.use_triton(torch.device("cuda"))
    monkeypatch.delenv("SPEEDSFI_FORCE_TORCH_KERNELS")
    assert tu.use_triton(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tu.use_triton("cpu")
    assert not tu.interpret_mode()


def test_dot_in_fp32_and_helpers(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tu.dot_in_fp32(torch.bfloat16) and tu.dot_in_fp32(torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tu.dot_in_fp32(torch.float32) and not tu.dot_in_fp32(torch.bfloat16)
    assert [tu.next_pow2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
    m = tu.as_row_mask(None, 3, torch.device("cpu"))
    assert m.dtype == torch.bool and m.all()
    assert tu.as_row_mask(torch.tensor([0, 2], dtype=torch.int8), 2, "cpu").tolist() == [False, True]


def test_untuned_strips_an_autotuner_and_keeps_a_plain_kernel():
    from vllm_ext.kernels.triton_utils import fixed_meta, untuned

    class Autotuner:                      # the name triton's autotuner class has
        fn = object()

    tuned = Autotuner()
    assert untuned(tuned) is Autotuner.fn
    plain = object()
    assert untuned(plain) is plain
    assert fixed_meta({"BLOCK_N": 64}, {"BLOCK_N": 32})["BLOCK_N"] in (32, 64)
