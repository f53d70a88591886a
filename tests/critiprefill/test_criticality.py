"""Hand-computed cases for the criticality scores, fusion, selection and dense fallbacks."""

import math

import pytest
import torch

from helpers import cfg
from vllm_ext.methods.critiprefill.criticality import LayerFusion, candidate_mask, criticality_scores, fuse_scores, is_dense_layer, segment_representatives, select_blocks, select_for_sequence
from vllm_ext.methods.critiprefill.criticality import check_sizes


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


# One segment (start block sb = 3: blocks 0, 1, 2 visible, block 3 not), D = 2, one head.
QMAX = [1.0, 0.0]
QMIN = [0.0, -1.0]
KMAX = [[1.0, 1.0], [2.0, 0.0], [0.0, 3.0], [5.0, 5.0]]
KMIN = [[0.0, 0.0], [-1.0, -1.0], [1.0, -2.0], [4.0, 4.0]]
# dot products by hand over the visible blocks 0..2
QMAX_KMAX = [1.0, 2.0, 0.0]
QMIN_KMAX = [-1.0, 0.0, -3.0]
QMAX_KMIN = [0.0, -1.0, 1.0]
QMIN_KMIN = [0.0, 1.0, 2.0]


def _tensors(qmax, qmin, hkv=1):
    q1 = torch.tensor([qmax])[None]            # [S=1, Hq, D]
    q2 = torch.tensor([qmin])[None]
    if q1.dim() == 4:
        q1, q2 = q1[0], q2[0]
    k1 = torch.tensor(KMAX)[:, None, :].expand(4, hkv, 2)
    k2 = torch.tensor(KMIN)[:, None, :].expand(4, hkv, 2)
    vis = candidate_mask(torch.tensor([3]), 4)
    return q1, q2, k1, k2, vis


