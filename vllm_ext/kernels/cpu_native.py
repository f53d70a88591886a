"""SFI's decode work on the CPU build as compiled torch operators (``csrc/cpu/``): the slow step's
dense pass with evidence over ``CPU_ATTN``'s packed pages (the row's attention output, the evidence
and the key norms from one set of scores) and the closed-form selector, every slow row of a layer in one call
(``sfi_cpu.cpp``), the gather of the selection into the compact segment (``gather_compact_cpu.cpp``)
and the fast step over every fast row of a layer at once (``two_segment_cpu.cpp``).

Why: on the real model at 8K a slow step's PyTorch twins (about 150 small ops per layer: the fp32
gather of K, two matmuls, the log-sum-exps, the selector's refinements) cost about 4x a dense step,
and sparse decode lost to dense on the mean. The C++ reads bf16 K and V once, keeps the scores in
cache and fuses the selector's passes.

The operators (``torch.ops.speedsfi``; each has a fake implementation registered here, so that
``torch.compile`` traces past it):

- ``sfi_evidence(Tensor(a!) evidence, Tensor(b!)? key_norms, Tensor(c!)? out, Tensor query,
  Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_lens, Tensor lo, Tensor hi, Tensor rows,
  float scale, float alpha, bool amx, float k_scale=1., float v_scale=1.) -> ()``
- ``sfi_select_rows(Tensor(a!) sel, Tensor evidence, Tensor key_norms, Tensor lo, Tensor hi, Tensor n_sel,
  float[] cfg, int nms_radius, int span, int span_back, Tensor? exclude) -> ()``
- ``two_segment_decode(Tensor(a!) out, Tensor query, Tensor k_pages, Tensor v_pages, Tensor block_table,
  Tensor seq_lens, Tensor recent_start, Tensor compact_kv, Tensor compact_table, int cap,
  Tensor compact_len, Tensor slot_idx, Tensor? row_mask, int window, float scale, bool amx,
  float k_scale=1., float v_scale=1.) -> ()``
- ``gather_compact(Tensor(a!) compact_kv, Tensor compact_table, int cap, Tensor(b!) compact_len,
  Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor slot_idx, Tensor selected, Tensor n_sel,
  Tensor? seq_lens, Tensor? offset, Tensor? row_mask, int n_sink, bool amx) -> ()``
- ``block_sparse_prefill(Tensor(a!) out, Tensor query, Tensor k_pages, Tensor v_pages, Tensor block_table,
  Tensor query_start_loc, Tensor seq_lens, Tensor sel_blocks, Tensor num_sel, Tensor dense, int segment_size,
  int block_size, float scale, bool amx, float k_scale=1., float v_scale=1.) -> ()`` (CritiPrefill's prefill,
  ``block_sparse_prefill_cpu.cpp``)
- ``copy_rows(Tensor(a!) dst, Tensor dst_rows, Tensor src, Tensor src_rows, int row_bytes) -> ()`` (rows of
  bytes at given indices: the page-list copies into scratch pages, ``copy_rows_cpu.cpp``)

Built once per machine, at the first :func:`library` call of a process (the CPU impl makes it at
engine start): ``g++ -O3 -march=native`` against torch's headers (one compiler per source, side by
side, then one link) into a shared object under
``$SPEEDSFI_CPU_KERNEL_CACHE`` (default ``~/.cache/vllm_speedsfi/cpu_kernels``), named by a hash of
the sources, the flags (``$SPEEDSFI_CPU_KERNEL_FLAGS`` adds some), the compiler, the torch build and
this CPU's feature flags; a second process
building at once waits on a lock file and then loads the first one's library (the library itself is
written to a temporary and renamed into place, so no reader ever sees a partial one); loaded with
``torch.ops.load_library``. The source is found in the repository (``<repo>/csrc``): a checkout or
its editable install (``pip install -e .``, as ``scripts/setup_env.sh`` installs). No compiler, no
source, a failed build or ``SPEEDSFI_CPU_NATIVE=0``: :func:`library` is None,
:func:`unavailable_reason` says why, and the PyTorch twins run instead; the engine's start-up logs
and counts that (``fallback.cpu_native``, ``vllm_ext.backend.dense_path``). Torch only; no vLLM
import.

Callers give contiguous fp32 rows; the wrappers check what the C++ assumes (dtypes, strides,
ranges) and return False where it does not hold, so the twin runs (the operators check the same and
raise).

Every pass reads bf16, fp32 and fp8 pages (``--kv-cache-dtype fp8``: e4m3, e5m2, CPU_ATTN's packings
a byte an element) with the layer's per-tensor scales (:func:`reads_pages`); the gather copies fp16
too, and fp8 entries as their stored bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from vllm_ext.kernels.packed_pages import PageView

ENV = "SPEEDSFI_CPU_NATIVE"
CACHE_ENV = "SPEEDSFI_CPU_KERNEL_CACHE"
# compiler flags after FLAGS (a later flag wins: ``-mno-avx512vbmi`` builds the fp8 widening's fp16 route
# on a CPU that has the byte permutes, for its tests); part of the library's cache key
FLAGS_ENV = "SPEEDSFI_CPU_KERNEL_FLAGS"
# <repository>/csrc/cpu/ (vllm_ext/kernels/ is two levels below the repository's root): the sources
# compiled into the one library, and the header they share
CSRC = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
SOURCE = CSRC / "sfi_cpu.cpp"
SOURCES = (SOURCE, CSRC / "two_segment_cpu.cpp", CSRC / "gather_compact_cpu.cpp",
           CSRC / "block_sparse_prefill_cpu.cpp", CSRC / "copy_rows_cpu.cpp")
HEADERS = (CSRC / "cpu_vec.h", CSRC / "page_views.h", CSRC / "gather_rows.h")
# -O3 -march=native and the math flags the kernels' results are checked with; torch's headers need C++20
# -fopenmp: ATen's at::parallel_for is inlined from its headers as an OpenMP region (torch's CPU builds
# use the OpenMP backend); without it every pass runs on the calling thread alone. The process's
# OpenMP runtime is torch's (libgomp.so.1, already loaded).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++20", "-fPIC", "-fopenmp")
NAMESPACE = "speedsfi"
OPS = ("sfi_evidence", "sfi_select_rows", "sfi_slow_rows", "two_segment_decode", "gather_compact",
       "block_sparse_prefill")

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_lib = None                     # torch.ops.speedsfi once loaded
_tried = False
_reason: str | None = None
_fakes_registered = False
# the last build or cache look-up of this process: {"path", "built" (compiled here), "seconds"}
_build_info: dict = {}


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


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vllm_speedsfi" / "cpu_kernels")


def _flags() -> list[str]:
    import shlex

    return [*FLAGS, *shlex.split(os.environ.get(FLAGS_ENV, ""))]


def _torch_build() -> str:
    return f"{torch.__version__} {torch.version.git_version} abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _compile_args(source: Path, obj: str) -> list[str]:
    from torch.utils import cpp_extension

    return [*_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(a for p in cpp_extension.include_paths() for a in ("-isystem", p)), "-c", str(source), "-o", obj]


def _link_args(objs: list[str], target: str) -> list[str]:
    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    return ["-shared", *objs, "-o", target, *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs),
            "-lc10", "-ltorch_cpu", "-fopenmp"]


def _compile(cxx: str, tmp: str) -> None:
    """The sources compiled side by side (one compiler per source: torch's headers make each take
    tens of seconds), then linked into ``tmp``."""
    objs = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
    try:
        procs = [subprocess.Popen([cxx, *_compile_args(src, obj)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for src, obj in zip(SOURCES, objs)]
        errors = []
        for src, proc in zip(SOURCES, procs):
            _, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                errors.append(f"{cxx} failed ({proc.returncode}) on {src.name}: {err.strip()[-2000:]}")
        if errors:
            raise RuntimeError("; ".join(errors))
        res = subprocess.run([cxx, *_link_args(objs, tmp)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({res.returncode}) linking: {res.stderr.strip()[-2000:]}")
    finally:
        for obj in objs:
            if os.path.exists(obj):
                os.unlink(obj)


def _build() -> Path:
    """The library's path in the cache, compiled first when it is not there."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    missing = [str(p) for p in (*SOURCES, *HEADERS) if not p.is_file()]
    if missing:
        raise RuntimeError(f"the kernels' sources {', '.join(missing)} are not there (the package is not "
                           "installed from a checkout: install it with pip install -e)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([*(p.read_text() for p in (*SOURCES, *HEADERS)), " ".join(_flags()), version,
                                    _torch_build(),
                                    _cpu_flags()]).encode()).hexdigest()[:20]
    cache = _cache_dir()
    target = cache / f"sfi_cpu_{key}.so"
    t0 = time.perf_counter()
    built = False
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f"sfi_cpu_{key}.lock", "a") as lock:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)      # another process building it: wait, then reuse
            except (ImportError, OSError):
                pass                                  # no locks here: each builds its own, a rename wins
            if not target.exists():
                fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=cache)
                os.close(fd)
                try:
                    _compile(cxx, tmp)
                    os.replace(tmp, target)
                    built = True
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
    _build_info.clear()
    _build_info.update(path=str(target), built=built, seconds=time.perf_counter() - t0)
    return target


