"""One layer of SFI decode (``vllm_ext.methods.sfi.path``) against an independent reference: a slow
step makes the selection the selector defines from dense evidence, and the next fast step equals
dense attention restricted to S ∪ M_h ∪ R_t. Runs the PyTorch twins on CPU (and the Triton kernels
with the side stream on CUDA)."""

import pytest
import torch

from vllm_ext.methods.sfi.path import sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.kernels import sfi_selector_torch as ref_selector
from vllm_ext.methods.sfi.selector_params import selector_params
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers, write_plan

HAS_CUDA = torch.cuda.is_available()


def _paged(seq_lens, hkv, bs, d, gen, device):
    nb = sum(-(-n // bs) for n in seq_lens) + 4
    kv = torch.randn(nb, bs, hkv, 2 * d, generator=gen).to(device).transpose(1, 2)   # LBNHC strides
    perm = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(seq_lens), max(-(-n // bs) for n in seq_lens) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        k = -(-n // bs) + 1
        bt[i, :k] = perm[used:used + k].to(torch.int32)
        used += k
    return kv, bt.to(device)


def forced_plan(buffers, t, slow, fast, cfg, slots, block_table, device):
    """A plan with the given row modes (the schedule is tested elsewhere)."""
    t = torch.tensor(t, dtype=torch.int32, device=device)
    slow = torch.tensor(slow, device=device)
    fast = torch.tensor(fast, device=device)
    sparse = slow | fast
    lo = torch.full_like(t, cfg.n_sink)
    hi = torch.clamp(t - cfg.n_recent, min=cfg.n_sink)
    return write_plan(buffers, t.shape[0], slow=slow, fast=fast, sparse=sparse,
                      row_sfi_slot=torch.where(sparse, torch.tensor(slots, dtype=torch.int32,
                                                                    device=device), 0),
                      k=torch.full_like(t, cfg.k), recent_start=torch.clamp(t - cfg.n_recent, min=0),
                      lo=lo, hi=hi, t=t, block_table=block_table)


@pytest.mark.parametrize("device, dual", [("cpu", False)] + ([("cuda", True), ("cuda", False)] if HAS_CUDA else []))
@pytest.mark.parametrize("g", [1, 4])
def test_slow_then_fast_equals_restricted_dense(device, dual, g):
    gen = torch.Generator().manual_seed(g)
    device = torch.device(device)
    cfg = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, dual_stream=dual)
    hkv, d, bs = 2, 32, 16
    hq = hkv * g
    t0 = [130, 96, 161]                          # block boundary +1 (161 = 10*16+1), odd lengths
    kv, bt = _paged([n + 1 for n in t0], hkv, bs, d, gen, device)
    scale = d ** -0.5
    layer = SfiLayerBuffers(4, hkv, cfg, d, torch.float32, device)
    rt = SfiRuntime(cfg, capacity=4, max_rows=3, num_heads=hq, num_kv_heads=hkv, head_size=d,
                    max_len=256, device=device)
    buffers = SfiPlanBuffers(3, 4, device)
    slots = [2, 0, 3]

    # slow step at t0: output = dense; selection from dense evidence restricted to A = [4, t0 - 16)
    q0 = torch.randn(3, hq, d, generator=gen).to(device)
    out0 = torch.zeros_like(q0)
    plan0 = forced_plan(buffers, t0, [True] * 3, [False] * 3, cfg, slots, bt, device)
    seq0 = torch.tensor(t0, dtype=torch.int32, device=device)
    sfi_decode(q0, kv, bt, seq0, plan0, cfg, layer, rt, 0, scale, out0, dense_done=False)
    rt.ring.join()
    expected_sel = []
    for r, t in enumerate(t0):
        k, v = gather_kv(kv, bt[r], torch.arange(t, device=device))
        ref, _ = attention_over(q0[r:r + 1], k, v, scale)
        torch.testing.assert_close(out0[r:r + 1], ref, atol=2e-4, rtol=2e-4)
        # independent evidence: per query head, softmax over A only; pooled by the selector module
        lo, hi = cfg.n_sink, t - cfg.n_recent
        kk = k.float().repeat_interleave(g, 0)                                   # [Hq, t, D]
        logits = torch.einsum("hd,htd->ht", q0[r].float(), kk) * scale
        logp = torch.full((hq, 256), float("-inf"), device=device)
        logp[:, lo:hi] = torch.log_softmax(logits[:, lo:hi], dim=-1)
        evidence = logp.reshape(hkv, g, 256)[None]                               # [1, Hkv, G, L]
        norms = torch.ones(1, hkv, 256, device=device)
        norms[0, :, :t] = k.float().norm(dim=-1)
        sel, n_sel = ref_selector.select(evidence, norms, torch.tensor([lo], device=device),
                                         torch.tensor([hi], device=device), selector_params(cfg), cfg.k)
        expected_sel.append([sorted(sel[0, h, : int(n_sel[0])].tolist()) for h in range(hkv)])
        # the compact segment holds sink + exactly those entries
        n = int(layer.compact_len[slots[r]])
        assert n == cfg.n_sink + min(cfg.k, hi - lo)
        for h in range(hkv):
            pos = torch.tensor(list(range(cfg.n_sink)) + expected_sel[r][h], device=device)
            kh, vh = gather_kv(kv, bt[r], pos)
            torch.testing.assert_close(layer.compact_kv[slots[r], h, :n, :d], kh[h])
            torch.testing.assert_close(layer.compact_kv[slots[r], h, :n, d:], vh[h])

    # fast step at t0 + 1: attention over S ∪ M_h ∪ R_t only
    t1 = [n + 1 for n in t0]
    q1 = torch.randn(3, hq, d, generator=gen).to(device)
    out1 = torch.full_like(q1, 7.0)
    plan1 = forced_plan(buffers, t1, [False] * 3, [True] * 3, cfg, slots, bt, device)
    sfi_decode(q1, kv, bt, torch.tensor(t1, dtype=torch.int32, device=device), plan1, cfg, layer,
               rt, 1, scale, out1, dense_done=False)
    rt.ring.join()
    for r, t in enumerate(t1):
        k, v = gather_kv(kv, bt[r], torch.arange(t, device=device))
        mask = torch.zeros(1, hq, t, dtype=torch.bool, device=device)
        for h in range(hkv):
            visible = list(range(cfg.n_sink)) + expected_sel[r][h] + list(range(t - cfg.n_recent, t))
            mask[0, h * g:(h + 1) * g, visible] = True
        ref, _ = attention_over(q1[r:r + 1], k, v, scale, mask)
        torch.testing.assert_close(out1[r:r + 1], ref, atol=2e-4, rtol=2e-4)
        dense, _ = attention_over(q1[r:r + 1], k, v, scale)
        assert not torch.allclose(out1[r:r + 1], dense, atol=1e-3)      # sparse really differs
