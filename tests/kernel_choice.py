"""Run a block of a test on the PyTorch twins instead of the Triton kernels."""

import contextlib
import os


@contextlib.contextmanager
def torch_kernels():
    old = os.environ.get("SPEEDSFI_FORCE_TORCH_KERNELS")
    os.environ["SPEEDSFI_FORCE_TORCH_KERNELS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPEEDSFI_FORCE_TORCH_KERNELS")
        else:
            os.environ["SPEEDSFI_FORCE_TORCH_KERNELS"] = old