def _ops_loaded() -> bool:
    try:
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CPU") for op in OPS)
    except RuntimeError:                                      # "operator ... does not exist"
        return False


def _evidence_fake(evidence, key_norms, out, query, k_pages, v_pages, block_table, seq_lens, lo, hi, rows, scale,
                   alpha, amx, k_scale=1.0, v_scale=1.0) -> None:
    """Writes ``evidence``, ``key_norms`` and ``out`` in place; returns nothing."""
    return None


def _select_rows_fake(sel, evidence, key_norms, lo, hi, n_sel, cfg, nms_radius, span, span_back,
                      exclude) -> None:
    """Writes ``sel`` in place; returns nothing."""
    return None


def _two_segment_fake(out, query, k_pages, v_pages, block_table, seq_lens, recent_start, compact_kv,
                      compact_table, cap, compact_len, slot_idx, row_mask, window, scale, amx, k_scale=1.0,
                      v_scale=1.0) -> None:
    """Writes ``out`` in place; returns nothing."""
    return None


def _gather_compact_fake(compact_kv, compact_table, cap, compact_len, k_pages, v_pages, block_table, slot_idx,
                         selected, n_sel, seq_lens, offset, row_mask, n_sink, amx) -> None:
    """Writes ``compact_kv`` and ``compact_len`` in place; returns nothing."""
    return None


