"""Slow-row maintenance in chunks of ``B = sfi.maintenance_rows`` (docs/sfi.md): every row's
evidence, key norms, selection and gathered compact segment, and every decode row's output, are
bit-identical whatever ``B`` is (1, 2, a ``B`` that does not divide ``S``, and ``S``; 2 with the
twins only), for the decode slow pass (the CUDA launch sequence with all ``ceil(min(R, S) / B)``
chunks, and the CPU's, which skips empty chunks; the Triton kernels only in the sequence CUDA runs)
and for the prefill-end selection. Over the
PyTorch twins and the Triton kernels (the interpreter on the CPU, on a small grid)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.sfi_forced_steps import forced_step
from vllm_ext.methods.sfi import path as sfi_path
from vllm_ext.methods.sfi.path import sfi_decode, sfi_prefill_end
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.triton_utils import use_triton
from vllm_ext.methods.sfi.prompt_tail import TailRow, plan_prompt_tail
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers, write_plan

DEV = torch.device("cpu")
HKV, G, D, BS = 2, 2, 16, 16
HQ = HKV * G
CAP = 5
LENS = [150, 97, 61, 130, 120]          # every row long enough to be sparse (k + n_sink + n_recent)
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, w_prefill=8, dual_stream=False)
KEEP = dataclasses.replace(CFG, keep_prefill=8, select_span=2, select_span_back=1)
CHUNKS = (1, 2, 3, CAP)                  # 3 does not divide S = 5: a padded last chunk


def _chunks(kernels):
    """The interpreted kernels skip B 2 (like 3, a padded last chunk; each B is minutes there)."""
    return CHUNKS if kernels == "twins" else (1, 3, CAP)
KERNELS = ["twins"] + (["triton"] if use_triton(DEV) else [])
# two decode steps: selections (slow rows), then some rows read them (fast) while others refresh
STEPS = [["slow", "slow", "dense", "slow", "slow"], ["fast", "slow", "slow", "fast", "slow"]]


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(LENS) // BS) + 1
    nb = CAP * width + 2
    kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)
    bt = torch.randperm(nb, generator=gen)[:CAP * width].reshape(CAP, width).to(torch.int32)
    return gen, kv, bt


@contextlib.contextmanager
def _recorded_maintenance(log: dict):
    """Every live entry's evidence and key norms (over its length) as maintenance receives them, by
    compact slot."""
    original = sfi_path._maintain

    def spy(rt, cfg, layer, kv_cache, block_table, sfi_slot, seq_lens, evidence, norms, lo, hi, k,
            count=None, kept=None, rest_cfg=None):
        live = int(count.reshape(-1)[0]) if count is not None else sfi_slot.shape[0]
        for e in range(live):
            n = int(seq_lens[e])             # columns past the row's length are never written
            log.setdefault(int(sfi_slot[e]), []).append((evidence[e, :, :n].clone(),
                                                         norms[e, :, :n].clone()))
        return original(rt, cfg, layer, kv_cache, block_table, sfi_slot, seq_lens, evidence, norms, lo,
                        hi, k, count, kept=kept, rest_cfg=rest_cfg)

    sfi_path._maintain = spy
    try:
        yield
    finally:
        sfi_path._maintain = original


def _state(cfg, chunk, max_len=256):
    cfg = dataclasses.replace(cfg, maintenance_rows=chunk)
    layer = SfiLayerBuffers(CAP, HKV, cfg, D, torch.float32, DEV, num_heads=HQ, max_len=max_len)
    rt = SfiRuntime(cfg, capacity=CAP, max_rows=CAP, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                    max_len=max_len, device=DEV)
    assert rt.maintenance_rows == chunk
    return cfg, layer, rt


def _decode_run(cfg, chunk, fixed_launches, kernels):
    gen, kv, bt = _problem()
    cfg, layer, rt = _state(cfg, chunk)
    if cfg.keep_prefill:                      # slots keep positions [n_sink, n_sink + keep)
        layer.kept_pos.copy_(torch.arange(cfg.n_sink, cfg.n_sink + cfg.keep_prefill,
                                          dtype=torch.int32).expand_as(layer.kept_pos))
    buffers = SfiPlanBuffers(CAP, CAP, DEV, chunk_rows=rt.maintenance_rows)
    outs, log = [], {}
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx, _recorded_maintenance(log):
        for modes in STEPS:
            step, t = forced_step(buffers, cfg, modes, LENS, bt)
            q = torch.randn(CAP, HQ, D, generator=gen)
            out = torch.full_like(q, 7.0)
            sfi_decode(q, kv, bt, t, step, cfg, layer, rt, 0, D ** -0.5, out, dense_done=False,
                       fixed_launches=fixed_launches)
            rt.ring.join()
            outs.append(out)
    return outs, layer.compact_kv.clone(), layer.compact_len.clone(), log


def _assert_same(a, b, what):
    assert torch.equal(a, b), f"{what} differs"


def _compare_logs(ref, got):
    assert ref.keys() == got.keys()
    for slot in ref:
        assert len(ref[slot]) == len(got[slot])
        for (e0, n0), (e1, n1) in zip(ref[slot], got[slot]):
            _assert_same(e0, e1, f"slot {slot}'s evidence")
            _assert_same(n0, n1, f"slot {slot}'s key norms")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cfg", [CFG, KEEP], ids=["sfi", "keep_prefill"])
def test_decode_slow_pass_is_bit_identical_for_every_chunk_size(cfg, kernels):
    ref = None
    for fixed in ((True, False) if kernels == "twins" else (True,)):
        for chunk in _chunks(kernels):
            outs, ckv, clen, log = _decode_run(cfg, chunk, fixed, kernels)
            assert sum(len(v) for v in log.values()) == 7, "every slow row maintained once"
            if ref is None:
                ref = (outs, ckv, clen, log)
                assert bool((clen > 0).all()), "every slot selected"
                continue
            for i, (o0, o1) in enumerate(zip(ref[0], outs)):
                _assert_same(o0, o1, f"B {chunk} (fixed {fixed}): step {i}'s output")
            _assert_same(ref[1], ckv, f"B {chunk} (fixed {fixed}): compact segments")
            _assert_same(ref[2], clen, f"B {chunk} (fixed {fixed}): compact lengths")
            _compare_logs(ref[3], log)


def _prefill_end_run(cfg, chunk, kernels):
    gen, kv, bt = _problem(1)
    cfg, layer, rt = _state(cfg, chunk)
    rows, start = [], 0
    for i, p in enumerate(LENS):
        q_len = cfg.w_prefill + 3
        rows.append(TailRow(row=i, token_start=start, computed=p - q_len, q_len=q_len, prompt_len=p,
                            k=cfg.k, sfi_slot=(i * 2) % CAP, first_computed=0))
        start += q_len
    plan, _ = plan_prompt_tail(cfg, rows, DEV)
    q = torch.randn(start, HQ, D, generator=gen)
    log = {}
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx, _recorded_maintenance(log):
        sfi_prefill_end(q, kv, bt, plan, cfg, layer, rt, 0, D ** -0.5)
        rt.ring.join()
    kept = layer.kept_pos.clone() if layer.kept_pos is not None else None
    return layer.compact_kv.clone(), layer.compact_len.clone(), kept, log


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cfg", [CFG, KEEP], ids=["sfi", "keep_prefill"])
def test_prefill_end_selection_is_bit_identical_for_every_chunk_size(cfg, kernels):
    ref = _prefill_end_run(cfg, CAP, kernels)
    assert bool((ref[1] > 0).all()), "every ending request selected"
    for chunk in _chunks(kernels)[:-1]:
        ckv, clen, kept, log = _prefill_end_run(cfg, chunk, kernels)
        _assert_same(ref[0], ckv, f"B {chunk}: compact segments")
        _assert_same(ref[1], clen, f"B {chunk}: compact lengths")
        if kept is not None:
            _assert_same(ref[2], kept, f"B {chunk}: kept positions")
        _compare_logs(ref[3], log)


def test_the_plan_counts_each_chunk_and_pads_the_last():
    buffers = SfiPlanBuffers(8, CAP, DEV, chunk_rows=2)
    assert (buffers.num_chunks, buffers.entries) == (3, 6)
    t = torch.full((8,), 200, dtype=torch.int32)
    slow = torch.tensor([True, False, True, True, False, True, True, True])  # 6 slow rows, S = 5
    step = write_plan(buffers, 8, slow=slow, fast=~slow, sparse=torch.ones(8, dtype=torch.bool),
                      row_sfi_slot=torch.arange(8, dtype=torch.int32) % CAP, k=torch.full_like(t, 8),
                      recent_start=t - 16, lo=torch.full_like(t, 4), hi=t - 16, t=t,
                      block_table=torch.zeros(8, 3, dtype=torch.int32))
    assert int(step.slow_count) == CAP
    assert step.slow_chunk_count[:, 0].tolist() == [2, 2, 1]
    assert step.slow_rows.tolist() == [0, 2, 3, 5, 6, -1]      # entry 5 pads the last chunk
    assert step.slow_chunk_count.stride(0) * 4 == 16            # every chunk's count 16-byte aligned


def test_the_ring_gives_each_chunk_the_next_slot_and_join_starts_over():
    """The unit of the ring is a chunk: the k-th chunk of a step (over all its layers) takes slot
    k mod N, so with dual streams the main stream waits for the side stream's previous chunk in that
    slot (on CUDA: tests/test_sfi_path.py's captured replays); join starts the step's count again."""
    from vllm_ext.methods.sfi.runtime import MaintenanceRing, SfiScratch

    ring = MaintenanceRing([SfiScratch.allocate(2, HKV, 32, DEV) for _ in range(3)], DEV, dual_stream=True)
    assert not ring.dual                                    # the CPU runs maintenance inline
    order = [ring.entry()[0] for _ in range(5)]
    assert order == [0, 1, 2, 0, 1]
    ring.join()
    assert ring.entry()[0] == 0
    ran = []
    ring.submit(0, lambda: ran.append(1))
    assert ran == [1]


def test_the_warm_up_batch_reaches_four_chunks_when_a_step_can():
    """methods.warmup.chunked_batch: chunk c's entry pointers sit c x B int32 past the list's start,
    so their 16-byte alignments repeat every four chunks; the warm-up's extra batch reaches chunks
    0..3 (or every chunk a step can have), and is skipped when a step never has two."""
    from vllm_ext.methods.warmup import chunked_batch

    assert chunked_batch(256, 256, 16) == 49                 # 4 chunks of the default B
    assert chunked_batch(40, 4, 1) == 4                       # all 4 chunks S allows
    assert chunked_batch(30, 256, 16) == 30                   # the 2 chunks 30 rows can have
    assert chunked_batch(16, 256, 16) is None and chunked_batch(256, 8, 16) is None
    for rows, cap, b in ((256, 256, 16), (40, 4, 1), (256, 256, 7)):
        n = chunked_batch(rows, cap, b)
        assert -(-min(n, cap) // b) == min(4, -(-min(rows, cap) // b))
