"""The device plan (paged, batched, chunked) against the contiguous single-sequence oracle."""

import pytest
import torch

from helpers import cfg, make_batch
from vllm_ext.methods.critiprefill.criticality import LayerFusion, select_for_sequence
from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan, segment_query_representatives

# (seq_len, q_len): single chunks at segment / block boundaries +-1, and chunks with a cached prefix
# starting mid-segment, mid-block, on a segment boundary, and a single-token chunk.
REQS = [(257, 257), (63, 63), (129, 129), (300, 100), (192, 64), (97, 1), (224, 160)]


def _plan(b, c, layer=1, fusion=None, **kw):
    return build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c,
                      layer_idx=layer, fusion=fusion, keep_scores=True, **kw)


def _oracle_rows(b, i, c, fusion=None, prompt_len=None):
    qsl = b.query_start_loc.tolist()
    seq, ql = b.seq_list[i], b.q_lens[i]
    return select_for_sequence(b.query[qsl[i]:qsl[i + 1]], b.keys[i], c, fusion,
                               ctx_len=seq - ql, prompt_len=prompt_len)


@pytest.mark.parametrize("score,fusion_form", [("paper", "paper"), ("code", "ema")])
def test_plan_matches_oracle_two_layers(score, fusion_form):
    c = cfg(score=score, fusion=fusion_form)
    seqs, qls = zip(*REQS)
    b1 = make_batch(list(seqs), list(qls), hq=4, hkv=2, d=16, page=16, seed=1, pad_tokens=5)
    b2 = make_batch(list(seqs), list(qls), hq=4, hkv=2, d=16, page=32, layout="HND", seed=2)
    fusion = LayerFusion(fusion_form, c.alpha)
    p1 = _plan(b1, c, 1, fusion, max_seq_len=320)      # one score shape for both layers (one batch)
    p2 = _plan(b2, c, 2, fusion, max_seq_len=320)
    for i in range(len(REQS)):
        f = LayerFusion(fusion_form, c.alpha)
        o1 = _oracle_rows(b1, i, c, f)
        o2 = _oracle_rows(b2, i, c, f)
        n = o1.sel.shape[0]
        assert p1.num_segments[i].item() == n
        assert p1.first_segment[i].item() == (b1.seq_list[i] - b1.q_lens[i]) // c.segment_size
        for p, o in ((p1, o1), (p2, o2)):
            nb = o.scores.shape[-1]
            torch.testing.assert_close(p.scores[i, :n, :, :nb], o.scores, rtol=1e-5, atol=1e-6)
            assert torch.all(p.scores[i, :n, :, nb:] == 0)
            assert torch.equal(p.sel_blocks[i, :n], o.sel), (i, p.sel_blocks[i, :n], o.sel)
            assert torch.equal(p.dense[i, :n], o.dense)
            assert torch.equal(p.num_sel[i, :n], (o.sel >= 0).sum(-1).to(torch.int32))
            # padding rows: nothing selected, never dense
            assert torch.all(p.sel_blocks[i, n:] == -1) and torch.all(p.num_sel[i, n:] == 0)
            assert not p.dense[i, n:].any()
    # layer fusion changed something (else the test would not test it)
    p2_nofuse = _plan(b2, c, 2, None, max_seq_len=320)
    assert not torch.allclose(p2_nofuse.scores, p2.scores)


def test_chunking_at_segment_boundaries_is_invariant():
    c = cfg(segment_size=64, block_size=32, budget=64)
    whole = make_batch([320], [320], hq=4, hkv=2, d=16, page=16, seed=5)
    pw = _plan(whole, c)
    qsl = whole.query_start_loc
    for ctx in (128, 192):                  # second chunk of the same prompt, same cache
        part = whole.query[ctx:]
        p = build_plan(part, whole.kv_cache, whole.block_table, torch.tensor([0, 320 - ctx], dtype=qsl.dtype),
                       whole.seq_lens, c, layer_idx=1, keep_scores=True)
        s0 = ctx // 64
        n = p.num_segments[0].item()
        assert n == 5 - s0
        assert torch.equal(p.sel_blocks[0, :n], pw.sel_blocks[0, s0:s0 + n])
        assert torch.equal(p.dense[0, :n], pw.dense[0, s0:s0 + n])


