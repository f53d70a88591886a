"""Compile the backend's Triton kernels while the engine starts, not during the first requests.

Triton compiles a kernel once per compile key (constexprs, dtypes, pointer alignment, integers equal
to 1 or divisible by 16: ``vllm_ext.kernels.launch_log``). vLLM's own start-up reaches some of ours:
CUDA-graph capture runs a pure-decode step for each capture size. It never reaches a step with
prefills (its profile run has no attention metadata), a prefill end (SFI's first selection), the
decode rows of a mixed step, or anything under ``--enforce-eager``. On the H200 those compiled
during the first requests (~16 s; vLLM's JIT monitor warned).

:func:`warm_up_layer` runs this layer's launchers (the same functions the forward calls) over
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
``tests/test_kernel_warmup.py`` checks under the interpreter that a grid of real steps launches no
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
from dataclasses import dataclass

import torch

from vllm_ext.config import SfiConfig, SpeedSfiConfig

logger = logging.getLogger("vllm_ext")

# decode batch sizes the warm-up runs: Triton specialises an integer argument on == 1 and on
# divisibility by 16, so these three reach every class a batch size can fall in
DECODE_BATCHES = (1, 2, 16)


@dataclass(frozen=True)
class WarmupShape:
    """What a layer's launches depend on besides its tensors."""
    max_rows: int                  # max_num_seqs
    block_table_width: int         # the runner's block table: ceil(max_model_len / block_size)


def chunked_batch(max_rows: int, capacity: int, chunk: int) -> int | None:
    """Rows of the warm-up batch that reaches the slow list's chunks 0..3 (or all it has), or None
    when a step never has more than one chunk. Every chunk launches the same shapes; what differs is
    each entry pointer's 16-byte alignment (``c x B x 4`` bytes, and ``x`` the block table's width),
    which repeats with a period of four chunks."""
    reach = min(max_rows, capacity)
    if reach <= chunk:
        return None
    return min(reach, 3 * chunk + 1)


def _cases(cfg: SfiConfig, rows: int) -> tuple[list[str], list[int]]:
    """Row modes and context lengths of a synthetic decode batch: every mode present from two rows
    on, lengths above SFI's threshold for sparse rows."""
    sparse_len = cfg.n_sink + cfg.n_recent + cfg.k + 37
    modes = ["slow", "fast", "dense"]
    picked = [modes[i % 3] for i in range(rows)] if rows > 1 else ["slow"]
    lens = [sparse_len + 5 * i if m != "dense" else 23 + i for i, m in enumerate(picked)]
    return picked, lens


def synthetic_decode_plan(buffers, cfg: SfiConfig, modes: list[str], lens: list[int],
                          block_table: torch.Tensor):
    """Write a plan with the given row modes (``"dense"``, ``"slow"``, ``"fast"``) into ``buffers``
    (an ``SfiPlanBuffers``); row ``i`` takes compact slot ``i % capacity``."""
    from vllm_ext.methods.sfi.step_plan import write_plan

    dev = buffers.device
    rows = len(modes)
    t = torch.tensor(lens, dtype=torch.int32, device=dev)
    slow = torch.tensor([m == "slow" for m in modes], device=dev)
    fast = torch.tensor([m == "fast" for m in modes], device=dev)
    sparse = slow | fast
    slots = torch.arange(rows, dtype=torch.int32, device=dev) % buffers.capacity
    return write_plan(buffers, rows, slow=slow, fast=fast, sparse=sparse,
                      row_sfi_slot=torch.where(sparse, slots, 0),
                      k=torch.full_like(t, cfg.k), recent_start=torch.clamp(t - cfg.n_recent, min=0),
                      lo=torch.full_like(t, cfg.n_sink),
                      hi=torch.clamp(t - cfg.n_recent, min=cfg.n_sink), t=t,
                      block_table=block_table)


def _block_table(shape: WarmupShape, rows: int, num_blocks: int, device) -> torch.Tensor:
    """Rows of a block table as wide as the runner's (its row stride is part of the compile key),
    pointing at blocks 1.. of the cache (read only)."""
    bt = torch.zeros(max(shape.max_rows, rows), shape.block_table_width, dtype=torch.int32,
                     device=device)
    ids = 1 + torch.arange(shape.block_table_width, dtype=torch.int32, device=device) % max(num_blocks - 1, 1)
    bt[:] = ids
    return bt