def _slow_rows_fake(out, compact_kv, compact_len, *args, **kwargs) -> None:
    """Writes ``out``, ``compact_kv`` and ``compact_len`` in place; returns nothing."""
    return None


def _register_fakes() -> None:
    global _fakes_registered
    if not _fakes_registered:
        torch.library.register_fake(f"{NAMESPACE}::sfi_evidence", _evidence_fake)
        torch.library.register_fake(f"{NAMESPACE}::sfi_select_rows", _select_rows_fake)
        torch.library.register_fake(f"{NAMESPACE}::sfi_slow_rows", _slow_rows_fake)
        torch.library.register_fake(f"{NAMESPACE}::two_segment_decode", _two_segment_fake)
        torch.library.register_fake(f"{NAMESPACE}::gather_compact", _gather_compact_fake)
        torch.library.register_fake(f"{NAMESPACE}::block_sparse_prefill", _block_sparse_prefill_fake)
        torch.library.register_fake(f"{NAMESPACE}::copy_rows", _copy_rows_fake)
        _fakes_registered = True


def _load():
    path = _build()
    # one library per process: a later build (another cache directory) finds the operators there
    if not _ops_loaded():
        torch.ops.load_library(str(path))
    _register_fakes()
    return getattr(torch.ops, NAMESPACE)


def library():
    """``torch.ops.speedsfi`` with the kernels, built (or found in the cache) and loaded at the first
    call of the process; None when they cannot be had (:func:`unavailable_reason` says why; the
    caller logs and counts the fallback)."""
    global _lib, _tried, _reason
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib, _reason = _load(), None
                logger.info("vllm_ext: SFI's CPU slow-step kernels %s (%s, %.1f s)",
                            "built" if _build_info.get("built") else "loaded", _build_info.get("path"),
                            _build_info.get("seconds", 0.0))
            except Exception as exc:                          # noqa: BLE001 - any failure: the twins run
                _lib, _reason = None, f"{type(exc).__name__}: {exc}"
            _tried = True
    return _lib