def test_paper_score_by_hand():
    q1, q2, k1, k2, vis = _tensors(QMAX, QMIN)
    s = criticality_scores(q1, q2, k1, k2, vis, "paper")
    assert s.shape == (1, 1, 4)
    s1, s2, s3, s4 = softmax(QMAX_KMAX), softmax(QMAX_KMIN), softmax(QMIN_KMAX), softmax(QMIN_KMIN)
    want = [max((a + c) / 2, (b + d) / 2) for a, b, c, d in zip(s1, s2, s3, s4)] + [0.0]
    torch.testing.assert_close(s[0, 0], torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_code_score_by_hand():
    q1, q2, k1, k2, vis = _tensors(QMAX, QMIN)
    s = criticality_scores(q1, q2, k1, k2, vis, "code")
    amax = [(a + b) / 2 for a, b in zip(QMAX_KMAX, QMIN_KMAX)]      # [0, 1, -1.5]
    amin = [(a + b) / 2 for a, b in zip(QMAX_KMIN, QMIN_KMIN)]      # [0, 0, 1.5]
    want = softmax([max(a, b) for a, b in zip(amax, amin)]) + [0.0]
    torch.testing.assert_close(s[0, 0], torch.tensor(want), rtol=1e-6, atol=1e-7)
    assert s[0, 0].argmax().item() == 2
    # the two forms rank differently here: the paper form's best block is 1
    assert criticality_scores(q1, q2, k1, k2, vis, "paper")[0, 0].argmax().item() == 1


def test_gqa_group_average_by_hand():
    # two query heads on one KV head; head 1 uses negated representatives' roles
    qmax = torch.tensor([[QMAX, [0.0, 1.0]]])          # [S=1, Hq=2, D]
    qmin = torch.tensor([[QMIN, [-1.0, 0.0]]])
    k1 = torch.tensor(KMAX)[:, None, :]
    k2 = torch.tensor(KMIN)[:, None, :]
    vis = candidate_mask(torch.tensor([3]), 4)
    # head 1 dots by hand: qmax=[0,1], qmin=[-1,0]
    h1 = dict(mk=[1.0, 0.0, 3.0], nk=[-1.0, -2.0, 0.0], mn=[0.0, -1.0, -2.0], nn=[0.0, 1.0, -1.0])
    h0 = dict(mk=QMAX_KMAX, nk=QMIN_KMAX, mn=QMAX_KMIN, nn=QMIN_KMIN)

    def paper(h):
        s1, s3 = softmax(h["mk"]), softmax(h["nk"])
        s2, s4 = softmax(h["mn"]), softmax(h["nn"])
        return [max((a + c) / 2, (b + d) / 2) for a, b, c, d in zip(s1, s2, s3, s4)]

    want_p = [(a + b) / 2 for a, b in zip(paper(h0), paper(h1))] + [0.0]
    got_p = criticality_scores(qmax, qmin, k1, k2, vis, "paper")
    assert got_p.shape == (1, 1, 4)
    torch.testing.assert_close(got_p[0, 0], torch.tensor(want_p), rtol=1e-6, atol=1e-7)

    def raw(h):
        return [max((a + b) / 2, (c + d) / 2) for a, b, c, d in zip(h["mk"], h["nk"], h["mn"], h["nn"])]

    want_c = softmax([(a + b) / 2 for a, b in zip(raw(h0), raw(h1))]) + [0.0]
    got_c = criticality_scores(qmax, qmin, k1, k2, vis, "code")
    torch.testing.assert_close(got_c[0, 0], torch.tensor(want_c), rtol=1e-6, atol=1e-7)


def test_gqa_one_row_per_kv_head():
    g = torch.Generator().manual_seed(0)
    qmax, qmin = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    kmax, kmin = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
    vis = candidate_mask(torch.tensor([0, 4, 8]), 10)
    for form in ("paper", "code"):
        s = criticality_scores(qmax, qmin, kmax, kmin, vis, form)
        assert s.shape == (3, 2, 10)
        # KV head 1 only depends on query heads 4..7
        q2 = qmax.clone()
        q2[:, :4] += 3.0
        s2 = criticality_scores(q2, qmin, kmax, kmin, vis, form)
        torch.testing.assert_close(s2[:, 1], s[:, 1])
        assert not torch.allclose(s2[:, 0, :4], s[:, 0, :4])


def test_causal_mask_in_scores():
    g = torch.Generator().manual_seed(1)
    qmax, qmin = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    kmax, kmin = torch.randn(12, 2, 8, generator=g) + 5, torch.randn(12, 2, 8, generator=g) + 5
    sb = torch.tensor([0, 1, 5, 12])
    vis = candidate_mask(sb, 12)
    for form in ("paper", "code"):
        s = criticality_scores(qmax, qmin, kmax, kmin, vis, form)
        for j, b in enumerate(sb.tolist()):
            assert torch.all(s[j, :, b:] == 0), (form, j)
            if b:
                assert torch.all(s[j, :, :b] > 0)
                # normalised over the visible blocks only
                if form == "code":
                    torch.testing.assert_close(s[j, :, :b].sum(-1), torch.ones(2))


def test_segment_representatives_partial():
    x = torch.tensor([[[1.0, -2.0]], [[3.0, 0.0]], [[-1.0, 5.0]], [[2.0, 2.0]], [[0.0, -7.0]]])  # [5, 1, 2]
    mx, mn = segment_representatives(x, 2)
    torch.testing.assert_close(mx[:, 0], torch.tensor([[3.0, 0.0], [2.0, 5.0], [0.0, -7.0]]))
    torch.testing.assert_close(mn[:, 0], torch.tensor([[1.0, -2.0], [-1.0, 2.0], [0.0, -7.0]]))


def test_fusion_by_hand():
    s, prev = torch.tensor([1.0, 2.0]), torch.tensor([4.0, 8.0])
    torch.testing.assert_close(fuse_scores(s, prev, "ema", 0.25), torch.tensor([1.75, 3.5]))     # 0.75 S + 0.25 S'
    torch.testing.assert_close(fuse_scores(s, prev, "paper", 0.25), torch.tensor([3.25, 6.5]))   # 0.25 S + 0.75 S'
    torch.testing.assert_close(fuse_scores(s, prev, "sum", 0.25), torch.tensor([4.25, 8.5]))     # 0.25 S + S'
    assert fuse_scores(s, None, "ema", 0.25) is s
    with pytest.raises(ValueError):
        fuse_scores(s, prev, "mean", 0.25)


def test_layer_fusion_state_and_reset():
    assert LayerFusion().fusion == "ema"
    f = LayerFusion("sum", 0.25)
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0])
    torch.testing.assert_close(f(a), a)                                   # first sparse layer: stored
    torch.testing.assert_close(f(b), torch.tensor([1.0, 0.25]))           # 0.25 b + a
    torch.testing.assert_close(f(c), torch.tensor([1.5, 0.75]))           # 0.25 c + fused
    f.reset()
    torch.testing.assert_close(f(c), c)
    # a new batch (other shape) resets by itself
    d = torch.ones(3)
    torch.testing.assert_close(f(d), d)
    e = LayerFusion("ema", 0.25)
    e(a)
    torch.testing.assert_close(e(b), torch.tensor([0.25, 0.75]))          # 0.75 b + 0.25 a
    off = LayerFusion(enabled=False)
    off(a)
    torch.testing.assert_close(off(b), b)


