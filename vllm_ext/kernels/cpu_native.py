"""SFI's slow-step work on the CPU build as compiled code (``csrc/sfi_cpu.cpp``): the dense pass with
evidence over ``CPU_ATTN``'s packed pages (the row's attention output, the evidence and the key
norms from one set of scores) and the closed-form selector, one request at a time.

Why: on the real model at 8K a slow step's PyTorch twins (about 150 small ops per layer: the fp32
gather of K, two matmuls, the log-sum-exps, the selector's refinements) cost about 4x a dense step,
and sparse decode lost to dense on the mean. The C++ reads bf16 K and V once, keeps the scores in
cache and fuses the selector's passes.

Built at first use, like FlashInfer's JIT kernels: ``g++ -O3 -march=native`` into a shared object
under ``$SPEEDSFI_CPU_KERNEL_CACHE`` (default ``~/.cache/vllm_speedsfi/cpu_kernels``), named by a
hash of the source, the flags, the compiler and this CPU's feature flags, written atomically (a
second process waits for nothing: it builds its own temporary and the rename wins), loaded with
``ctypes`` (no torch headers: about 1 s to build). No compiler, a failed build or
``SPEEDSFI_CPU_NATIVE=0``: the PyTorch twins run instead, and the fallback is logged once and counted
(``fallback.cpu_native``). Torch only; no vLLM import.

Callers give contiguous fp32 rows; the wrappers check what the C++ assumes (dtypes, strides,
ranges) and return False where it does not hold, so the twin runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from vllm_ext import metrics
from vllm_ext.kernels.packed_pages import PageView

ENV = "SPEEDSFI_CPU_NATIVE"
CACHE_ENV = "SPEEDSFI_CPU_KERNEL_CACHE"
SOURCE = Path(__file__).with_name("csrc") / "sfi_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared",
         "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_EVIDENCE_ARGS = [_ptr, _i64, _i64, _i32, _i32, _i32, _i32, _ptr, _i64, _i64, _i64, _i64, _ptr, _f32, _f32,
                  _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i32]
_SELECT_ARGS = [_ptr, _i64, _ptr, _i64, _i32, _i64, _i64, _ptr, _i32, _i32, _i32, _i64, _ptr, _i64, _ptr,
                _i64, _ptr]


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build() -> ctypes.CDLL:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()])
                         .encode()).hexdigest()[:20]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vllm_speedsfi" / "cpu_kernels")
    target = cache / f"sfi_cpu_{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=cache)
        os.close(fd)
        try:
            res = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name in ("sfi_evidence_bf16", "sfi_evidence_f32"):
        getattr(lib, name).argtypes = _EVIDENCE_ARGS
        getattr(lib, name).restype = None
    lib.sfi_select_row.argtypes = _SELECT_ARGS
    lib.sfi_select_row.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built at the first call of the process; None when they cannot be had
    (logged once; each call that falls back is counted by its caller)."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _build()
                metrics.log_once("cpu_native", "vllm_ext: SFI's CPU slow-step kernels built (%s)", SOURCE.name)
            except Exception as exc:                          # noqa: BLE001 - any failure: the twins run
                _lib = None
                metrics.fallback("cpu_native", "SFI's compiled CPU kernels are unavailable (%s); the "
                                 "PyTorch twins run the slow steps (several times slower)", exc)
            _tried = True
    return _lib


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def evidence(query: torch.Tensor, pages, table: torch.Tensor, seq: int, lo: int, hi: int, lim: int,
             scale: float, alpha: float, ev: torch.Tensor, kn: torch.Tensor | None,
             out: torch.Tensor | None = None) -> bool:
    """One request's evidence ``ev [Hkv, >= lim]`` and key norms ``kn`` (or None) over its positions
    ``[0, seq)`` (``lim = min(seq, max_len)`` written; ``-inf`` outside ``[lo, hi)``), and with ``out``
    (``[Hq, D]``, any float dtype) its dense attention over them from the same scores: what
    :func:`vllm_ext.kernels.dense_decode_evidence.dense_decode_with_evidence_cpu` writes. ``query
    [Hq, D]``; ``pages``: :class:`vllm_ext.kernels.packed_pages.PackedPages` (the vec packing, K
    transposed per page, or the amx one, which the C++ unpacks a page at a time); ``table``: the
    request's block-table row. False (nothing written) where the kernel does not apply: no library,
    a KV dtype other than bf16 / fp32, another page layout, rows that are not fp32 and unit-stride."""
    lib = library()
    if lib is None:
        metrics.bump("fallback.cpu_native")
        return False
    layout = _page_layout(pages)
    if layout is None:
        return False
    k_ptr, v_ptr, s_block, s_head, amx = layout
    nb_all, hkv, bs, d = pages.k.shape
    hq = query.shape[0]
    fn = {torch.bfloat16: lib.sfi_evidence_bf16, torch.float32: lib.sfi_evidence_f32}.get(pages.k.dtype)
    if (fn is None or hq % hkv
            or ev.dtype != torch.float32 or ev.stride(-1) != 1 or not 0 < lim <= seq
            or (kn is not None and (kn.dtype != torch.float32 or kn.stride(-1) != 1))
            or (out is not None and tuple(out.shape) != (hq, d))):
        return False
    g = hq // hkv
    n_blocks = -(-seq // bs)
    blocks = table[:n_blocks].to(torch.int32).contiguous()
    if blocks.numel() < n_blocks or int(blocks.min()) < 0 or int(blocks.max()) >= nb_all:
        return False
    q = query.float().contiguous()
    from vllm_ext.kernels.paged_reference import _scratch_buffer

    extra = 0 if out is None else g * seq + g * d
    scratch = _scratch_buffer(g * seq + (g + 2) * bs + extra, torch.float32, query.device, tag="cpu_native_ev")
    attn = None if out is None else _scratch_buffer(hq * d, torch.float32, query.device, tag="cpu_native_out")
    fn(k_ptr, s_block, s_head, bs, d, hkv, g, blocks.data_ptr(), seq,
       lo, hi, lim, q.data_ptr(), scale, alpha, ev.data_ptr(), ev.stride(0), _p(kn),
       0 if kn is None else kn.stride(0), scratch.data_ptr(), None if out is None else v_ptr,
       _p(attn), amx)
    if out is not None:
        out.copy_(attn.view(hq, d))
    return True


def _page_layout(pages) -> tuple[int, int, int, int, int] | None:
    """``(K base, V base, block stride, head stride, amx)`` of pages the C++ reads, else None."""
    k, v = pages.k, pages.v
    if isinstance(k, PageView) and isinstance(v, PageView):
        ks, vs = k.t6.stride(), v.t6.stride()
        bs, d = k.shape[2], k.shape[3]
        amx_k = (k.tok, k.elem) == (16, 2) and ks[2:] == (16 * d, 2, 32, 1)
        amx_v = (v.tok, v.elem) == (2, 16) and vs[2:] == (32, 1, 16 * bs, 2)
        if not (amx_k and amx_v and ks[:2] == vs[:2]):
            return None
        return k.t6.data_ptr(), v.t6.data_ptr(), ks[0], ks[1], 1
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    bs, d = k.shape[2], k.shape[3]
    if (k.stride(2) != 1 or k.stride(3) != bs or v.stride(3) != 1 or v.stride(2) != d
            or v.stride()[:2] != k.stride()[:2]):
        return None
    return k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), 0


_CFG_FIELDS = ("alpha", "gamma_k", "pos_power", "pos_eta", "pos_beta", "w_k", "w_pos", "lambda_max", "mu",
               "cross_head_temperature", "lam_x", "eps")


def select_row(ev: torch.Tensor, kn: torch.Tensor, lo: int, hi: int, cfg, n_sel: int,
               exclude: torch.Tensor | None, sel: torch.Tensor) -> bool:
    """One request's selection (:func:`vllm_ext.kernels.sfi_selector_cpu.select_rows`, one row):
    ``ev``, ``kn`` ``[H, >= hi]`` fp32 rows, ``0 <= lo < hi``, ``n_sel <= hi - lo`` positions per
    head into ``sel [H, >= n_sel]`` (int32, ascending); ``exclude [H, E]`` absolute positions (any
    value) or None. False (nothing written) where the kernel does not apply."""
    lib = library()
    if lib is None:
        metrics.bump("fallback.cpu_native")
        return False
    heads = ev.shape[0]
    if (ev.dtype != torch.float32 or kn.dtype != torch.float32 or ev.stride(-1) != 1 or kn.stride(-1) != 1
            or sel.dtype != torch.int32 or sel.stride(-1) != 1 or not 0 <= lo < hi or n_sel <= 0
            or n_sel > hi - lo or kn.shape[0] != heads):
        return False
    if exclude is not None:
        exclude = exclude.to(torch.int64).contiguous()
    n = hi - lo
    from vllm_ext.kernels.paged_reference import _scratch_buffer

    scratch = _scratch_buffer(2 * heads * n + 2 * n, torch.float32, ev.device, tag="cpu_native_sel")
    consts = (ctypes.c_float * len(_CFG_FIELDS))(*(float(getattr(cfg, f)) for f in _CFG_FIELDS))
    lib.sfi_select_row(ev.data_ptr(), ev.stride(0), kn.data_ptr(), kn.stride(0), heads, lo, hi,
                       ctypes.cast(consts, ctypes.c_void_p), int(cfg.nms_radius), int(cfg.select_span),
                       int(cfg.select_span_back), n_sel, _p(exclude),
                       0 if exclude is None else exclude.shape[-1], sel.data_ptr(), sel.stride(0),
                       scratch.data_ptr())
    return True
