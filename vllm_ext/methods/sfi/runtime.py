"""SFI's device runtime: the persistent buffers, scratch workspaces and CUDA streams/events the SFI
decode path runs on (``vllm_ext.methods.sfi.path``). Torch only (no vLLM import): the GPU benchmarks
drive it without vLLM.

Sizes follow the work, never ``max_num_seqs``:
- per layer, the compact segments: ``C x Hkv x (n_sink + k) x 2D`` entries (``C`` = SFI's request
  capacity: ``--max-num-seqs``, or ``sfi.max_requests`` when set) outside vLLM; inside vLLM they are
  KV-cache blocks of SFI's own group (``vllm_ext.methods.sfi.kv_spec``) and nothing here; so are, inside
  vLLM, the prompt-tail queries ``C x w_prefill x Hq x D`` (the prefill-end evidence window, which
  spans prefill chunks) and with ``sfi.keep_prefill`` P the kept positions ``C x Hkv x P`` int32
  (``vllm_ext.methods.sfi.state_pages``);
- shared by the layers of a device (one :class:`SfiRuntime`), sized by the maintenance chunk ``B``
  (``sfi.maintenance_rows``, at most ``C``), not by the request capacity: a step runs its slow rows
  in chunks of ``B`` (``vllm_ext.methods.sfi.path``):
  - the maintenance ring, ``N`` slots of evidence + key norms, ``2 x N x B x Hkv x L`` fp32
    (``L = max_model_len``), and the prefill-end block-table rows ``N x B x ceil(L / 16)`` int32;
  - the evidence pass's raw scores ``B x Hq x L`` fp32;
  - the selector's workspace (``B`` rows);
  - split-K scratch of the dense and fast kernels, ``max(B * splits(1), max_R R * splits(R)) x Hq x
    (D + 1)`` fp32 (the split count falls as rows grow, so this is bounded by the GPU's size and B,
    not the batch).
:func:`describe_sizes` gives the formula and the bytes; the backend logs it at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from vllm_ext.methods.sfi.config import SfiConfig

logger = logging.getLogger("vllm_ext")


class SfiLayerBuffers:
    """One layer's compact segments ``[C, Hkv, n_sink + k, 2D]`` and their lengths ``[C]``, and (with
    ``num_heads``) its prompt-tail queries ``[C, w_prefill, Hq, D]``
    (:class:`vllm_ext.methods.sfi.prompt_tail.PromptTailQueries`, the prefill-end evidence window).

    Selector ``quest`` (needs ``max_len``): instead of the prompt tail, the page max/min of K in
    bound pages ``quest_pages`` read through the per-slot table ``quest_table`` (slot ``C`` is a
    scratch slot that rows without a compact slot point at; layout: ``vllm_ext.kernels.quest_pages``),
    kept up to date by the prefill chunks and by every decode step (the page of the newest token).
    Outside vLLM one block of ``ceil(max_len / page_size)`` entries per slot (activation dtype);
    ``paged``: blocks of SFI's Quest group (``vllm_ext.methods.sfi.quest_kv_spec``), bound before each forward
    by :meth:`bind_quest_pages`.

    ``paged``: the compact segments, the kept positions and the prompt-tail queries live in vLLM's
    KV-cache blocks (``vllm_ext.methods.sfi.kv_spec``, ``vllm_ext.methods.sfi.state_pages``): none of them is
    allocated here; before each forward the impl hands :meth:`bind_pages` the compact layer's pages
    and the per-slot block table, and ``compact_kv`` / ``compact_table`` / ``kept_pos`` /
    ``prompt_tail.queries`` read through them."""

    def __init__(self, capacity: int, num_kv_heads: int, cfg: SfiConfig, head_size: int,
                 dtype: torch.dtype, device: torch.device, num_heads: int | None = None,
                 max_len: int | None = None, paged: bool = False):
        from vllm_ext.methods.sfi.prompt_tail import PromptTailQueries

        quest = cfg.selector == "quest"
        if quest and max_len is None:
            raise ValueError("SfiLayerBuffers: selector 'quest' needs max_len (the page tables)")
        self.cfg, self.dtype, self.paged = cfg, dtype, paged
        self.num_kv_heads, self.num_heads, self.head_size = num_kv_heads, num_heads, head_size
        self.compact_kv = None if paged else torch.zeros(capacity, num_kv_heads, cfg.n_sink + cfg.k,
                                                         2 * head_size, dtype=dtype, device=device)
        self.compact_table: torch.Tensor | None = None
        self.compact_len = torch.zeros(capacity, dtype=torch.int32, device=device)
        # sfi.keep_prefill: the positions each slot's prefill-end selection keeps (compact entries
        # [n_sink, n_sink + n_kept)), which decode-time selections exclude
        self.kept_pos = (torch.full((capacity, num_kv_heads, cfg.keep_prefill), -1, dtype=torch.int32,
                                    device=device) if cfg.keep_prefill and not paged else None)
        self.prompt_tail = None
        if num_heads is not None and cfg.prefill_end_selection:
            self.prompt_tail = PromptTailQueries(None if paged else PromptTailQueries.allocate(
                capacity, cfg.w_prefill, num_heads, head_size, dtype, device))
        self._bound: tuple | None = None
        self.quest_pages = self.quest_table = None
        if quest and not paged:
            from vllm_ext.kernels.quest_pages import contiguous_bound_pages, page_count

            self.quest_pages, self.quest_table = contiguous_bound_pages(
                capacity + 1, page_count(max_len, cfg.page_size), num_kv_heads, head_size, dtype, device)

    def state_pages(self, cache: torch.Tensor):
        """The row layout of this layer's compact group over the page memory ``cache``
        (``vllm_ext.methods.sfi.state_pages.SfiStatePages``)."""
        from vllm_ext.methods.sfi.state_pages import sfi_state_pages

        return sfi_state_pages(self.cfg, block_size=int(cache.shape[2]), num_kv_heads=self.num_kv_heads,
                               head_size=self.head_size,
                               num_heads=self.num_heads if self.num_heads is not None else self.num_kv_heads,
                               cache_dtype=cache.dtype, act_dtype=self.dtype)

    def bind_pages(self, cache: torch.Tensor, table: torch.Tensor) -> None:
        """``paged``: read this layer's per-request state from ``cache`` (the compact layer's pages,
        ``[num_blocks, Hkv, block_size, 2D]``) through ``table [slots + 1, blocks per request]`` (the
        per-compact-slot block table; its columns follow ``vllm_ext.methods.sfi.state_pages``). Views only,
        built again only when the cache or the table is another tensor."""
        if self._bound is not None and self._bound[0] is cache and self._bound[1] is table:
            return
        from vllm_ext.kernels.paged_rows import PagedRows

        pages = self.state_pages(cache)
        if table.shape[1] != pages.total:
            raise RuntimeError(f"SPEEDSFI: SFI's compact group gives {table.shape[1]} blocks per request, "
                               f"this layer's state takes {pages.total} ({pages})")
        cfg = self.cfg
        self.compact_kv = cache
        self.compact_table = table[:, :pages.segment]
        if cfg.keep_prefill:
            self.kept_pos = PagedRows(cache, table, pages.kept_first, (self.num_kv_heads, cfg.keep_prefill),
                                      torch.int32, fill=-1)
        if self.prompt_tail is not None:
            self.prompt_tail.queries = PagedRows(cache, table, pages.tail_first,
                                                 (cfg.w_prefill, self.num_heads, self.head_size), self.dtype)
        self._bound = (cache, table)

    def bind_quest_pages(self, cache: torch.Tensor, table: torch.Tensor) -> None:
        """``paged``, selector ``quest``: the page bounds are ``cache`` (the Quest layer's pages) read
        through ``table [slots + 1, blocks per request]`` (``vllm_ext.methods.sfi.quest_tables``)."""
        self.quest_pages, self.quest_table = cache, table

    def unbind_pages(self) -> None:
        """``paged``: forget the bound pages (the next forward binds the real ones)."""
        self.compact_kv = self.compact_table = self.kept_pos = None
        self.quest_pages = self.quest_table = None
        if self.prompt_tail is not None:
            self.prompt_tail.queries = None
        self._bound = None

    @staticmethod
    def nbytes(capacity: int, num_kv_heads: int, cfg: SfiConfig, head_size: int,
               dtype: torch.dtype, num_heads: int | None = None, max_len: int | None = None,
               paged: bool = False) -> int:
        """Bytes allocated here (``paged``: the per-request state is in vLLM's KV cache, not here)."""
        from vllm_ext.methods.sfi.prompt_tail import PromptTailQueries

        elem = torch.empty((), dtype=dtype).element_size()
        quest = cfg.selector == "quest"
        tail = (0 if num_heads is None or not cfg.prefill_end_selection or paged else
                PromptTailQueries.nbytes(capacity, cfg.w_prefill, num_heads, head_size, dtype))
        pages = 0
        if quest and max_len is not None and not paged:
            pages = ((capacity + 1) * 2 * (-(-max_len // cfg.page_size)) * num_kv_heads * head_size
                     * elem)
        compact = 0 if paged else capacity * num_kv_heads * (cfg.n_sink + cfg.k) * 2 * head_size * elem
        kept = 0 if paged else capacity * num_kv_heads * cfg.keep_prefill * 4
        return compact + capacity * 4 + kept + tail + pages


MIN_KERNEL_BLOCK = 16     # the smallest kernel block size SPEEDSFI accepts (backend: MultipleOf(16))


@dataclass
class SfiScratch:
    """One ring slot: one chunk's pooled log-evidence and key norms ``[B, Hkv, L]`` fp32, and the
    block-table rows of the requests whose prefill ends (``tables``, int32, room for ``B`` rows of
    ``ceil(L / 16)`` blocks: any kernel block size SPEEDSFI accepts). Everything side-stream work
    reads lives here, so the main stream never frees or reuses memory the side stream still reads
    (a temporary would need ``record_stream``)."""
    log_evidence: torch.Tensor
    key_norms: torch.Tensor
    tables: torch.Tensor | None = None

    @classmethod
    def allocate(cls, slots: int, num_kv_heads: int, max_len: int, device) -> "SfiScratch":
        f32 = dict(dtype=torch.float32, device=device)
        width = -(-max_len // MIN_KERNEL_BLOCK)
        return cls(torch.empty(slots, num_kv_heads, max_len, **f32),
                   torch.empty(slots, num_kv_heads, max_len, **f32),
                   torch.zeros(slots * width, dtype=torch.int32, device=device))

    def block_tables(self, block_table: torch.Tensor, rows: torch.Tensor, n: int
                     ) -> tuple[torch.Tensor, bool]:
        """``block_table[rows]`` (``n`` rows) written into this slot's persistent buffer (contiguous
        ``[n, width]``); returns it and whether it is that buffer. Only a table wider than the
        buffer was sized for gives a temporary, which side-stream users must hand to
        :meth:`MaintenanceRing.keep` (``record_stream``)."""
        width = block_table.shape[1]
        if self.tables is None or n * width > self.tables.numel():
            return block_table[rows], False
        out = self.tables[:n * width].view(n, width)
        torch.index_select(block_table, 0, rows, out=out)
        return out, True


class MaintenanceRing:
    """The evidence scratch in a ring of ``len(entries)`` slots, and the side stream that runs
    selector + gather (ALGORITHMS.md §1, "dual-stream maintenance").

    The unit is a maintenance chunk (``B`` slow rows of one layer): the ``u``-th chunk of a step, over
    all its layers, uses slot ``u % N`` (:meth:`entry`; ``join`` starts the count again). Before the
    main stream writes a slot's evidence it waits for the side stream to be done with the slot's
    previous chunk in this step; the side stream waits for the evidence. So a slot is never written
    by the main stream while the side stream still reads it, whatever the number of chunks per layer.
    ``join()`` (once per step, after the last layer) makes the main stream wait for all maintenance,
    because the next step overwrites the plan that maintenance reads and the next fast rows read the
    compact segments it writes. Every wait is on an event recorded in the same step, so a step
    captured in a CUDA graph records the fork and the join inside the graph (the slot sequence is
    fixed by the step's chunk count, a host value). Serial mode (CPU, or ``sfi.dual_stream = false``)
    runs maintenance inline. No allocation here.
    """

    def __init__(self, entries: list[SfiScratch], device: torch.device, dual_stream: bool):
        self.entries = entries
        self.dual = bool(dual_stream and device.type == "cuda")
        self._pending = False
        self._uses = 0                     # chunks given a slot since the last join
        if self.dual:
            self.stream = torch.cuda.Stream(device=device)
            self._ready = [torch.cuda.Event() for _ in entries]
            self._done = [torch.cuda.Event() for _ in entries]
            self._recorded = [False] * len(entries)

    def entry(self) -> tuple[int, SfiScratch]:
        """The next chunk's slot, once the side stream is done with its previous chunk."""
        i = self._uses % len(self.entries)
        self._uses += 1
        if self.dual and self._recorded[i]:
            torch.cuda.current_stream().wait_event(self._done[i])
        return i, self.entries[i]

    def submit(self, i: int, fn) -> None:
        if not self.dual:
            fn()
            return
        self._ready[i].record(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._ready[i])
            fn()
            self._done[i].record(self.stream)
        self._recorded[i] = True
        self._pending = True

    def keep(self, tensor: torch.Tensor) -> None:
        """Mark a main-stream temporary as used by the side stream (``record_stream``): the caching
        allocator then does not hand its memory out again before the side stream's work on it is
        done. A no-op in serial mode."""
        if self.dual:
            tensor.record_stream(self.stream)

    def join(self) -> None:
        self._uses = 0
        if self.dual and self._pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._pending = False
            self._recorded = [False] * len(self.entries)


def _nbytes(obj) -> int:
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    n = getattr(obj, "nbytes", None)
    if isinstance(n, int):
        return n
    return sum(_nbytes(v) for v in vars(obj).values() if isinstance(v, torch.Tensor))


class SfiRuntime:
    """Everything the SFI path shares across the layers of one device (see the module doc)."""

    def __init__(self, cfg: SfiConfig, *, capacity: int, max_rows: int, num_heads: int,
                 num_kv_heads: int, head_size: int, max_len: int, device: torch.device):
        from vllm_ext.kernels.dense_decode_evidence import dense_decode_workspace
        from vllm_ext.kernels.quest_rerank import quest_rerank_workspace
        from vllm_ext.kernels.sfi_selector import selector_workspace
        from vllm_ext.kernels.triton_utils import use_triton
        from vllm_ext.kernels.two_segment_decode import (dense_num_splits, max_row_splits,
                                                         two_segment_num_splits,
                                                         two_segment_workspace)

        from vllm_ext.methods.sfi.selector_params import selector_params
        from vllm_ext.methods.sfi.step_plan import maintenance_chunk

        self.cfg = cfg
        self.capacity = capacity
        # B: the slow rows one maintenance chunk covers; every slow-step buffer below is sized by it
        self.maintenance_rows = b = maintenance_chunk(cfg, capacity)
        self.shape = (max_rows, num_heads, num_kv_heads, head_size, max_len)
        dual = cfg.dual_stream and device.type == "cuda"
        n = cfg.side_stream_slots if dual else 1
        self.quest = cfg.selector == "quest"
        if self.quest:
            # quest mode selects synchronously on the main stream: one scratch slot, no side stream
            from vllm_ext.kernels.quest_pages import quest_selector_params

            dual, n = False, 1
            self.select_cfg = quest_selector_params(selector_params(cfg))
        else:
            self.select_cfg = selector_params(cfg)
        # sfi.keep_prefill: the kept and the decode-time selections take exact budgets (their sum is
        # the request's k; k_min applies to that sum through the config's validation). The
        # prefill-end selection is SFI's in either mode (quest with keep_prefill: its pages select
        # the rest at decode time)
        self.kept_select_cfg = dataclasses.replace(selector_params(cfg), k_min=0)
        self.rest_select_cfg = dataclasses.replace(self.select_cfg, k_min=0)
        # a chunk's slow rows, clamped to valid rows (main stream only: a layer of another KV-cache
        # group gathers its own block-table rows with them, sfi_path._slow_tables)
        self.slow_rows_in_range = torch.zeros(b, dtype=torch.int32, device=device)
        self.ring = MaintenanceRing([SfiScratch.allocate(b, num_kv_heads, max_len, device)
                                     for _ in range(n)], device, dual)
        if self.quest:
            for e in self.ring.entries:
                e.key_norms.fill_(1.0)   # the prior is off (weight 0); a finite norm keeps 0 * log finite
        est_fast = cfg.n_sink + cfg.k + cfg.n_recent
        dense_rs = max_row_splits(max_rows, lambda r: dense_num_splits(r, num_kv_heads, max_len,
                                                                        device))
        fast_rs = max_row_splits(max_rows, lambda r: two_segment_num_splits(r, num_kv_heads,
                                                                             est_fast, device))
        # the slow pass runs over a chunk of B compacted entries with the single-row split count
        max_splits = max(dense_num_splits(1, num_kv_heads, max_len, device), 1)
        self.dense_workspace = dense_decode_workspace(1, num_heads, head_size, max_splits, device,
                                                      max_len=max_len, evidence_rows=b,
                                                      row_splits=max(dense_rs, b * max_splits))
        self.split_workspace = two_segment_workspace(1, num_heads, head_size, 1, device,
                                                     row_splits=fast_rs)
        width = max(cfg.k, cfg.k_min)
        self.selector_workspace = selector_workspace(b, num_kv_heads, max_len, width, device,
                                                     self.select_cfg)
        # sfi.quest_rerank: the candidates' own top-K (quest_rerank x the budget) and their budgets
        self.candidate_workspace = None
        self.candidate_k = None
        self.candidate_scores = None
        if self.quest and cfg.quest_rerank:
            self.candidate_workspace = selector_workspace(b, num_kv_heads, max_len,
                                                          cfg.quest_rerank * cfg.k, device,
                                                          self.rest_select_cfg)
            self.candidate_k = torch.zeros(b, dtype=torch.int32, device=device)
            if use_triton(device):             # the Triton path's logits and partial sums
                self.candidate_scores = quest_rerank_workspace(b, num_heads, num_kv_heads, head_size,
                                                               cfg.quest_rerank * cfg.k, device)

    @property
    def nbytes(self) -> int:
        ring = sum(_nbytes(e.log_evidence) + _nbytes(e.key_norms) + _nbytes(e.tables)
                   for e in self.ring.entries)
        return (ring + _nbytes(self.dense_workspace) + _nbytes(self.split_workspace)
                + _nbytes(self.selector_workspace) + self._candidate_nbytes)

    @property
    def _candidate_nbytes(self) -> int:
        if self.candidate_workspace is None:
            return 0
        return (_nbytes(self.candidate_workspace) + _nbytes(self.candidate_k)
                + (self.candidate_scores.nbytes if self.candidate_scores is not None else 0))

    def chunks(self, rows: int) -> int:
        """Maintenance chunks a decode step of ``rows`` rows launches: ``ceil(min(rows, S) / B)``
        (a step has at most one slow row per row and per compact slot)."""
        return -(-min(int(rows), self.capacity) // self.maintenance_rows)

    def describe(self) -> str:
        max_rows, hq, hkv, d, max_len = self.shape
        b = self.maintenance_rows
        ring = sum(_nbytes(e.log_evidence) + _nbytes(e.key_norms) for e in self.ring.entries)
        return (f"SFI runtime {self.nbytes / 2**20:.1f} MiB = ring {len(self.ring.entries)} x 2 x "
                f"B {b} x Hkv {hkv} x L {max_len} x 4 B ({ring / 2**20:.1f} MiB) + evidence "
                f"scores B x Hq {hq} x L x 4 B + split scratch "
                f"({_nbytes(self.dense_workspace) / 2**20:.1f} MiB dense, "
                f"{_nbytes(self.split_workspace) / 2**20:.1f} MiB fast) + selector "
                f"{_nbytes(self.selector_workspace) / 2**20:.1f} MiB"
                + (f" + quest_rerank candidates {self._candidate_nbytes / 2**20:.1f} MiB"
                   if self.candidate_workspace is not None else "")
                + f"; B = sfi.maintenance_rows ({self.cfg.maintenance_rows}) capped at S {self.capacity} "
                f"(the SFI request capacity): a step's slow rows run in up to "
                f"ceil(min(R, S) / B) = {self.chunks(max_rows)} chunks")


LARGE_RUNTIME_BYTES = 2 << 30