def unavailable_reason() -> str | None:
    """Why :func:`library` is None, as a sentence; None while it is not (or before its first call)."""
    if not enabled():
        return f"switched off by {ENV}={os.environ.get(ENV)}"
    return _reason if _tried and _lib is None else None


# page dtypes every compiled pass reads (the gather copies fp16 too)
PAGE_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def reads_pages(dtype: torch.dtype) -> bool:
    """Whether the compiled passes (:func:`evidence`, :func:`gather_compact`, :func:`two_segment`,
    :func:`block_sparse_prefill`) read pages of ``dtype``: bf16, fp32 and fp8 (e4m3, e5m2)."""
    return dtype in PAGE_DTYPES


def evidence(query: torch.Tensor, pages, block_table: torch.Tensor, seq_lens: torch.Tensor, lo: torch.Tensor,
             hi: torch.Tensor, rows: torch.Tensor, scale: float, alpha: float, ev: torch.Tensor,
             kn: torch.Tensor | None, out: torch.Tensor | None = None, *, k_scale: float = 1.0,
             v_scale: float = 1.0) -> bool:
    """The evidence ``ev [E, Hkv, L]`` and key norms ``kn`` (or None) of a step's slow rows in one
    call: entry ``e`` is row ``rows[e]`` of ``query [R, Hq, D]`` (one outside ``[0, R)`` or of
    length <= 0 is skipped) over its positions ``[0, seq_lens[r])``, ``lim = min(seq, L)`` written,
    ``-inf`` outside ``[max(lo[r], 0), min(hi[r], lim))``; with ``out`` (``[R, Hq, D]``, any float
    dtype) the entries' rows of its dense attention from the same scores: what
    :func:`vllm_ext.kernels.dense_decode_evidence.dense_decode_with_evidence_cpu` writes. ``pages``:
    :class:`vllm_ext.kernels.packed_pages.PackedPages` (the vec packing, K transposed per page, or the
    amx one, which the C++ unpacks a page at a time); ``block_table [R, W]``; fp8 pages: ``k_scale`` /
    ``v_scale``, the layer's per-tensor scales (host floats). False (nothing written) where the kernel
    does not apply: no library, a KV dtype other than bf16 / fp32 / fp8, another page layout, evidence
    rows that are not fp32 with unit stride."""
    ops = library()
    if ops is None:
        return False
    layout = _page_layout(pages)
    if layout is None:
        return False
    k_pages, v_pages, amx = layout
    hkv, d = pages.k.shape[1], pages.k.shape[3]
    if (not reads_pages(pages.k.dtype) or k_pages.device.type != "cpu" or query.dim() != 3
            or query.shape[1] == 0 or query.shape[1] % hkv or query.shape[2] != d
            or not _entries_ok(ev, rows.shape[0], hkv) or (kn is not None and not _entries_ok(kn, rows.shape[0], hkv))
            or (out is not None and out.shape != query.shape)):
        return False
    q = query.float().contiguous()
    attn = out
    if out is not None and not (out.dtype == torch.float32 and out.is_contiguous()):
        from vllm_ext.kernels.paged_reference import _scratch_buffer

        attn = _scratch_buffer(q.numel(), torch.float32, query.device, tag="cpu_native_out").view(q.shape)
    ops.sfi_evidence(ev, kn, attn, q, k_pages, v_pages, block_table.to(torch.int32), seq_lens.contiguous(),
                     lo.contiguous(), hi.contiguous(), rows.contiguous(), scale, alpha, amx, float(k_scale),
                     float(v_scale))
    if attn is not out:
        r = rows.long()
        r = r[(r >= 0) & (r < query.shape[0])]
        r = r[seq_lens.long()[r] > 0]
        out[r] = attn[r].to(out.dtype)
    return True


