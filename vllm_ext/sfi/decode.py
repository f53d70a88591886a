"""SFI decode for one layer: slow rows refresh their compact segment, fast rows read it.

Torch-level orchestration of the kernels (each dispatches to Triton on CUDA and to its PyTorch twin
elsewhere); no vLLM import, no host synchronisation: every row decision is a device mask from the
step plan (``vllm_ext.sfi.step_plan``).

Buffers:
- per layer (``SfiLayerBuffers``): the compact segment ``[capacity, Hkv, n_sink + k, 2*D]`` (sink +
  selected K|V, contiguous per request and KV head) and its length per compact slot;
- shared by the layers of a device (``SfiScratch``): the slow step's pooled log-evidence and key norms
  ``[max_rows, Hkv, max_len]`` fp32.
Both are allocated once, before vLLM profiles memory, so they come out of its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.config import SfiConfig
from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence
from vllm_ext.kernels.gather_compact import gather_compact
from vllm_ext.kernels.sfi_selector import select
from vllm_ext.kernels.two_segment_decode import two_segment_decode
from vllm_ext.sfi.step_plan import SfiStep


class SfiLayerBuffers:
    def __init__(self, capacity: int, num_kv_heads: int, cfg: SfiConfig, head_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.compact_kv = torch.zeros(capacity, num_kv_heads, cfg.n_sink + cfg.k, 2 * head_size,
                                      dtype=dtype, device=device)
        self.compact_len = torch.zeros(capacity, dtype=torch.int32, device=device)

    @staticmethod
    def nbytes(capacity: int, num_kv_heads: int, cfg: SfiConfig, head_size: int,
               dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return capacity * num_kv_heads * (cfg.n_sink + cfg.k) * 2 * head_size * elem + capacity * 4


@dataclass
class SfiScratch:
    log_evidence: torch.Tensor      # fp32 [max_rows, Hkv, max_len]
    key_norms: torch.Tensor         # fp32 [max_rows, Hkv, max_len]
    slow_out: torch.Tensor          # [max_rows, Hq, D]: the evidence pass's output where it is not needed

    @classmethod
    def allocate(cls, max_rows: int, num_heads: int, num_kv_heads: int, head_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> "SfiScratch":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(max_rows, num_kv_heads, max_len, **f32),
                   torch.empty(max_rows, num_kv_heads, max_len, **f32),
                   torch.empty(max_rows, num_heads, head_size, dtype=dtype, device=device))

    def fits(self, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
        return (self.log_evidence.shape[1] == num_kv_heads and self.slow_out.shape[1:] ==
                (num_heads, head_size))


def key_norms(kv_cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [rows, Hkv, L] = ||k_j||`` for positions ``j < L`` (entries past a row's history are
    whatever the cache holds there; the selector masks them)."""
    rows, hkv, length = out.shape
    block_size = kv_cache.shape[2]
    d = kv_cache.shape[-1] // 2
    pos = torch.arange(length, device=kv_cache.device)
    nblk = min(block_table.shape[1], (length + block_size - 1) // block_size)
    pos = pos[: nblk * block_size]
    blocks = block_table[:rows, pos // block_size].long()                   # [rows, L']
    k = kv_cache[..., :d][blocks, :, pos % block_size]                      # [rows, L', Hkv, D]
    out[:, :, : pos.shape[0]] = torch.linalg.vector_norm(k.float(), dim=-1).transpose(1, 2)
    out[:, :, pos.shape[0]:] = 1.0
    return out


def sfi_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, plan: SfiStep, cfg: SfiConfig, layer: SfiLayerBuffers,
               ring: "MaintenanceRing", layer_index: int, scale: float, out: torch.Tensor, *,
               dense_done: bool) -> torch.Tensor:
    """SFI for the decode rows ``0..R-1`` (one query each; ``query``/``out`` are ``[R, Hq, D]``).

    ``dense_done``: ``out`` already holds dense attention for every row (then slow rows only add the
    evidence, and fast rows are overwritten). Otherwise the slow rows' dense output is written here
    and the caller computes the rows that are neither slow nor fast.

    The slow rows' selector and gather (maintenance) go to ``ring``: on CUDA with ``dual_stream`` a
    side stream overlaps them with the next layers; the compact segments they write are read at the
    next step, after the step's join (``MaintenanceRing.join``).
    """
    rows = query.shape[0]
    slow = plan.row_slow[:rows]
    fast = plan.row_fast[:rows]
    sfi_slot = plan.row_sfi_slot[:rows]
    lo, hi = plan.allowed_lo[:rows], plan.allowed_hi[:rows]
    # On the CPU a host check is free and skips whole phases; on CUDA every phase is launched and
    # its kernels exit early on masked rows (no synchronisation).
    on_cpu = query.device.type == "cpu"
    if not on_cpu or bool(fast.any()):
        two_segment_decode(query, kv_cache, block_table, seq_lens, plan.recent_start[:rows],
                           layer.compact_kv, layer.compact_len, sfi_slot, scale, out, row_mask=fast,
                           max_recent=cfg.n_recent, workspace=ring.split_workspace)
    if on_cpu and not bool(slow.any()):
        return out
    entry, scratch = ring.entry(layer_index)
    evidence = scratch.log_evidence[:rows]
    slow_out = scratch.slow_out[:rows] if dense_done else out
    dense_decode_with_evidence(query, kv_cache, block_table, seq_lens, lo, hi, scale, slow_out,
                               evidence, row_mask=slow, alpha=cfg.alpha,
                               workspace=ring.dense_workspace)

    def maintain():
        norms = key_norms(kv_cache, block_table[:rows], scratch.key_norms[:rows])
        selected, n_sel = select(evidence, norms, lo, hi, cfg, plan.row_k[:rows], k_cap=cfg.k)
        gather_compact(kv_cache, block_table, sfi_slot, selected, n_sel, cfg.n_sink,
                       layer.compact_kv, layer.compact_len, row_mask=slow, seq_lens=seq_lens)

    ring.submit(entry, maintain)
    return out


def sfi_prefill_end(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    plan, cfg: SfiConfig, layer: SfiLayerBuffers, ring: "MaintenanceRing",
                    layer_index: int, scale: float) -> None:
    """First selection of the requests whose prefill ends in this step, from their last
    ``w_prefill`` queries (``plan``: ``vllm_ext.sfi.step_plan.SfiPrefillEnd``). Their K/V of this
    chunk must already be in the cache."""
    from vllm_ext.kernels.dense_decode_evidence import prefill_evidence

    n = plan.rows.shape[0]
    queries = query[plan.token_idx]                                        # [n, W, Hq, D]
    tables = block_table[plan.rows]
    entry, scratch = ring.entry(layer_index)
    evidence = scratch.log_evidence[:n]
    prefill_evidence(queries, kv_cache, tables, plan.seq_lens, plan.allowed_lo, plan.allowed_hi,
                     scale, evidence, plan.positions, alpha=cfg.alpha)

    def maintain():
        norms = key_norms(kv_cache, tables, scratch.key_norms[:n])
        selected, n_sel = select(evidence, norms, plan.allowed_lo, plan.allowed_hi, cfg, plan.k,
                                 k_cap=cfg.k)
        gather_compact(kv_cache, tables, plan.sfi_slot, selected, n_sel, cfg.n_sink,
                       layer.compact_kv, layer.compact_len, seq_lens=plan.seq_lens)

    ring.submit(entry, maintain)


class MaintenanceRing:
    """Scratch for the slow step's evidence, in a ring of ``len(entries)`` slots, and the side stream
    that runs selector + gather (ALGORITHMS.md §1, "dual-stream maintenance").

    Layer ``l`` uses slot ``l % N``. Before the main stream writes a slot's evidence it waits for the
    side stream to be done with the slot's previous user; the side stream waits for the evidence.
    ``join()`` (once per step, after the last layer) makes the main stream wait for all maintenance,
    because the next step overwrites the block table and the step plan that maintenance reads.
    Serial mode (CPU, or ``sfi.dual_stream = false``) runs maintenance inline. No allocation here.
    """

    def __init__(self, entries: list[SfiScratch], device: torch.device, dual_stream: bool, *,
                 dense_workspace=None, split_workspace=None):
        self.entries = entries
        self.dual = bool(dual_stream and device.type == "cuda")
        self._pending = False
        # split-K scratch of the main-stream kernels (never touched by the side stream)
        self.dense_workspace = dense_workspace
        self.split_workspace = split_workspace
        if self.dual:
            self.stream = torch.cuda.Stream(device=device)
            self._ready = [torch.cuda.Event() for _ in entries]
            self._done = [torch.cuda.Event() for _ in entries]

    def entry(self, layer_index: int) -> tuple[int, SfiScratch]:
        i = layer_index % len(self.entries)
        if self.dual:
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
        self._pending = True

    def join(self) -> None:
        if self.dual and self._pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._pending = False
