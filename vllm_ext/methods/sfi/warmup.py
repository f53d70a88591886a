"""SFI's start-up warm-up: its decode and prefill-end launches of one layer over synthetic steps
chosen to reach every compile key a real step can (see :mod:`vllm_ext.backend.kernel_warmup`), and
the copy trigger's per-step kernels once per engine."""

from __future__ import annotations

import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.warmup import DECODE_BATCHES, WarmupShape, chunked_batch, synthetic_block_table

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
                      quest_cache: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """SFI's decode and prefill-end launches of one layer over synthetic steps (see the module
    docstring). ``layer_buffers``/``runtime``: the layer's ``SfiLayerBuffers`` and ``SfiRuntime``;
    ``compact_cache``: a paged layer's compact pages (the compact cache layer's ``kv_cache``, as the
    forward reads it: an fp8 cache's view); ``quest_cache``: with selector quest, its page bounds'
    pages (the Quest layer's ``kv_cache``, the same); ``k_scale``/``v_scale``: the layer's, as the
    forward passes them (fp8 pages: the scaled variants)."""
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
    bt = synthetic_block_table(shape, max(DECODE_BATCHES + (chunked or 0,)), num_blocks, device)
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
                       scale, out, dense_done=dense_done, fixed_launches=True, k_scale=k_scale,
                       v_scale=v_scale)
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
                            layer_index, scale, k_scale=k_scale)
            runtime.ring.join()
    _clear(layer_buffers)


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


def history_pages_of(vllm_config) -> torch.Tensor | None:
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
