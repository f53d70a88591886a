"""CritiPrefill tests: the Triton kernels run under the CPU interpreter where there is no GPU.

``TRITON_INTERPRET`` must be set before triton (and the kernel modules) are imported: ``@triton.jit``
decides at decoration time. With a CUDA device the kernels run natively on it instead.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))   # tests/critiprefill/helpers.py


def pytest_configure(config):
    # numpy's deprecation inside triton's interpreter (one per interpreted scalar); noise only
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
