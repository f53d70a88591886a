"""Which of our Triton kernels a piece of code launches, and under which compile key.

An instrument for tests and benchmarks (off unless a :func:`record` block is open): every Triton
kernel of ``vllm_ext.kernels`` gets a pre-run hook that, while recording, appends one
:class:`Launch` per launch. Its ``key`` is what Triton compiles a kernel for: the constexpr values,
each other argument's specialisation as Triton 3.6 computes it (dtype, pointer alignment to 16,
integers equal to 1 or divisible by 16, honouring ``do_not_specialize``), and the launch options
(``num_warps``...). Two launches with equal keys share one compiled kernel; a launch whose key the
engine's warm-up never produced compiles on the hot path (``vllm_ext.backend.kernel_warmup``).

Under ``TRITON_INTERPRET=1`` the hooks see exactly the launches the CUDA build makes (the same
launchers run); the compile key is computed the same way. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from vllm_ext.kernels.triton_utils import HAS_TRITON

# every module of vllm_ext.kernels that defines Triton kernels
KERNEL_MODULES = (
    "block_representatives", "block_sparse_prefill", "copy_match", "dense_decode_evidence", "gather_compact",
    "merge_state", "paged_state", "prefill_evidence", "program_rows", "quest_pages", "quest_rerank", "sfi_plan",
    "sfi_selector_kernels", "speed_attention", "two_segment_decode",
)


@dataclass(frozen=True)
class Launch:
    kernel: str                    # "module.kernel_name"
    key: tuple                     # the compile key (see the module docstring)


_lock = threading.Lock()
_active: list[list[Launch]] = []
_installed = False


def _jit_functions(obj) -> Iterator[Any]:
    """The launchable Triton function(s) behind a module attribute (autotuner unwrapped)."""
    seen = 0
    while obj is not None and seen < 4:
        if hasattr(obj, "add_pre_run_hook") and hasattr(obj, "fn"):
            yield obj
            return
        obj = getattr(obj, "fn", None)
        seen += 1


def our_kernels() -> dict[str, Any]:
    """``"module.name" -> launchable Triton function`` for every kernel of the package."""
    out: dict[str, Any] = {}
    if not HAS_TRITON:
        return out
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(f"vllm_ext.kernels.{mod_name}")
        for attr, value in vars(mod).items():
            for fn in _jit_functions(value):
                out[f"{mod_name}.{attr}"] = fn
    return out


def _param_flags(fn) -> tuple[list[str], set[str], set[str], set[str]]:
    """Names, constexpr names, do_not_specialize and do_not_specialize_on_alignment names."""
    params = getattr(fn, "params", None)
    if params is not None:                                   # JITFunction (compiled)
        names = [p.name for p in params]
        const = {p.name for p in params if p.is_constexpr}
        dns = {p.name for p in params if p.do_not_specialize}
        dnsa = {p.name for p in params if p.do_not_specialize_on_alignment}
        return names, const, dns, dnsa
    sig = inspect.signature(fn.fn)                            # InterpretedFunction
    names = list(sig.parameters)
    const = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
    kw = getattr(fn, "kwargs", {}) or {}

    def named(key):
        return {names[i] if isinstance(i, int) else i for i in (kw.get(key) or [])}

    return names, const, named("do_not_specialize"), named("do_not_specialize_on_alignment")


def _specialisation(value, *, specialize: bool, align: bool):
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    if hasattr(value, "data_ptr") and not hasattr(value, "dtype"):
        return ("ptr", bool(value.data_ptr() % 16 == 0) if align else None)
    return native_specialize_impl(BaseBackend, value, False, specialize, align)


def compile_key(fn, args: tuple, kwargs: dict) -> tuple:
    names, const, dns, dnsa = _param_flags(fn)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    parts = []
    for name in names:
        if name not in bound:
            continue                                          # a defaulted constexpr
        value = bound[name]
        if name in const:
            parts.append((name, "constexpr", value))
        else:
            parts.append((name,) + tuple(_specialisation(value, specialize=name not in dns,
                                                         align=name not in dnsa)))
    options = tuple(sorted((k, v) for k, v in kwargs.items()
                           if k not in names and k not in ("debug", "instrumentation_mode")
                           and isinstance(v, (int, float, str, bool, type(None)))))
    return tuple(parts) + (("options",) + options,)


def _hook_for(name: str, fn):
    def hook(*args, **kwargs):
        if not _active:
            return
        launch = Launch(name, compile_key(fn, args, kwargs))
        with _lock:
            for log in _active:
                log.append(launch)
    return hook


def install() -> dict[str, Any]:
    """Add the recording hook to every kernel (idempotent); returns the kernels."""
    global _installed
    kernels = our_kernels()
    with _lock:
        if not _installed:
            for name, fn in kernels.items():
                fn.add_pre_run_hook(_hook_for(name, fn))
            _installed = True
    return kernels


def _interpreted(kernels: dict[str, Any]) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(fn, InterpretedFunction) for fn in kernels.values())


@contextlib.contextmanager
def _programs_skipped() -> Iterator[None]:
    """Under the interpreter: every launch runs its pre-run hooks (so it is recorded, with the key
    computed from the same host arguments) and none of its programs."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    run_programs = executor.__call__

    def hooks_only(self, *args_dev, **kwargs):
        names = inspect.getfullargspec(self.fn).args
        args_hst, kwargs_hst = self._init_args_hst(args_dev, {k: v for k, v in kwargs.items() if k in names})
        for hook in self.pre_run_hooks:
            hook(*args_hst, **kwargs_hst)

    executor.__call__ = hooks_only
    try:
        yield
    finally:
        executor.__call__ = run_programs


@contextlib.contextmanager
def record(run_programs: bool = True) -> Iterator[list[Launch]]:
    """Collect the launches of our kernels made inside the block (nested blocks each see theirs).

    ``run_programs=False`` (under ``TRITON_INTERPRET=1`` only; a compiled build always runs them, they
    are fast) records every launch and runs none of its programs, so the kernels' outputs stay unwritten.
    It is exact for code whose launches the host decides alone, reading no kernel's result: a step
    with fixed launches, as the forward makes them. It turns minutes of interpreted programs into
    seconds."""
    kernels = install()
    log: list[Launch] = []
    skip = contextlib.nullcontext()
    if not run_programs and _interpreted(kernels):
        skip = _programs_skipped()
    with _lock:
        _active.append(log)
    try:
        with skip:
            yield log
    finally:
        with _lock:
            _active.remove(log)


def keys(log: list[Launch]) -> set[tuple[str, tuple]]:
    return {(launch.kernel, launch.key) for launch in log}


def describe_missing(needed: set, have: set) -> str:
    """Readable lines for launches in ``needed`` whose compile key ``have`` lacks, with the
    arguments that differ from the nearest key of the same kernel."""
    lines = []
    for kernel, key in sorted(needed - have, key=lambda x: x[0]):
        same = [k for n, k in have if n == kernel]
        if not same:
            lines.append(f"{kernel}: never launched by the warm-up")
            continue
        best = min(same, key=lambda k: sum(a != b for a, b in zip(k, key)))
        diff = [f"{a[0]}={a[1:]} (warm-up: {b[1:]})" for a, b in zip(key, best) if a != b]
        lines.append(f"{kernel}: " + ", ".join(diff))
    return "\n".join(lines)