def test_select_blocks_by_hand():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.4, 0.3, 0.9]]])            # [S=1, Hkv=1, NB=6]
    sel = select_blocks(scores, torch.tensor([5]), 2)
    assert sel.dtype == torch.int32
    assert sel.tolist() == [[[1, 3]]]                    # top-2 of blocks 0..4 (block 5 is causal-masked)
    assert select_blocks(scores, torch.tensor([5]), 10).tolist() == [[[0, 1, 2, 3, 4] + [-1] * 5]]
    assert select_blocks(scores, torch.tensor([1]), 2).tolist() == [[[0, -1]]]
    assert select_blocks(scores, torch.tensor([0]), 2).tolist() == [[[-1, -1]]]
    # ties go to the lower block index
    tie = torch.tensor([[[0.0, 0.3, 0.3, 0.3, 0.1, 0.0]]])
    assert select_blocks(tie, torch.tensor([6]), 2).tolist() == [[[1, 2]]]
    # per KV head, batched leading dims
    sc = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]]).expand(2, 1, 2, 4)
    out = select_blocks(sc, torch.tensor([[4], [3]]), 1)
    assert out.tolist() == [[[[1], [3]]], [[[1], [0]]]]


def test_select_blocks_with_a_sink_by_hand():
    scores = torch.tensor([[[0.1, 0.5, 0.2, 0.4, 0.3, 0.9]]])
    assert select_blocks(scores, torch.tensor([5]), 2, sink=True).tolist() == [[[0, 1, 3]]]
    assert select_blocks(scores, torch.tensor([5]), 10, sink=True).tolist() == [[[0, 1, 2, 3, 4] + [-1] * 6]]
    assert select_blocks(scores, torch.tensor([1]), 2, sink=True).tolist() == [[[0, -1, -1]]]
    assert select_blocks(scores, torch.tensor([0]), 2, sink=True).tolist() == [[[-1, -1, -1]]]
    # the sink is kept even when it scores lowest
    tie = torch.tensor([[[0.0, 0.3, 0.3, 0.3, 0.1, 0.0]]])
    assert select_blocks(tie, torch.tensor([6]), 2, sink=True).tolist() == [[[0, 1, 2]]]


@pytest.mark.parametrize("sink", [False, True])
def test_select_never_causal_violation_random(sink):
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(7, 3, 40, generator=g)
    sb = torch.tensor([0, 1, 2, 9, 16, 33, 40])
    sel = select_blocks(scores, sb, 4, sink=sink)
    assert sel.shape[-1] == 4 + sink
    for j, b in enumerate(sb.tolist()):
        for h in range(3):
            row = sel[j, h].tolist()
            valid = [x for x in row if x >= 0]
            assert valid == sorted(valid) and all(x < b for x in valid)
            assert row[len(valid):] == [-1] * (len(row) - len(valid))
            assert len(valid) == min(b, 4 + sink)
            if b and sink:
                assert valid[0] == 0
            if b > 4 + sink:
                top = (torch.argsort(scores[j, h, int(sink):b], descending=True)[:4] + int(sink)).tolist()
                assert sorted(top) == valid[int(sink):]


def test_select_for_sequence_dense_fallbacks():
    c = cfg(segment_size=64, block_size=32, budget=64, min_len=0)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(200, 2, 16, generator=g), torch.randn(200, 1, 16, generator=g)
    r = select_for_sequence(q, k, c)
    assert r.dense.tolist() == [False, False, False, True]               # final (partial) segment dense
    r = select_for_sequence(q[:192], k[:192], c)
    assert r.dense.tolist() == [False, False, True]                      # final full segment dense too
    # min_len is where sparse segments begin: segments starting before it are dense
    r = select_for_sequence(q, k, cfg(segment_size=64, block_size=32, budget=64, min_len=128))
    assert r.dense.tolist() == [True, True, False, True]
    r = select_for_sequence(q, k, cfg(segment_size=64, block_size=32, budget=64, min_len=129))
    assert r.dense.tolist() == [True] * 4
    r = select_for_sequence(q, k, cfg(segment_size=64, block_size=32, budget=64, min_len=4096))
    assert r.dense.tolist() == [True] * 4                                # prompt shorter than min_len
    # a chunk that is not the end of the prompt: its last segment stays sparse
    r = select_for_sequence(q[:100], k[:100], c, prompt_len=200)
    assert r.dense.tolist() == [False, False]


def test_dense_layers_and_sizes():
    c = cfg(dense_layers=(0, 3))
    assert is_dense_layer(c, 0) and is_dense_layer(c, 3) and not is_dense_layer(c, 1)
    assert is_dense_layer(cfg(enabled=False), 1)
    with pytest.raises(ValueError, match="multiple"):
        check_sizes(100, 32, 64)
    with pytest.raises(ValueError, match="multiple"):
        check_sizes(128, 32, 48)
    check_sizes(512, 32, 1024)