def _entries_ok(t: torch.Tensor, entries: int, heads: int) -> bool:
    """``t`` is ``[entries, heads, L]`` fp32 on the CPU with unit-stride rows."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3 and t.shape[0] == entries
            and t.shape[1] == heads and t.stride(-1) == 1)


def _page_layout(pages) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(K pages, V pages, amx)`` as the operator reads them (the 6-d VNNI views with amx), else
    None."""
    k, v = pages.k, pages.v
    if isinstance(k, PageView) and isinstance(v, PageView):
        ks, vs = k.t6.stride(), v.t6.stride()
        bs, d = k.shape[2], k.shape[3]
        amx_k = (k.tok, k.elem) == (16, 2) and ks[2:] == (16 * d, 2, 32, 1)
        amx_v = (v.tok, v.elem) == (2, 16) and vs[2:] == (32, 1, 16 * bs, 2)
        if not (amx_k and amx_v and ks[:2] == vs[:2]):
            return None
        return k.t6, v.t6, True
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    bs, d = k.shape[2], k.shape[3]
    if (k.stride(2) != 1 or k.stride(3) != bs or v.stride(3) != 1 or v.stride(2) != d
            or v.stride()[:2] != k.stride()[:2] or v.shape != k.shape or v.dtype != k.dtype):
        return None
    return k, v, False


_CFG_FIELDS = ("alpha", "gamma_k", "pos_power", "pos_eta", "pos_beta", "w_k", "w_pos", "lambda_max", "mu",
               "cross_head_temperature", "lam_x", "eps")


def select_rows(ev: torch.Tensor, kn: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_sel: torch.Tensor,
                cfg, exclude: torch.Tensor | None, sel: torch.Tensor) -> bool:
    """The selections of a step's slow rows in one call (:func:`vllm_ext.kernels.sfi_selector_cpu.select_rows`):
    ``ev``, ``kn`` ``[N, H, >= max hi]`` fp32 rows; per row ``lo``, ``hi``, ``n_sel`` (``[N]``; a row
    with ``n_sel <= 0`` is skipped, otherwise ``0 <= lo < hi`` and ``n_sel <= hi - lo``) positions per
    head into ``sel [N, H, >= max n_sel]`` (int32, ascending); ``exclude [N, H, E]`` absolute positions
    (any value) or None. False (nothing written) where the kernel does not apply."""
    ops = library()
    if ops is None:
        return False
    if ev.dim() != 3:
        return False
    n, heads = ev.shape[:2]
    if (not _entries_ok(ev, n, heads) or not _entries_ok(kn, n, heads) or sel.dtype != torch.int32
            or sel.dim() != 3 or sel.shape[:2] != (n, heads) or sel.stride(-1) != 1):
        return False
    if exclude is not None:
        exclude = exclude.to(torch.int64).contiguous()
        if exclude.dim() != 3 or exclude.shape[:2] != (n, heads) or exclude.device.type != "cpu":
            return False
    ops.sfi_select_rows(sel, ev, kn, lo.contiguous(), hi.contiguous(), n_sel.contiguous(),
                        selector_constants(cfg), int(cfg.nms_radius), int(cfg.select_span),
                        int(cfg.select_span_back), exclude)
    return True


_SELECTOR_CONSTANTS: dict = {}


def selector_constants(cfg) -> list[float]:
    """The selector's 12 constants in the kernels' order (:data:`_CFG_FIELDS`), built once per
    parameter set (the parameters are frozen)."""
    consts = _SELECTOR_CONSTANTS.get(cfg)
    if consts is None:
        consts = _SELECTOR_CONSTANTS[cfg] = [float(getattr(cfg, f)) for f in _CFG_FIELDS]
    return consts


