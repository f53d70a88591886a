"""Triton availability and dispatch between a Triton kernel and its PyTorch twin.

Rules (shared by every kernel module):
- ``triton`` is imported guarded: where it is missing, ``HAS_TRITON`` is False, the kernel modules
  still import and every op runs its PyTorch twin.
- A Triton kernel runs when the tensors are on CUDA, or when ``TRITON_INTERPRET=1`` is set (CPU
  interpreter, used by the tests). Otherwise the PyTorch twin runs.
- ``TRITON_INTERPRET`` must be set before the kernel modules are imported: ``@triton.jit`` decides
  at decoration time whether a function is interpreted.
- Under the interpreter, ``tl.dot`` on bf16 operands returns garbage (Triton 3.6 and 3.9), so the
  kernels take an ``F32_DOT`` constexpr from :func:`dot_in_fp32` and cast their operands to fp32.
- Autotuning is for CUDA only: :func:`autotune` returns a plain pass-through under the interpreter,
  where the kernel is launched with the first config's meta-parameters.

Nothing here imports vLLM or needs CUDA.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from vllm_ext.kernels.kv_quant import is_fp8

try:  # guarded: the package must import where triton is missing
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

_FORCE_TORCH_ENV = "SPEEDSFI_FORCE_TORCH_KERNELS"
# Kernels are decorated (interpreted or compiled) when their module is imported, which happens right
# after this module is imported; CPU dispatch to Triton needs the interpreter on at that time.
_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _autotune_at_import() -> bool:
    return (HAS_TRITON and not _INTERPRET_AT_IMPORT
            and os.environ.get("SPEEDSFI_AUTOTUNE", "1") != "0")


_AUTOTUNE_AT_IMPORT = _autotune_at_import()


def has_triton() -> bool:
    """True when ``import triton`` works in this process."""
    return HAS_TRITON


def interpret_mode() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def use_triton(device: torch.device | torch.Tensor | str | None) -> bool:
    """Whether an op on ``device`` (or on a tensor's device) should run its Triton kernel.

    Triton when triton imports and either the device is CUDA or the interpreter is on.
    ``SPEEDSFI_FORCE_TORCH_KERNELS=1`` forces the PyTorch twins (debugging, benchmarks' smoke mode).
    """
    if not HAS_TRITON:
        return False
    if hasattr(device, "device"):        # a tensor, or anything holding one (kernels.packed_pages)
        device = device.device
    dev = torch.device(device) if device is not None and not isinstance(device, torch.device) else device
    if (dev is None or dev.type == "cpu") and not _INTERPRET_AT_IMPORT:
        return False                      # the CPU build's hot path: no environment look-ups
    dev = dev if dev is not None else torch.device("cpu")
    if os.environ.get(_FORCE_TORCH_ENV, "0") not in ("", "0"):
        return False
    if dev.type == "cuda":
        return True
    return _INTERPRET_AT_IMPORT and interpret_mode()


def dot_in_fp32(dtype: torch.dtype, query_dtype: torch.dtype | None = None) -> bool:
    """Whether a kernel must cast ``tl.dot`` operands of ``dtype`` to fp32.

    fp32 caches always dot in fp32 (IEEE precision). Under the interpreter every dtype is cast (its
    bf16 dot is wrong; fp16 is cast too so both half types follow one code path). fp8 pages are
    widened to the query's dtype (``query_dtype``) before the dot, so that dtype decides.
    """
    if query_dtype is not None and is_fp8(dtype):
        dtype = query_dtype
    return dtype == torch.float32 or interpret_mode()


def autotune_enabled() -> bool:
    """Autotuning is on for CUDA unless ``SPEEDSFI_AUTOTUNE=0`` (tests set it to bound compile time)
    and always off under the interpreter. Read when the kernel modules are imported."""
    return HAS_TRITON and not interpret_mode() and os.environ.get("SPEEDSFI_AUTOTUNE", "1") != "0"


def launch_meta(default: dict[str, Any], interpret: dict[str, Any] | None = None) -> dict[str, Any]:
    """Meta-parameters a launcher passes explicitly: none when autotuned (the autotuner picks them),
    ``interpret`` under the interpreter, else ``default`` (autotune disabled on CUDA)."""
    if interpret_mode():
        return dict(interpret if interpret is not None else default)
    if _AUTOTUNE_AT_IMPORT:
        return {}
    return dict(default)


def untuned(kernel):
    """The kernel without its autotuner. For launches whose work is decided on the device (row
    masks, live counts): vLLM's warm-up and CUDA-graph capture runs carry none of that work, so an
    autotuner would time empty launches and keep an arbitrary config. Launch with
    :func:`fixed_meta`."""
    return kernel.fn if type(kernel).__name__ == "Autotuner" else kernel


def fixed_meta(default: dict[str, Any], interpret: dict[str, Any] | None = None) -> dict[str, Any]:
    """Explicit meta-parameters for an :func:`untuned` launch (``interpret`` under the interpreter)."""
    if interpret_mode():
        return dict(interpret if interpret is not None else default)
    return dict(default)


def autotune(configs: list, key: list[str], **kwargs: Any) -> Callable:
    """``triton.autotune`` on CUDA; identity under the interpreter (it would run every config) and
    when ``SPEEDSFI_AUTOTUNE=0``."""
    if not autotune_enabled():
        def deco(fn):
            return fn
        return deco
    return triton.autotune(configs=configs, key=key, **kwargs)


def next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def with_strides(t: torch.Tensor, dims: int | None = None) -> tuple:
    """``(t, *t.stride())``: a tensor argument of a launch followed by its strides (the first ``dims``)."""
    return (t, *t.stride()[:dims])


def num_sms(device: torch.device | None) -> int:
    """Streaming multiprocessors of a CUDA device (cached); a fixed small number elsewhere."""
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        if idx is None:
            idx = torch.cuda.current_device()
        return _cuda_sms(idx)
    return 4


_SM_CACHE: dict[int, int] = {}


def _cuda_sms(idx: int) -> int:
    if idx not in _SM_CACHE:
        _SM_CACHE[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_CACHE[idx]


def as_row_mask(row_mask: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor:
    """The row mask as a bool tensor (all-True when ``None``). Allocates only when ``None`` or not bool."""
    if row_mask is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    if row_mask.dtype != torch.bool:
        return row_mask != 0
    return row_mask
