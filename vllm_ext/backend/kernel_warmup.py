"""Compile the backend's Triton kernels while the engine starts, not during the first requests.

Triton compiles a kernel once per compile key (constexprs, dtypes, pointer alignment, integers equal
to 1 or divisible by 16: ``vllm_ext.kernels.launch_log``). vLLM's own start-up reaches some of ours:
CUDA-graph capture runs a pure-decode step for each capture size. It never reaches a step with
prefills (its profile run has no attention metadata), a prefill end (SFI's first selection), the
decode rows of a mixed step, or anything under ``--enforce-eager``. On the H200 those compiled
during the first requests (~16 s; vLLM's JIT monitor warned).

Each layer's share of each method (``MethodLayer.warm_up``) runs its launchers (the same functions the forward calls) over
synthetic steps chosen to reach every compile key a real step can: batches of 1, 2 and 16 decode
rows (the three integer classes) with dense, slow and fast rows, as a pure-decode step and as the
decode rows of a mixed step, one batch whose slow list spans four maintenance chunks (chunk ``c``'s
entries start ``c x B`` int32 past the list's start: the pointer alignments repeat every four chunks,
:func:`chunked_batch`), and prefill ends of one and of two prompts whose lengths fall in both
classes. It reads
the layer's real KV cache (never writes it) and its real persistent buffers, so strides and
alignments are the engine's; the per-request buffers it scribbles on are cleared afterwards. A
paged layer (inside vLLM: its compact segment, kept positions and prompt-tail queries in the compact
group's pages) is bound to its compact pages through a table as wide as the runner's, then unbound.
``tests/kernels/test_kernel_warmup.py`` checks under the interpreter that a grid of real steps launches no
compile key the warm-up did not.

vLLM runs it through its JIT warm-up registry (``JitWarmupRegistry``, before CUDA-graph capture):
the impl registers :class:`SpeedSfiWarmup` while the model is built. SPEED's upper layers run their
attention kernel; the Quest selector its page-bound and re-ranking kernels. The copy trigger's two
per-step kernels (``sfi.copy_ngram``, on by default: :func:`warm_up_copy_trigger`) run once per
engine, over the real token-history pages. Not covered yet (they compile at first use, logged at
start-up): CritiPrefill's prefill kernels.
"""

from __future__ import annotations

import logging

import torch

from vllm_ext.methods.warmup import WarmupShape

logger = logging.getLogger("vllm_ext")


def warm_up_engine(vllm_config) -> int:
    """Warm up one layer of each distinct geometry among this process's SPEEDSFI layers, and each
    method's engine-level kernels; returns how many layers ran."""
    from vllm_ext.backend.startup import engine_of
    from vllm_ext.config import BACKEND_NAME

    sched = vllm_config.scheduler_config
    block_size = vllm_config.cache_config.block_size
    max_len = vllm_config.model_config.max_model_len
    shape = WarmupShape(max_rows=sched.max_num_seqs, block_table_width=-(-max_len // block_size))
    dtype = vllm_config.model_config.dtype
    seen, ran = set(), 0
    for layer in vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        kv = getattr(layer, "kv_cache", None)
        backend = getattr(layer, "attn_backend", None)
        ours = backend is not None and backend.get_name() == BACKEND_NAME
        if not ours or impl is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            continue
        geom = (impl.num_heads, impl.num_kv_heads, impl.head_size, kv.dtype, tuple(kv.stride()),
                impl.warmup_key())
        if geom in seen:
            continue
        seen.add(geom)
        ran += impl.warm_up(kv, shape, dtype)
    methods = engine_of(vllm_config).methods()
    for m in methods:
        m.warm_up(shape)
    missing = [gap for m in methods for gap in m.warmup_gaps()]
    if missing:
        logger.info("vllm_ext: the start-up warm-up does not reach %s yet: they compile at first use",
                    ", ".join(missing))
    return ran


def register_with_vllm(vllm_config) -> None:
    """Register the warm-up with vLLM's JIT warm-up registry (active while the model is built; vLLM
    runs it after the KV cache exists, before CUDA-graph capture). Once per engine."""
    try:
        from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry, VllmJitKernel
    except ImportError:                                   # pragma: no cover - vLLM without the registry
        return
    from vllm_ext.backend.startup import engine_of

    engine = engine_of(vllm_config)
    entry = engine.warmup_entry
    if entry is None:
        class SpeedSfiWarmup(VllmJitKernel):
            """The backend's kernels as one entry of vLLM's registry (one key per engine)."""

            def __init__(self, config):
                super().__init__()
                self.config = config

            def get_warmup_keys(self, *args, **kwargs):
                return ["speedsfi"]

            def compile(self, compile_key):
                import time

                t0 = time.perf_counter()
                n = warm_up_engine(self.config)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()               # the log's time is the kernels' too
                logger.info("vllm_ext: SPEEDSFI kernel warm-up: %d layer geometr%s in %.1f s", n,
                            "y" if n == 1 else "ies", time.perf_counter() - t0)

        entry = engine.warmup_entry = SpeedSfiWarmup(vllm_config)
    JitWarmupRegistry.register(entry)
