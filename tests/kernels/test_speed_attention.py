"""SPEED upper-layer attention: Triton kernel (interpreter on CPU) and PyTorch twin against a
dense-mask reference of the visibility rule, over prefill chunks, decode rows, interior prompt
queries, both anchors and both variants. Interior positions hold NaN: a kernel that reads them fails."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import (DEVICE, DTYPES, FP8, FP8_CASES, assert_close_out, dequantize_pages,
                            fp8_case_id, fp8_scales, make_block_table, make_kv_cache, quantize_pages)

from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.kernels.speed_attention import speed_attention, speed_attention_torch
from vllm_ext.methods.speed.visibility import visible_mask

# (prompt_len, first query position, number of queries): a final prefill chunk reaching P - 1, a
# whole prompt, decode rows, a chunk of interior prompt tokens only, a one-token prompt
ROWS = [(40, 32, 8), (21, 0, 21), (50, 57, 1), (19, 19, 1), (70, 10, 12), (1, 0, 1), (33, 35, 3)]


def _case(dtype, layout, gen, bs=16, hq=4, hkv=2, d=32):
    seq_lens = [start + n for _, start, n in ROWS]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    kv = make_kv_cache(layout, num_blocks, hkv, bs, d, dtype, gen=gen)
    bt = make_block_table(seq_lens, bs, max_blocks, num_blocks, gen).to(DEVICE)
    token_row, positions = [], []
    for r, (_, start, n) in enumerate(ROWS):
        token_row += [r] * n
        positions += list(range(start, start + n))
    n_tok = len(positions)
    query = torch.randn(n_tok, hq, d, generator=gen).to(dtype).to(DEVICE)
    tail = torch.tensor([max(p - 1, 0) for p, _, _ in ROWS], dtype=torch.int32, device=DEVICE)
    return kv, bt, query, torch.tensor(token_row, device=DEVICE), \
        torch.tensor(positions, device=DEVICE), tail, seq_lens


def _poison_interior(kv, bt, anchor_end):
    """NaN into every interior prompt position (the upper layers' null block in vLLM)."""
    bs = kv.shape[2]
    for r, (p, start, n) in enumerate(ROWS):
        for pos in range(anchor_end, min(max(p - 1, anchor_end), start + n)):
            kv[bt[r, pos // bs].long(), :, pos % bs] = float("nan")


def _reference(query, kv, bt, token_row, positions, prompt_lens, anchor_end, self_only, scale):
    out = torch.zeros(query.shape, dtype=torch.float32)
    tr, pos = token_row.tolist(), positions.tolist()
    for t, (r, p) in enumerate(zip(tr, pos)):
        kpos = torch.arange(p + 1, device=DEVICE)
        mask = visible_mask(torch.tensor([p], device=DEVICE), kpos, prompt_lens[r], anchor_end,
                            self_only)
        if not bool(mask.any()):
            continue
        vis = kpos[mask[0]]
        k, v = gather_kv(kv, bt[r], vis)
        o, _ = attention_over(query[t:t + 1], k, v, scale)
        out[t] = o[0].cpu()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("anchor_end,self_only", [(1, False), (0, False), (1, True)])
def test_speed_attention_matches_visibility_reference(dtype, layout, anchor_end, self_only):
    gen = torch.Generator().manual_seed(7)
    kv, bt, query, token_row, positions, tail, _ = _case(dtype, layout, gen)
    _poison_interior(kv, bt, anchor_end)
    scale = 32 ** -0.5
    prompt_lens = [p for p, _, _ in ROWS]
    ref = _reference(query, kv, bt, token_row, positions, prompt_lens, anchor_end, self_only, scale)
    assert torch.isfinite(ref).all()
    for fn in (speed_attention, speed_attention_torch):
        out = torch.full_like(query, 5.0)
        fn(query, kv, bt, token_row, positions, tail, anchor_end, self_only, scale, out)
        assert torch.isfinite(out.float()).all(), fn.__name__
        assert_close_out(out, ref, dtype, what=f"{fn.__name__} anchor {anchor_end} self {self_only}")


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_speed_attention_fp8_pages(case):
    """fp8 pages with the layer's scales (interior positions NaN, as stored): kernel and twin
    against the visibility reference over the dequantised pages."""
    fmt, ks, vs, qdt = case
    gen = torch.Generator().manual_seed(11)
    kv, bt, query, token_row, positions, tail, _ = _case(torch.float32, "LBNHC", gen)
    _poison_interior(kv, bt, 1)
    kv8 = quantize_pages(kv, FP8[fmt], ks, vs)
    kv_ref = dequantize_pages(kv8, ks, vs)
    query = query.to(DTYPES[qdt])
    k_scale, v_scale = fp8_scales(ks, vs)
    scale = 32 ** -0.5
    ref = _reference(query, kv_ref, bt, token_row, positions, [p for p, _, _ in ROWS], 1, False, scale)
    for fn in (speed_attention, speed_attention_torch):
        out = torch.full_like(query, 5.0)
        fn(query, kv8, bt, token_row, positions, tail, 1, False, scale, out, k_scale=k_scale,
           v_scale=v_scale)
        assert_close_out(out, ref, query.dtype, what=fn.__name__)


def test_speed_attention_differs_from_causal():
    """The rule changes the result where it should (a decode row with a long prompt)."""
    gen = torch.Generator().manual_seed(3)
    kv, bt, query, token_row, positions, tail, seq_lens = _case(torch.float32, "LBHNC", gen)
    out = torch.zeros_like(query)
    speed_attention(query, kv, bt, token_row, positions, tail, 1, False, 0.2, out)
    t = positions.tolist().index(57)                      # decode row of the 50-token prompt
    k, v = gather_kv(kv, bt[2], torch.arange(58, device=DEVICE))
    causal, _ = attention_over(query[t:t + 1], k, v, 0.2)
    assert (out[t].float().cpu() - causal[0].cpu()).abs().max() > 1e-3
