"""tests/sfi: the Triton selector runs under the interpreter on machines without CUDA.

TRITON_INTERPRET must be set before triton is first imported (vllm_ext.kernels.sfi_selector imports it),
which is why it is set here, at conftest import time. On a CUDA machine the compiled kernels are tested
instead (set SPEEDSFI_TRITON_INTERPRET=1 to force the interpreter there too).
"""

import os

import pytest
import torch

if os.environ.get("SPEEDSFI_TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    # The interpreter evaluates both sides of tl.where with numpy (log(0) on masked lanes).
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