def test_prompt_lens_and_the_sparse_start():
    c = cfg(min_len=128)
    b = make_batch([200, 300], [100, 300], hq=2, hkv=1, d=16, page=16, seed=6)
    p = _plan(b, c)
    # segments starting before min_len (0, 1) and each prompt's final segment are dense
    assert p.dense[0, :3].tolist() == [True, False, True]                # segments 1, 2, 3 (final)
    assert p.dense[1, :5].tolist() == [True, True, False, False, True]
    # request 0 is the first chunk of a 1000-token prompt: its last segment here is not the final one
    p = _plan(b, c, prompt_lens=torch.tensor([1000, 300]))
    assert p.dense[0, :3].tolist() == [True, False, False]
    assert p.dense[1, :5].tolist() == [True, True, False, False, True]
    # a prompt that never reaches min_len is dense throughout
    p = _plan(b, cfg(min_len=300))
    assert p.dense[0, :3].tolist() == [True] * 3 and p.dense[1, :5].tolist() == [True] * 5


def test_dense_layer_leaves_fusion_untouched():
    c = cfg(dense_layers=(0, 2))
    b = make_batch([200], [200], hq=2, hkv=1, d=16, page=16, seed=7)
    f = LayerFusion()
    p = _plan(b, c, layer=0, fusion=f)
    assert p.all_dense and f.prev is None and bool(p.dense[0, :4].all())
    p = _plan(b, c, layer=1, fusion=f)
    assert not p.all_dense and f.prev is not None
    prev = f.prev
    _plan(b, c, layer=2, fusion=f)
    assert f.prev is prev
    dp = dense_plan(b.query_start_loc, b.seq_lens, 1, c, num_tokens=200)
    assert dp.all_dense and dp.sel_blocks.shape == p.sel_blocks.shape


def test_budget_covering_everything_selects_all_preceding_blocks():
    c = cfg(segment_size=64, block_size=32, budget=1024)
    b = make_batch([300, 150], [300, 90], hq=4, hkv=2, d=16, page=32, seed=8)
    p = _plan(b, c)
    for i in range(2):
        first = p.first_segment[i].item()
        for s in range(p.num_segments[i].item()):
            sb = (first + s) * 2
            for h in range(2):
                row = p.sel_blocks[i, s, h].tolist()
                assert row[:sb] == list(range(sb)) and all(x == -1 for x in row[sb:])


def test_segment_query_representatives_ignore_padding_rows():
    b = make_batch([130, 70], [130, 6], hq=2, hkv=1, d=8, page=16, seed=9, pad_tokens=4)
    b.query[-4:] = 1e6                       # garbage in the padding rows must not leak
    qmax, qmin = segment_query_representatives(b.query, b.query_start_loc, b.seq_lens, 64, 4)
    assert qmax.shape == (2, 4, 2, 8)
    q0 = b.query[:130].float()
    torch.testing.assert_close(qmax[0, 0], q0[:64].amax(0))
    torch.testing.assert_close(qmin[0, 2], q0[128:130].amin(0))
    q1 = b.query[130:136].float()             # request 1: positions 64..69, all in segment 1
    torch.testing.assert_close(qmax[1, 0], q1.amax(0))
    torch.testing.assert_close(qmin[1, 0], q1.amin(0))
    assert torch.all(qmax[1, 1:] == 0) and torch.all(qmax[0, 3] == 0)


def test_padding_tokens_do_not_change_the_plan():
    c = cfg()
    a = make_batch([257, 100], [200, 100], hq=4, hkv=2, d=16, page=16, seed=10)
    b = make_batch([257, 100], [200, 100], hq=4, hkv=2, d=16, page=16, seed=10, pad_tokens=7)
    b.query[-7:] = 50.0
    pa, pb = _plan(a, c, max_query_len=200), _plan(b, c, max_query_len=200)
    assert torch.equal(pa.sel_blocks, pb.sel_blocks) and torch.equal(pa.dense, pb.dense)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_and_kernel_never_sync_with_the_host():
    from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill

    c = cfg(segment_size=128, block_size=32, budget=128)
    b = make_batch([1500, 700], [600, 700], hq=8, hkv=2, d=64, page=16, dtype=torch.bfloat16, device="cuda")
    fusion = LayerFusion()
    args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens)
    build_plan(*args, c, layer_idx=1, fusion=fusion, max_seq_len=1536, max_query_len=700)   # warm-up / compile
    block_sparse_prefill(*args, build_plan(*args, c, layer_idx=2, max_seq_len=1536), 0.125)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_plan(*args, c, layer_idx=2, fusion=fusion, max_seq_len=1536, max_query_len=700)
        block_sparse_prefill(*args, plan, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