def _bind_synthetic_pages(layer_buffers, compact_cache: torch.Tensor, capacity: int) -> None:
    """A paged layer (inside vLLM) reads its per-request state through the compact group's per-slot
    block table: bind it to the compact layer's pages through a table as wide as the real one
    (``capacity + 1`` rows, blocks 1..). The warm-up writes those pages; before the first request
    they hold nothing (every request writes its own state before it reads it)."""
    width = layer_buffers.state_pages(compact_cache).total
    nb = compact_cache.shape[0]
    ids = 1 + torch.arange((capacity + 1) * width, dtype=torch.int32, device=compact_cache.device) \
        % max(nb - 1, 1)
    layer_buffers.bind_pages(compact_cache, ids.view(capacity + 1, width))


def _bind_synthetic_quest_pages(layer_buffers, quest_cache: torch.Tensor, capacity: int,
                                shape: WarmupShape, page_size: int) -> None:
    """A paged quest layer reads its page bounds through the Quest group's per-slot table
    (``vllm_ext.methods.sfi.quest_tables``): bind it to the Quest layer's pages through a table as wide as
    the real one (``cdiv(cdiv(max_len, page_size), bs)`` = ``cdiv(block-table width, page_size)``)."""
    width = -(-shape.block_table_width // page_size)
    nb = quest_cache.shape[0]
    ids = 1 + torch.arange((capacity + 1) * width, dtype=torch.int32, device=quest_cache.device) \
        % max(nb - 1, 1)
    layer_buffers.bind_quest_pages(quest_cache, ids.view(capacity + 1, width))


def warm_up_sfi_layer(*, cfg: SfiConfig, layer_buffers, runtime, kv_cache: torch.Tensor,
                      num_heads: int, head_size: int, scale: float, dtype: torch.dtype,
                      shape: WarmupShape, layer_index: int = 0,
                      compact_cache: torch.Tensor | None = None,
                      quest_cache: torch.Tensor | None = None) -> None:
    """SFI's decode and prefill-end launches of one layer over synthetic steps (see the module
    docstring). ``layer_buffers``/``runtime``: the layer's ``SfiLayerBuffers`` and ``SfiRuntime``;
    ``compact_cache``: a paged layer's compact pages (the compact cache layer's ``kv_cache``);
    ``quest_cache``: with selector quest, its page bounds' pages (the Quest layer's ``kv_cache``)."""
    from vllm_ext.methods.sfi.path import sfi_decode, sfi_prefill_end
    from vllm_ext.methods.sfi.prompt_tail import TailRow, plan_prompt_tail
    from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

    device = kv_cache.device
    capacity = runtime.capacity
    if layer_buffers.paged:
        if compact_cache is None:
            raise ValueError("warm_up_sfi_layer: a paged layer needs its compact pages")
        _bind_synthetic_pages(layer_buffers, compact_cache, capacity)
        if cfg.selector == "quest":
            if quest_cache is None:
                raise ValueError("warm_up_sfi_layer: a paged quest layer needs its page bounds' pages")
            _bind_synthetic_quest_pages(layer_buffers, quest_cache, capacity, shape, cfg.page_size)
    block_size = kv_cache.shape[2]                  # our kernels' view: [blocks, Hkv, page, 2D]
    num_blocks = kv_cache.shape[0]
    buffers = SfiPlanBuffers(shape.max_rows, capacity, device, chunk_rows=runtime.maintenance_rows)
    seq_cap = shape.block_table_width * block_size
    chunked = chunked_batch(shape.max_rows, capacity, runtime.maintenance_rows)
    bt = _block_table(shape, max(DECODE_BATCHES + (chunked or 0,)), num_blocks, device)
    for rows in DECODE_BATCHES + ((chunked,) if chunked else ()):
        if rows > shape.max_rows:
            continue
        modes, lens = _cases(cfg, rows)
        lens = [min(n, seq_cap) for n in lens]
        step = synthetic_decode_plan(buffers, cfg, modes, lens, bt[:rows])
        q = torch.randn(rows, num_heads, head_size, dtype=dtype, device=device)
        out = torch.empty_like(q)
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        for dense_done in (False, True):          # a pure-decode step; a mixed step's decode rows
            sfi_decode(q, kv_cache, bt[:rows], seq, step, cfg, layer_buffers, runtime, layer_index,
                       scale, out, dense_done=dense_done, fixed_launches=True)
            runtime.ring.join()
    if cfg.selector == "quest":
        # the prefill chunks' page bounds, for one and two rows (the prompt tail is SFI's only)
        from types import SimpleNamespace

        from vllm_ext.methods.sfi.path import quest_prefill_pages

        for lens in ([min(cfg.page_size * 3 + 5, seq_cap)], [min(cfg.page_size * 2, seq_cap), 7]):
            n = len(lens)
            i32 = dict(dtype=torch.int32, device=device)
            plan = SimpleNamespace(rows=torch.arange(n, dtype=torch.int64, device=device),
                                   seq_lens=torch.tensor(lens, **i32), first_page=torch.zeros(n, **i32),
                                   sfi_slot=torch.arange(n, **i32) % capacity,
                                   max_pages=-(-max(lens) // cfg.page_size))
            quest_prefill_pages(kv_cache, bt, plan, cfg, layer_buffers)
    if layer_buffers.prompt_tail is not None:
        # prompt lengths in both classes (divisible by 16 or not: the evidence's span), and one and
        # two prompts ending in a step (the selector broadcasts a one-row table: another key)
        p0 = cfg.n_sink + cfg.n_recent + cfg.k + 1
        p_d = -(-p0 // 16) * 16
        for prompt_lens in ([p_d], [p_d + 1, p_d]):
            if max(prompt_lens) > seq_cap or len(prompt_lens) > capacity:
                continue
            rows, start = [], 0
            for i, prompt_len in enumerate(prompt_lens):
                q_len = min(prompt_len, cfg.w_prefill + 3)
                rows.append(TailRow(row=i, token_start=start, computed=prompt_len - q_len, q_len=q_len,
                                    prompt_len=prompt_len, k=cfg.k, sfi_slot=i, first_computed=0))
                start += q_len
            plan, _ = plan_prompt_tail(cfg, rows, device)
            q = torch.randn(start, num_heads, head_size, dtype=dtype, device=device)
            sfi_prefill_end(q, kv_cache, bt[:len(rows)], plan, cfg, layer_buffers, runtime,
                            layer_index, scale)
            runtime.ring.join()
    _clear(layer_buffers)


def warm_up_paged_decode(*, kv_cache: torch.Tensor, workspace, num_heads: int, head_size: int,
                         scale: float, dtype: torch.dtype, shape: WarmupShape) -> None:
    """``paged_decode`` (every method off with ``dense_decode = "paged_decode"``) at each batch class."""
    from vllm_ext.kernels.dense_decode_evidence import paged_decode

    device = kv_cache.device
    bt = _block_table(shape, max(DECODE_BATCHES), kv_cache.shape[0], device)
    for rows in DECODE_BATCHES:
        if rows > shape.max_rows:
            continue
        q = torch.randn(rows, num_heads, head_size, dtype=dtype, device=device)
        seq = torch.full((rows,), 33, dtype=torch.int32, device=device)
        paged_decode(q, kv_cache, bt[:rows], seq, scale, torch.empty_like(q), workspace=workspace)


def warm_up_speed_layer(*, kv_cache: torch.Tensor, num_heads: int, head_size: int, scale: float,
                        dtype: torch.dtype, shape: WarmupShape, anchor_end: int, self_only: bool) -> None:
    """SPEED's upper-layer attention (one kernel; the token count is its grid, not an argument)."""
    from vllm_ext.kernels.speed_attention import speed_attention

    device = kv_cache.device
    bt = _block_table(shape, 2, kv_cache.shape[0], device)
    for n in (1, 3):
        # the dtypes of the plan's buffers (``vllm_ext.methods.speed.visibility.SpeedPlanBuffers``)
        q = torch.randn(n, num_heads, head_size, dtype=dtype, device=device)
        rows = torch.zeros(n, dtype=torch.int64, device=device)
        positions = torch.arange(40, 40 + n, dtype=torch.int64, device=device)
        tail = torch.full((max(shape.max_rows, 1),), 39, dtype=torch.int32, device=device)
        speed_attention(q, kv_cache, bt, rows, positions, tail, anchor_end, self_only, scale,
                        torch.empty_like(q))


def warm_up_copy_trigger(*, cfg: SfiConfig, pages: torch.Tensor, max_len: int, capacity: int,
                         max_rows: int) -> None:
    """The copy trigger's per-step kernels (``vllm_ext.kernels.copy_match``: record and match, once
    per step, not per layer), with every argument a real step's compile key depends on as the
    engine has it: ``pages``, the page memory of a history cache layer (its dtype, strides and page
    shape), a per-slot table as wide as the real one (``cdiv(max_len, E)`` pages,
    ``SfiHistorySpec.blocks_per_request``), the n-gram, ``n_sink``, ``n_recent``,
    ``copy_max_matches`` and ``copy_once``, and the step's int32 buffers (vLLM's input ids, query
    start locations, sequence lengths; the plan's row tables). The rest is fixed by the launchers:
    one record block size, an unspecialised token count, the match's block. It writes nothing that a
    request reads: every row's history slot is -1 (the record writes no page) and no row is active
    (the match leaves ``copy_once``'s state alone; its flags go to a scratch tensor)."""
    from vllm_ext.kernels.copy_match import copy_match, record_tokens
    from vllm_ext.kernels.token_history import TokenHistory, history_pages

    ngram = cfg.resolved_copy_ngram
    if not ngram:
        return
    dev = pages.device
    i32 = dict(dtype=torch.int32, device=dev)
    view = pages if pages.dtype == torch.int32 else pages.view(torch.int32)
    width = history_pages(max_len, view.shape[1] * view.shape[2] * view.shape[3])
    hist = TokenHistory(pages, torch.zeros(capacity + 1, width, **i32), max_len)
    rows = max(1, min(max_rows, 16))
    q_len = 3
    ids = torch.zeros(rows * q_len, **i32)
    qsl = torch.arange(0, rows * q_len + 1, q_len, **i32)
    seq = torch.full((rows,), min(q_len, max_len), **i32)
    none = torch.full((rows,), -1, **i32)
    for max_q_len in (1, q_len):                      # a decode-only step; a step with prefill chunks
        record_tokens(hist, ids, qsl, seq, none, max_q_len)
    prev = torch.zeros(capacity + 1, **i32) if cfg.copy_once else None
    copy_match(hist, seq, none, torch.zeros(rows, **i32), torch.zeros(rows, **i32), n_sink=cfg.n_sink,
               n_recent=cfg.n_recent, ngram=ngram, max_matches=cfg.copy_max_matches, prev=prev,
               row_from=torch.zeros(rows, **i32))


def _history_pages(vllm_config) -> torch.Tensor | None:
    """The page memory vLLM bound to a history cache layer of SFI's copy trigger (None: none)."""
    from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX

    for name, layer in sorted(vllm_config.compilation_config.static_forward_context.items()):
        kv = getattr(layer, "kv_cache", None)
        if name.endswith(HISTORY_SUFFIX) and isinstance(kv, torch.Tensor) and kv.numel():
            return kv
    return None


def _clear(layer_buffers) -> None:
    layer_buffers.compact_len.zero_()
    if layer_buffers.paged:
        # the pages are vLLM's (nothing to clear: every request writes its state before reading it);
        # the forward binds the real table
        layer_buffers.unbind_pages()
        return
    layer_buffers.compact_kv.zero_()
    if layer_buffers.quest_pages is not None:
        layer_buffers.quest_pages.zero_()
    if layer_buffers.kept_pos is not None:
        layer_buffers.kept_pos.fill_(-1)
    if layer_buffers.prompt_tail is not None:
        layer_buffers.prompt_tail.queries.zero_()


def warm_up_impl(impl, kv_cache: torch.Tensor, shape: WarmupShape, dtype: torch.dtype,
                 layer_index: int) -> bool:
    """Warm up one ``SpeedSfiImpl`` layer; False when it launches none of our kernels."""
    cfg: SpeedSfiConfig = impl.config
    if cfg.speed.enabled and layer_index >= impl._speed_l_cut:
        from vllm_ext.methods.speed.visibility import anchor_count

        warm_up_speed_layer(kv_cache=kv_cache, num_heads=impl.num_heads, head_size=impl.head_size,
                            scale=impl.scale, dtype=dtype, shape=shape,
                            anchor_end=anchor_count(cfg.speed.anchor),
                            self_only=cfg.speed.variant == "self_only")
        return True
    if impl._sfi_layer is not None:
        compact = getattr(impl, "_compact", None)
        quest = getattr(impl, "_quest", None)
        warm_up_sfi_layer(cfg=cfg.sfi, layer_buffers=impl._sfi_layer, runtime=impl._sfi_rt,
                          kv_cache=kv_cache, num_heads=impl.num_heads, head_size=impl.head_size,
                          scale=impl.scale, dtype=dtype, shape=shape,
                          layer_index=max(layer_index, 0),
                          compact_cache=None if compact is None else compact.kv_cache,
                          quest_cache=None if quest is None else quest.kv_cache)
        return True
    if impl._ours_decode and impl._dense_ws is not None:
        warm_up_paged_decode(kv_cache=kv_cache, workspace=impl._dense_ws, num_heads=impl.num_heads,
                             head_size=impl.head_size, scale=impl.scale, dtype=dtype, shape=shape)
        return True
    return False


def not_covered(cfg: SpeedSfiConfig) -> list[str]:
    """The enabled paths whose kernels the warm-up does not reach yet."""
    out = []
    if cfg.critiprefill.enabled:
        out.append("CritiPrefill's prefill kernels")
    return out


def warm_up_engine(vllm_config) -> int:
    """Warm up one layer of each distinct geometry among this process's SPEEDSFI layers; returns
    how many layers ran."""
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_ext.config import BACKEND_NAME

    sched = vllm_config.scheduler_config
    block_size = vllm_config.cache_config.block_size
    max_len = vllm_config.model_config.max_model_len
    shape = WarmupShape(max_rows=sched.max_num_seqs, block_table_width=-(-max_len // block_size))
    dtype = vllm_config.model_config.dtype
    seen, ran = set(), 0
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        kv = getattr(layer, "kv_cache", None)
        backend = getattr(layer, "attn_backend", None)
        ours = backend is not None and backend.get_name() == BACKEND_NAME
        if not ours or impl is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            continue
        index = extract_layer_index(name)
        upper = impl.config.speed.enabled and index >= impl._speed_l_cut
        geom = (impl.num_heads, impl.num_kv_heads, impl.head_size, kv.dtype, tuple(kv.stride()),
                impl._sfi_layer is not None, impl._dense_ws is not None, upper)
        if geom in seen:
            continue
        seen.add(geom)
        ran += warm_up_impl(impl, kv, shape, dtype, index)
    from vllm_ext.backend.startup import resolve_config

    cfg = resolve_config(vllm_config)
    if cfg.sfi.enabled and cfg.sfi.resolved_copy_ngram:
        pages = _history_pages(vllm_config)
        if pages is not None:
            from vllm_ext.backend.metadata import sfi_capacity

            warm_up_copy_trigger(cfg=cfg.sfi, pages=pages, max_len=max_len,
                                 capacity=sfi_capacity(vllm_config), max_rows=sched.max_num_seqs)
    missing = not_covered(cfg)
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
    global _warmup_cls
    if _warmup_cls is None:
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

        _warmup_cls = SpeedSfiWarmup
    key = id(vllm_config)
    if key not in _registered:
        _registered.clear()
        _registered[key] = _warmup_cls(vllm_config)
    JitWarmupRegistry.register(_registered[key])


_warmup_cls = None
_registered: dict[int, object] = {}
