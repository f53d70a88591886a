"""Kernel tests: on a machine without CUDA the Triton kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before triton (and any ``vllm_ext.kernels`` module) is imported:
``@triton.jit`` decides at decoration time. This conftest is imported by pytest before the test
modules of this directory.
"""
import os


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))   # tests/kernels/kernel_testlib.py


def pytest_configure(config):
    # The interpreter converts 1-element arrays to scalars for loop bounds (numpy deprecation noise).
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim:DeprecationWarning")
