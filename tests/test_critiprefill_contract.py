"""The vLLM 0.32 internals CritiPrefill's CUDA route relies on: the Triton delegate can attend a
prefix of the batch's rows from its metadata cut to those rows (``metadata.delegate_head``)."""

import dataclasses
import inspect

import pytest
import torch

pytestmark = pytest.mark.e2e


def _batch(n_tokens: int):
    """Two decode rows, a dense prefill (7 tokens) and a long chunk (40), then a short one (5)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, 1, 2, 9, 49, 54], dtype=torch.int32)
    seq = torch.tensor([30, 12, 7, 300, 5], dtype=torch.int32)
    bt = torch.arange(50, dtype=torch.int32).reshape(5, 10)
    slots = torch.arange(n_tokens)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=5,
                                 num_actual_tokens=n_tokens, max_query_len=40, max_seq_len=300,
                                 block_table_tensor=bt, slot_mapping=slots)
    return qsl, seq, bt, slots, cm


def test_delegate_head_cuts_the_triton_metadata_to_the_first_rows():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

    from vllm_ext.backend.dense_delegate import delegate_head

    qsl, seq, bt, slots, cm = _batch(64)
    scratch = torch.zeros(1)
    md = TritonAttentionMetadata(num_actual_tokens=64, max_query_len=40, query_start_loc=qsl,
                                 max_seq_len=300, seq_lens=seq, block_table=bt, slot_mapping=slots,
                                 seq_threshold_3D=0, num_par_softmax_segments=16,
                                 softmax_segm_output=scratch, softmax_segm_max=scratch,
                                 softmax_segm_expsum=scratch, causal=True)
    head = delegate_head(md, cm, 3)
    assert head.num_actual_tokens == 9 and head.max_query_len == 7
    assert head.query_start_loc.tolist() == [0, 1, 2, 9] and head.seq_lens.tolist() == [30, 12, 7]
    assert torch.equal(head.block_table, bt[:3]) and head.slot_mapping.shape[0] == 9
    assert head.max_seq_len == 300 and head.softmax_segm_output is scratch
    assert md.num_actual_tokens == 64                # the full metadata is left as it is
    assert delegate_head(md, cm, 0) is None
    # what the delegate's forward reads of its metadata: every per-row field is cut above
    src = inspect.getsource(TritonAttentionImpl.forward)
    per_row = {"query_start_loc", "seq_lens", "block_table", "num_actual_tokens", "max_query_len"}
    read = {f.name for f in dataclasses.fields(TritonAttentionMetadata) if f"attn_metadata.{f.name}" in src}
    assert per_row <= read
    assert read - per_row <= {"max_seq_len", "seq_threshold_3D", "num_par_softmax_segments",
                              "softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum",
                              "causal", "mm_prefix_range", "mm_prefix_range_tensor", "rswa_prefix_lens",
                              "rswa_window"}


def _fa_metadata(qsl, seq, bt, slots, **kw):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    return FlashAttentionMetadata(num_actual_tokens=int(qsl[-1]), max_query_len=40, query_start_loc=qsl,
                                  max_seq_len=300, seq_lens=seq, block_table=bt, slot_mapping=slots, **kw)


def test_delegate_rows_cut_the_flash_attn_metadata_and_drop_its_batch_schedule():
    """``speedsfi.dense_delegate = "flash_attn"``: the same cut for FLASH_ATTN's metadata, whose
    ahead-of-time FA3 schedule describes the whole batch and must not reach the cut."""
    from vllm_ext.backend.dense_delegate import can_cut_rows, delegate_rows

    qsl, seq, bt, slots, cm = _batch(54)
    md = _fa_metadata(qsl, seq, bt, slots, scheduler_metadata=torch.zeros(8, dtype=torch.int32),
                      max_num_splits=4)
    tail = delegate_rows(md, cm, 2, 5)                 # the prefill rows after two decode rows
    assert tail.num_actual_tokens == 52 and tail.max_query_len == 40
    assert tail.query_start_loc.tolist() == [0, 7, 47, 52] and tail.seq_lens.tolist() == [7, 300, 5]
    assert torch.equal(tail.block_table, bt[2:]) and torch.equal(tail.slot_mapping, slots[2:])
    assert tail.scheduler_metadata is None and md.scheduler_metadata is not None
    assert can_cut_rows(md, 2)
    mm = _fa_metadata(qsl, seq, bt, slots, mm_prefix_query_range_tensor=torch.zeros(54, 2, dtype=torch.int32))
    assert not can_cut_rows(mm, 2) and can_cut_rows(mm, 0)


def test_flash_attn_forward_reads_only_what_the_cut_covers():
    """What FlashAttentionImpl.forward reads of its metadata: every per-row field is cut by
    ``delegate_rows``, the rest is whole-batch (an upper bound, a scalar or a feature the cut
    refuses). Fails when a vLLM upgrade makes FA read another per-row field."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata

    src = inspect.getsource(FlashAttentionImpl.forward)
    read = {f.name for f in dataclasses.fields(FlashAttentionMetadata) if f"attn_metadata.{f.name}" in src}
    per_row = {"query_start_loc", "seq_lens", "block_table", "num_actual_tokens", "max_query_len"}
    assert per_row <= read
    assert read - per_row <= {"max_seq_len", "scheduler_metadata", "max_num_splits", "causal",
                              "mm_prefix_query_range_tensor", "rswa_prefix_lens", "rswa_window",
                              "rswa_window_tensor"}
