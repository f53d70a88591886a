"""merge_state / merge_state_in_place / merge_states vs their twins and vs attention over the
union of the segments (FlashInfer semantics, natural-log LSE)."""

import pytest
import torch

from kernel_testlib import DEVICE, DTYPES
from vllm_ext.kernels import merge_state as ms
from vllm_ext.kernels.paged_reference import attention_over


def _segments(n_q=5, hq=4, hkv=2, d=64, n_k=40, cuts=(0, 7, 7, 30, 40), dtype=torch.float32,
              seed=0):
    """Random attention problem split into consecutive KV segments (an empty one included)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(hkv, n_k, d, generator=gen).to(DEVICE)
    v = torch.randn(hkv, n_k, d, generator=gen).to(DEVICE)
    full_o, full_s = attention_over(q, k, v, 0.2)
    vs, ss = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        mask = torch.zeros(n_q, n_k, dtype=torch.bool, device=DEVICE)
        mask[:, a:b] = True
        o, s = attention_over(q, k, v, 0.2, mask)
        vs.append(o.to(dtype))
        ss.append(s)
    return full_o, full_s, vs, ss


@pytest.mark.parametrize("dtn", ["fp32", "fp16", "bf16"])
def test_merge_states_equals_attention_over_union(dtn):
    dtype = DTYPES[dtn]
    full_o, full_s, vs, ss = _segments(dtype=dtype)
    v = torch.stack(vs, dim=1)        # [N, S, H, D]
    s = torch.stack(ss, dim=1)        # [N, S, H]
    assert torch.isinf(s[:, 1]).all()  # the empty segment
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for fn in (ms.merge_states, ms.merge_states_torch):
        o, lse = fn(v, s)
        assert o.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(o.float(), full_o, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, full_s, atol=1e-5, rtol=1e-5)


def test_merge_state_pairwise_and_in_place():
    full_o, full_s, vs, ss = _segments(cuts=(0, 13, 40))
    for fn in (ms.merge_state, ms.merge_state_torch):
        o, lse = fn(vs[0], ss[0], vs[1], ss[1])
        torch.testing.assert_close(o, full_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, full_s, atol=1e-5, rtol=1e-5)
    mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool, device=DEVICE)
    for fn in (ms.merge_state_in_place, ms.merge_state_in_place_torch):
        v, s = vs[0].clone(), ss[0].clone()
        fn(v, s, vs[1], ss[1], mask)
        torch.testing.assert_close(v[mask], full_o[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[mask], full_s[mask], atol=1e-5, rtol=1e-5)
        assert torch.equal(v[~mask], vs[0][~mask]) and torch.equal(s[~mask], ss[0][~mask])
        # without a mask every row merges
        v, s = vs[0].clone(), ss[0].clone()
        fn(v, s, vs[1], ss[1])
        torch.testing.assert_close(v, full_o, atol=1e-5, rtol=1e-5)


def test_merge_all_empty_gives_zero_and_minus_inf():
    v = torch.randn(3, 4, 2, 32, device=DEVICE)
    s = torch.full((3, 4, 2), float("-inf"), device=DEVICE)
    s[2, 1, 0] = 0.5                          # one live state in row 2, head 0
    for fn in (ms.merge_states, ms.merge_states_torch):
        o, lse = fn(v, s)
        assert torch.all(o[:2] == 0) and torch.all(torch.isinf(lse[:2]))
        torch.testing.assert_close(o[2, 0], v[2, 1, 0])
        assert lse[2, 0].item() == pytest.approx(0.5)
        assert torch.all(o[2, 1] == 0)
    a, sa = ms.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert torch.all(a[:2] == 0) and not torch.isnan(a).any()


def test_merge_states_row_mask_and_many_states_strided():
    # 37 states (more than one chunk of the kernel's state loop), a strided (non-contiguous) input
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 2, 37, 3, 16, generator=gen).to(DEVICE)
    v = base[:, 1]                                    # [4, 37, 3, 16], non-contiguous
    s = (torch.randn(4, 37, 3, generator=gen) * 3).to(DEVICE)
    out = torch.full((4, 3, 16), 7.0, device=DEVICE)
    lse = torch.full((4, 3), 7.0, device=DEVICE)
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.int8, device=DEVICE)
    ms.merge_states(v, s, out=out, out_lse=lse, row_mask=mask)
    w = torch.softmax(s, dim=1)
    exp = (w.unsqueeze(-1) * v).sum(1)
    on = mask.bool()
    torch.testing.assert_close(out[on], exp[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[on], torch.logsumexp(s, 1)[on], atol=1e-5, rtol=1e-5)
    assert torch.all(out[~on] == 7.0) and torch.all(lse[~on] == 7.0)
