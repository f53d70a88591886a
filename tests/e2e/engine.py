"""Helpers to run real vLLM engines (the CPU build) in tests."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager

PROMPT_LENGTHS = (5, 37, 300, 17, 129)


def random_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


@contextmanager
def engine(model: str, backend: str, *, multiprocessing: bool = False, triton_kernels: bool = False,
           **kwargs):
    """An ``LLM`` on the CPU build with test-sized settings; torn down on exit.

    ``triton_kernels``: run SPEEDSFI's Triton kernels (interpreted on CPU) instead of their PyTorch
    twins; the twins are the default because the interpreter is slow."""
    release_shared()                  # one in-process engine at a time (see shared_engine)
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                            "SPEEDSFI_FORCE_TORCH_KERNELS")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    os.environ["SPEEDSFI_FORCE_TORCH_KERNELS"] = "0" if triton_kernels else "1"
    try:
        with _engine(model, backend, **kwargs) as llm:
            yield llm
    finally:
        # later tests (the kernel tests above all) must not inherit the engine's settings
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _engine(model: str, backend: str, **kwargs):
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    settings = dict(dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=8,
                    kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=128, block_size=32,
                    attention_backend=backend)
    settings.update(kwargs)
    llm = LLM(model=model, **settings)
    try:
        yield llm
    finally:
        # Shut down explicitly: a shutdown left to garbage collection could run while the next
        # engine of the process is up and tear down its distributed state.
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()


_SHARED: list = []            # [(key, context manager, llm)]: at most one


def shared_engine(model: str, backend: str, **kwargs):
    """``engine(model, backend, **kwargs)`` left open for the next caller with the same arguments, so
    that tests of a module that need the same engine share its start-up (about 3 s on the CPU build).

    One in-process engine at a time: ``engine()``, or a shared engine of other arguments, closes it
    first; ``tests/e2e/conftest.py`` closes it at the end of each module. It is not fresh: a caller
    that reads cumulative state (``table.sfi.stats``, the metrics providers, the prefix cache,
    ``table.recorder``) takes differences or resets it (``llm.reset_prefix_cache()``)."""
    import json

    key = json.dumps([model, backend, kwargs], sort_keys=True, default=repr)
    if _SHARED and _SHARED[0][0] == key:
        return _SHARED[0][2]
    release_shared()
    cm = engine(model, backend, **kwargs)
    llm = cm.__enter__()
    _SHARED.append((key, cm, llm))
    return llm


def release_shared() -> None:
    """Close the shared engine, if one is open."""
    if _SHARED:
        _, cm, _ = _SHARED.pop()
        cm.__exit__(None, None, None)


def greedy(llm, prompts: list[list[int]], max_tokens: int = 64, **params) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def model_runner(llm):
    """The in-process V1 model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0 only)."""
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)
    return worker.model_runner


def run_recorded(model: str, sfi=None, prompts=None, max_tokens: int = 40, params=None, *,
                 shared: bool = False, **kwargs):
    """One SPEEDSFI engine (``sfi``: the ``speedsfi.sfi`` section, None = every method off) on
    ``prompts``: (greedy tokens, or those of ``params``; SFI counters; per-step host snapshots).

    ``shared``: on the shared engine of these arguments (``shared_engine``), its prefix cache emptied
    first; the SFI counters are then this run's (the difference over the run)."""
    extra = {"speedsfi": {"sfi": sfi}} if sfi is not None else {}
    if shared:
        llm = shared_engine(model, "SPEEDSFI", additional_config=extra, **kwargs)
        assert llm.reset_prefix_cache()
        return _recorded(llm, prompts, max_tokens, params, difference=True)
    with engine(model, "SPEEDSFI", additional_config=extra, **kwargs) as llm:
        return _recorded(llm, prompts, max_tokens, params)


def _recorded(llm, prompts, max_tokens, params, difference=False):
    from vllm_ext.runner_hooks import table_of

    table = table_of(model_runner(llm))
    table.recorder = []
    before = table.sfi.stats.tolist() if difference and table.sfi is not None else None
    if params is None:
        tokens = greedy(llm, prompts, max_tokens=max_tokens)
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = table.sfi.stats.tolist() if table.sfi is not None else None
    if before is not None:
        stats = [a - b for a, b in zip(stats, before)]
    records = table.recorder
    table.recorder = None
    return tokens, stats, records


def leftover_after_probe(llm, table, kv_manager, free_blocks_before: int) -> dict[str, int]:
    """What the requests of a finished run still hold: request slots, SFI and CritiPrefill slots,
    KV blocks. The worker hears of the last finished requests with the next step's scheduler
    output, so a probe (SFI off, too short for CritiPrefill) runs first; it holds one request slot
    until the step after it."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [7, 8, 9]}],
                 SamplingParams(max_tokens=1, extra_args={"speedsfi": {"sfi": {"enabled": False}}}),
                 use_tqdm=False)
    return {"request slots": len(table.slot_of) - 1,
            "SFI slots": len(table.sfi.slot_host) if table.sfi is not None else 0,
            "CritiPrefill slots": len(table.critiprefill.active) if table.critiprefill is not None else 0,
            "KV blocks": free_blocks_before - kv_manager.block_pool.get_num_free_blocks()}