def slow_rows(query: torch.Tensor, pages, block_table: torch.Tensor, seq_lens: torch.Tensor,
              allowed_lo: torch.Tensor, allowed_hi: torch.Tensor, entries, live: int, *, out: torch.Tensor | None,
              max_len: int, cfg, k_min: int, width: int, scale: float, alpha: float, n_sink: int,
              compact_kv: torch.Tensor, compact_table: torch.Tensor, compact_len: torch.Tensor,
              kept=None, k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """A layer's slow step in one call (``torch.ops.speedsfi.sfi_slow_rows``): for each of the first
    ``live`` entries of the slow list ``entries`` (the step plan: ``slow_rows``, ``slow_seq``,
    ``slow_lo``, ``slow_hi``, ``slow_k``, ``slow_sfi_slot``, ``slow_kept``), what :func:`evidence`
    (its row's evidence over ``[0, min(seq, max_len))`` and, with ``out``, its dense attention),
    :func:`select_rows` (``min(clamp(k, k_min, width), hi - lo)`` positions per KV head, the kept
    positions left out) and :func:`gather_compact` (sink and selection into its compact slot, after
    its kept entries) write one after the other, bit for bit. ``kept``: the layer's kept positions
    (:class:`vllm_ext.kernels.paged_rows.PagedRows` of int32 ``[Hkv, E]``, or a tensor ``[slots, Hkv,
    E]``) when ``sfi.keep_prefill`` is on, else None. False (nothing written) where the kernel does
    not apply: no library, pages not in ``CPU_ATTN``'s packings or of another dtype, a query or
    output other than bf16 / fp32 contiguous rows, kept positions in another form."""
    from vllm_ext.kernels.paged_rows import PagedRows

    from vllm_ext.kernels.packed_pages import PackedPages

    ops = library()
    if ops is None or not isinstance(pages, PackedPages):
        return False
    if live <= 0:
        return True
    layout = _page_layout(pages)
    if layout is None:
        return False
    k_pages, v_pages, amx = layout
    if (not reads_pages(k_pages.dtype) or k_pages.device.type != "cpu" or query.dim() != 3
            or query.dtype not in (torch.bfloat16, torch.float32) or compact_kv.dtype != k_pages.dtype
            or (out is not None and (out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous()
                                     or out.shape != query.shape))):
        return False
    kept_pages = kept_table = None
    kept_first = kept_width = 0
    if kept is not None:
        if isinstance(kept, PagedRows):
            if kept.dtype != torch.int32 or len(kept.row_shape) != 2:
                return False
            kept_pages, kept_table, kept_first, kept_width = kept.pages, kept.table, kept.first, kept.row_shape[1]
        else:
            if kept.dtype != torch.int32 or kept.dim() != 3:
                return False
            slots, heads, kept_width = kept.shape
            kept_pages = kept.contiguous().view(slots, 1, 1, heads * kept_width)
            kept_table = torch.arange(slots, dtype=torch.int32).view(slots, 1)
    if compact_table is None:                       # the contiguous layout: slot s is block s
        compact_table = torch.arange(compact_kv.shape[0], dtype=torch.int32).view(-1, 1)
    ops.sfi_slow_rows(out, compact_kv, compact_len, query.contiguous(), k_pages, v_pages, _rows_i32(block_table),
                      seq_lens, allowed_lo, allowed_hi, entries.slow_rows, entries.slow_seq, entries.slow_lo,
                      entries.slow_hi, entries.slow_k, entries.slow_sfi_slot,
                      entries.slow_kept if kept is not None else None, kept_pages, _rows_i32(kept_table),
                      int(kept_first), int(kept_width), _rows_i32(compact_table),
                      int(compact_kv.shape[2] * compact_table.shape[1]), int(live), int(max_len), int(k_min), int(width), float(scale), float(alpha),
                      selector_constants(cfg), int(cfg.nms_radius), int(cfg.select_span), int(cfg.select_span_back),
                      int(n_sink), amx, float(k_scale), float(v_scale))
    return True


def _two_segment_pages(pages) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``(K pages, V pages, amx)`` of the recent window as the operator reads them: ``CPU_ATTN``'s
    packings (:func:`_page_layout`) or the logical cache ``[blocks, Hkv, bs, 2D]`` (K and V as views
    of its rows)."""
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 4 or pages.stride(-1) != 1 or pages.shape[-1] % 2:
            return None
        d = pages.shape[-1] // 2
        return pages[..., :d], pages[..., d:], False
    return _page_layout(pages)


def _query_pass(query: torch.Tensor, out: torch.Tensor, pages):
    """``(ops, (K pages, V pages, amx))`` for a pass writing ``out`` from ``query [T, Hq, D]`` over
    ``pages``, or ``(ops, None)`` where it cannot run: no library, ``out`` not like ``query``, pages
    in no layout it reads."""
    ops = library()
    if ops is None or query.dim() != 3 or out.shape != query.shape or out.dtype != query.dtype:
        return ops, None
    return ops, _two_segment_pages(pages)




def two_segment(query: torch.Tensor, pages, block_table: torch.Tensor, seq_lens: torch.Tensor,
                recent_start: torch.Tensor, compact_kv: torch.Tensor, compact_table: torch.Tensor | None,
                cap: int, compact_len: torch.Tensor, slot_idx: torch.Tensor, scale: float, out: torch.Tensor,
                row_mask: torch.Tensor | None, window: int, *, k_scale: float = 1.0,
                v_scale: float = 1.0) -> bool:
    """Every active row's fast-step attention (compact segment + recent window, one softmax) into
    ``out [R, Hq, D]``: what :func:`vllm_ext.kernels.two_segment_decode.two_segment_decode_cpu`
    writes, in one pass over the rows and KV heads (torch's intra-op threads). ``pages``: the KV
    cache (the logical layout) or :class:`vllm_ext.kernels.packed_pages.PackedPages`;
    ``compact_table`` None: the contiguous layout ``[slots, Hkv, cap, 2D]``. False (nothing
    written) where the kernel does not apply: no library, a query other than bf16 / fp32, pages other
    than bf16 / fp32 / fp8 (e4m3, e5m2), another page layout. fp8 pages: ``k_scale`` / ``v_scale``,
    the layer's per-tensor scales (host floats)."""
    ops, layout = _query_pass(query, out, pages)
    if layout is None:
        return False
    k_pages, v_pages, amx = layout
    ok = (query.dtype in (torch.bfloat16, torch.float32) and reads_pages(k_pages.dtype)
          and compact_kv.dtype == k_pages.dtype and query.device.type == "cpu" and query.stride(-1) == 1
          and out.stride(-1) == 1 and compact_kv.stride(-1) == 1 and query.shape[-1] <= 256)
    if not ok:
        return False
    if compact_table is None:                  # one block of ``cap`` entries per slot, the slot's own
        compact_table = torch.arange(compact_kv.shape[0], dtype=torch.int32).view(-1, 1)
    i32 = (block_table, seq_lens, recent_start, compact_table, compact_len, slot_idx)
    block_table, seq_lens, recent_start, compact_table, compact_len, slot_idx = (
        t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous() for t in i32)
    if row_mask is not None and row_mask.dtype != torch.bool:
        row_mask = row_mask != 0
    ops.two_segment_decode(out, query, k_pages, v_pages, block_table, seq_lens.contiguous(),
                           recent_start.contiguous(), compact_kv, compact_table, int(cap), compact_len.contiguous(),
                           slot_idx.contiguous(), None if row_mask is None else row_mask.contiguous(), int(window),
                           float(scale), amx, float(k_scale), float(v_scale))
    return True


def _rows_i32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A table as int32 rows of unit stride (a column slice of a wider table as it is)."""
    if t is None or (t.dtype == torch.int32 and t.stride(-1) == 1):
        return t
    return t.to(torch.int32).contiguous()


def _int32(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def gather_compact(pages, block_table: torch.Tensor, slot_idx: torch.Tensor, selected: torch.Tensor,
                   n_sel: torch.Tensor, n_sink: int, compact_kv: torch.Tensor, compact_len: torch.Tensor,
                   compact_table: torch.Tensor | None, cap: int, row_mask: torch.Tensor | None,
                   seq_lens: torch.Tensor | None, offset: torch.Tensor | None) -> bool:
    """Each active row's sink and selected tokens copied from ``pages`` into its compact slot and
    its length set: what :func:`vllm_ext.kernels.gather_compact.gather_compact_cpu` writes (fp8
    entries as their stored bytes). False (nothing written) where the kernel does not apply: no
    library, another page layout, pages other than bf16 / fp16 / fp32 / fp8, a compact segment of
    another dtype than the pages."""
    ops = library()
    if ops is None:
        return False
    layout = _two_segment_pages(pages)
    if layout is None:
        return False
    k_pages, v_pages, amx = layout
    if (k_pages.dtype not in (*PAGE_DTYPES, torch.float16) or compact_kv.dtype != k_pages.dtype
            or compact_kv.stride(-1) != 1 or k_pages.device.type != "cpu" or selected.dim() != 3):
        return False
    if compact_table is None:
        compact_table = torch.arange(compact_kv.shape[0], dtype=torch.int32).view(-1, 1)
    if row_mask is not None:
        row_mask = (row_mask if row_mask.dtype == torch.bool else row_mask != 0).contiguous()
    sel = selected if selected.dtype == torch.int32 and selected.stride(-1) == 1 else selected.to(torch.int32)
    ops.gather_compact(compact_kv, _int32(compact_table), int(cap), compact_len, k_pages, v_pages,
                       _int32(block_table), _int32(slot_idx), sel, _int32(n_sel), _int32(seq_lens), _int32(offset),
                       row_mask, int(n_sink), amx)
    return True


# ------------------------------------------------------------ CritiPrefill's block-sparse prefill
def _copy_rows_fake(dst, dst_rows, src, src_rows, row_bytes):
    return None


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor,
              row_bytes: int) -> bool:
    """``dst`` row ``dst_rows[i]`` = ``src`` row ``src_rows[i]`` (contiguous CPU tensors seen as rows of
    ``row_bytes`` bytes; int64 indices). False (nothing written) without the library."""
    ops = library()
    if ops is None or not (dst.is_contiguous() and src.is_contiguous()) or dst.device.type != "cpu":
        return False
    ops.copy_rows(dst, dst_rows.contiguous(), src, src_rows.contiguous(), int(row_bytes))
    return True


def _block_sparse_prefill_fake(out, query, k_pages, v_pages, block_table, query_start_loc, seq_lens, sel_blocks,
                               num_sel, dense, segment_size, block_size, scale, amx, k_scale=1.0,
                               v_scale=1.0) -> None:
    """Writes ``out`` in place; returns nothing."""
    return None


def block_sparse_prefill(query: torch.Tensor, pages, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, plan, scale: float, out: torch.Tensor, *, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> bool:
    """CritiPrefill's block-sparse prefill of every row and segment of a chunk batch at once
    (``block_sparse_prefill_cpu.cpp``): what :func:`vllm_ext.kernels.block_sparse_prefill.block_sparse_prefill_torch`
    writes, the pages read in place. ``pages``: the KV cache (the logical layout) or
    :class:`vllm_ext.kernels.packed_pages.PackedPages`; ``plan``: a ``CritiPrefillPlan`` (CPU tensors),
    dense segments included (the pass beats ``CPU_ATTN``'s own prefill on them: docs/critiprefill.md). False
    (nothing written) where the kernel does not apply: no library, a query other than bf16 / fp32, pages
    other than bf16 / fp32 / fp8 (e4m3, e5m2), head sizes over 256, another page layout. fp8 pages:
    ``k_scale`` / ``v_scale``, the layer's per-tensor scales (host floats)."""
    ops, layout = _query_pass(query, out, pages)
    if layout is None:
        return False
    k_pages, v_pages, amx = layout
    if (query.dtype not in (torch.bfloat16, torch.float32) or not reads_pages(k_pages.dtype)
            or query.device.type != "cpu" or query.stride(-1) != 1 or out.stride(-1) != 1
            or query.shape[-1] > 256):
        return False
    dense = plan.dense if plan.dense.dtype == torch.bool else plan.dense != 0
    sel = plan.sel_blocks if plan.sel_blocks.stride(-1) == 1 else plan.sel_blocks.contiguous()
    ops.block_sparse_prefill(out, query, k_pages, v_pages, _int32(block_table), _int32(query_start_loc),
                             _int32(seq_lens), _int32(sel), _int32(plan.num_sel), dense, int(plan.segment_size),
                             int(plan.block_size), float(scale), amx, float(k_scale), float(v_scale))
    return True
