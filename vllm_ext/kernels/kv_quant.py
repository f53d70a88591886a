"""fp8 KV pages: vLLM's spellings, the page view, per-tensor scales and the (de)quantisation that
every kernel reading K or V pages and its PyTorch twin share.

vLLM allocates an fp8 KV cache as ``torch.uint8`` and its attention backends view it as an fp8
dtype. The convention of this package's kernels:

- Pages arrive as the fp8 *view* (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ...; never
  ``uint8``): :func:`page_view` makes it from vLLM's allocation.
- ``k_scale`` / ``v_scale``: the layer's per-tensor scales as vLLM keeps them (``layer._k_scale``,
  ``layer._v_scale``: fp32 tensors of shape ``[]`` or ``[1]`` on the pages' device). The dequantised
  value is the stored value (as fp32) times the scale. They apply to fp8 pages only (as vLLM's own
  kernels ignore them on a bf16/fp16/fp32 cache); ``None`` means 1. CUDA paths never read them on
  the host: the Triton kernels load them, the twins multiply by the tensors.
- The Triton kernels fold ``k_scale`` into the score scale (``q . (k_s k) = k_s (q . k)``) and
  ``v_scale`` into the normalised output (``sum_j p_j v_s v_j = v_s sum_j p_j v_j``), so K and V
  are read as stored (1 byte an element) and widened to the query's dtype (exact for both fp8
  formats) before the dot.
- SFI's compact segment gathered from fp8 pages holds the same stored bytes (the gather copies
  them unchanged) and carries the pages' scales.
- Representatives of K (block and Quest-page element-wise max / min) are kept in the pages'
  stored units, exact in the pages' dtype; their readers multiply by ``k_scale`` (positive, so a
  max or min commutes with it).
- Writes quantise as vLLM's ``reshape_and_cache``: ``value / scale``, saturated to the format's
  finite range, rounded to nearest.

Nothing here imports vLLM at module import or needs CUDA.
"""

from __future__ import annotations

import torch

# vLLM's spellings of a per-tensor fp8 KV cache (``--kv-cache-dtype``)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                                 "float8_e5m2fnuz") if hasattr(torch, n))


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether pages of ``dtype`` hold fp8 values (the view, not vLLM's ``uint8`` allocation)."""
    return dtype in FP8_DTYPES


def is_fp8_kv_cache_dtype(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


def _platform_e4m3() -> torch.dtype:
    try:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    except Exception:          # pragma: no cover - vLLM absent or no platform: the OCP format
        return torch.float8_e4m3fn


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 dtype a spelling names (``fp8``, ``fp8_e4m3``: the platform's e4m3, ``float8_e4m3fn``
    on CUDA and the CPU, the ``fnuz`` variant on ROCm; ``fp8_e5m2``: ``float8_e5m2``), ``None`` for
    a spelling that is not an fp8 cache. The pages must be read with the dtype the writer stored:
    vLLM's Triton and FlashAttention writes store the platform's e4m3 for every fp8 spelling."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return _platform_e4m3()
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    return None


def stored_dtype(kv_cache_dtype: str, *, on_cpu: bool | None = None) -> torch.dtype | None:
    """The fp8 dtype vLLM's dense backend writes into a ``kv_cache_dtype`` cache (the dtype of its
    page view), ``None`` for a cache that is not fp8. It follows the writer: the CPU build's
    ``CPU_ATTN`` stores the spelling's format (:func:`fp8_dtype`), vLLM's CUDA / ROCm writes (Triton,
    FlashAttention) the platform's e4m3 for every fp8 spelling. ``on_cpu``: the CPU build (default:
    vLLM's platform)."""
    if not is_fp8_kv_cache_dtype(kv_cache_dtype):
        return None
    if on_cpu is None:
        try:
            from vllm.platforms import current_platform

            on_cpu = current_platform.is_cpu()
        except Exception:      # pragma: no cover - vLLM absent: the spelling's format
            on_cpu = True
    return fp8_dtype(kv_cache_dtype) if on_cpu else _platform_e4m3()


def layer_scales(layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` of vLLM's attention ``layer`` (``layer._k_scale``, ``layer._v_scale``;
    ``None``: a layer without them, scale 1). Read them at each use: vLLM updates them in place, and
    a quantisation method may register them again while the weights load."""
    return getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)


def page_view(kv_cache: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """vLLM's ``uint8`` allocation of an fp8 cache viewed as ``dtype`` (no copy); anything else
    (``dtype`` None, or a tensor already of ``dtype``) as it is."""
    if dtype is None or kv_cache.dtype == dtype:
        return kv_cache
    if kv_cache.dtype != torch.uint8 or not is_fp8(dtype):
        raise ValueError(f"page_view: an fp8 view of a uint8 cache, not {kv_cache.dtype} as {dtype}")
    return kv_cache.view(dtype)


def cache_element_size(kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes of one K or V element in a cache of ``kv_cache_dtype`` (vLLM's spelling: ``auto`` is
    the model's dtype)."""
    if is_fp8_kv_cache_dtype(kv_cache_dtype):
        return 1
    named = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "float": torch.float32}.get(kv_cache_dtype, model_dtype)
    return torch.empty((), dtype=named).element_size()


def scaled(pages_dtype: torch.dtype, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> bool:
    """Whether a kernel over pages of ``pages_dtype`` applies scales (fp8 pages with a scale)."""
    return is_fp8(pages_dtype) and (k_scale is not None or v_scale is not None)


def launch_scales(pages_dtype: torch.dtype, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(K scale pointer, V scale pointer, KV_SCALED)`` of a Triton launch: the scales where
    :func:`scaled` (a missing one as a ones tensor), else ``dummy`` twice (never read)."""
    if not scaled(pages_dtype, k_scale, v_scale):
        return dummy, dummy, False
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=dummy.device)
    ks = one if k_scale is None else k_scale
    vs = one if v_scale is None else v_scale
    for s, name in ((ks, "k_scale"), (vs, "v_scale")):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name} must be one fp32 element (the layer's per-tensor scale), got "
                             f"{s.dtype} {tuple(s.shape)}")
    return ks, vs, True


def twin_scale(pages_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor | None:
    """A scale as the PyTorch twins multiply by it: a one-element fp32 tensor (no host read), or
    ``None`` where nothing is scaled (pages not fp8, or no scale)."""
    if scale is None or not is_fp8(pages_dtype):
        return None
    return scale.reshape(()).float()


def host_scale(pages_dtype: torch.dtype, scale: torch.Tensor | float | None) -> float:
    """A scale as a float, for the CPU twins (reading a CPU tensor costs nothing); 1.0 where
    nothing is scaled. Never on a CUDA path."""
    if scale is None or not is_fp8(pages_dtype):
        return 1.0
    if torch.is_tensor(scale):
        if scale.device.type != "cpu":
            raise ValueError("host_scale reads a CPU scale only (a device scale would synchronise)")
        return float(scale.reshape(-1)[0])
    return float(scale)


def dequantize(x: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """``x`` as fp32 times ``scale`` when ``x`` is fp8 and a scale is given, else ``x`` as fp32."""
    xf = x.float()
    if scale is None or not is_fp8(x.dtype):
        return xf
    if torch.is_tensor(scale):
        return xf * scale.reshape(()).to(xf.device, torch.float32)
    return xf * float(scale)


def quantize(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored as ``dtype``: for fp8, ``x / scale`` saturated to the format's finite range and
    rounded to nearest (vLLM's CUDA write; its CPU build's write rounds toward zero); otherwise a
    plain conversion."""
    if not is_fp8(dtype):
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / (scale.reshape(()).to(y.device, torch.float32) if torch.is_tensor(scale) else float(scale))
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes (``uint8`` view) for the copies and comparisons PyTorch lacks for fp8
    on the CPU (``index_copy_``, ``ne``, ``equal``); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
