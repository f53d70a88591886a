"""``sfi.quest_rerank``: Quest's best pages by bound give candidates, their group attention chooses.

The reference is a brute force on top of the brute-force Quest of ``test_quest.py``: the candidates
are the first ``r * k`` allowed tokens (the kept ones left out) in descending page-bound order
(ties: lower page first, then lower position); each candidate's
score is the group's attention mass on it over the candidates, ``sum_g softmax_cand(s_g)_j`` with
``s_gj = scale * q_g . k_j`` for the query heads of the KV head's group; the selection is the ``k``
best candidates (ties: lower position); the output is softmax attention over sink + selection +
kept + recent. It checks:
- the candidate-evidence kernel (twin, and Triton under ``TRITON_INTERPRET=1``) against the direct
  formula, with unused entries, entries past the count, ``-1`` padding and positions past ``hi``
  untouched;
- the SFI layer path in quest mode with ``quest_rerank`` (with and without ``keep_prefill``) over a
  selection step and a fast step that reads it, on the twins and on the Triton kernels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.sfi.test_quest import D, DENSE, FAST, HKV, PAD, SLOW, brute_quest, make_cache, quest_plan
from vllm_ext.methods.sfi.path import quest_prefill_pages, sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.config import ConfigError
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.kernels.quest_rerank import quest_candidate_evidence_torch, quest_candidate_evidence_triton
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton
from vllm_ext.methods.sfi.slot_tables import QuestPrefillPages
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

INTERPRETER = HAS_TRITON and use_triton(torch.device("cpu"))


def brute_rerank(q, kv, bt_row, t, cfg, scale, k, kept=None):
    """Output ``[Hq, D]`` and the selected positions per KV head of one selection row: the candidates
    are brute-force Quest's ``r * k`` tokens, the ``k`` with the largest group mass are kept."""
    _, cands = brute_quest(q, kv, bt_row, t, cfg, scale, cfg.quest_rerank * k, kept=kept)
    keys, _ = gather_kv(kv, bt_row, torch.arange(t))                          # [H, t, D]
    g = q.shape[0] // HKV
    sels = []
    for h, cand in enumerate(cands):
        logits = (q[h * g:(h + 1) * g].double() @ keys[h, cand].double().T) * scale   # [g, |cand|]
        mass = torch.softmax(logits, dim=-1).sum(0)
        score = {j: float(mass[i]) for i, j in enumerate(cand)}
        sels.append(sorted(sorted(cand, key=lambda j: (-score[j], j))[:k]))
    out, _ = brute_quest(q, kv, bt_row, t, cfg, scale, k, sel_from=sels, kept=kept)
    return out, sels


def test_config_quest_rerank_needs_the_quest_selector():
    SfiConfig(enabled=True, selector="quest", page_size=8, k=32, quest_rerank=2).validate()
    with pytest.raises(ConfigError, match="quest_rerank"):
        SfiConfig(enabled=True, k=32, quest_rerank=2).validate()
    with pytest.raises(ConfigError, match="quest_rerank"):
        SfiConfig(enabled=True, selector="quest", page_size=8, k=32, quest_rerank=-1).validate()
    with pytest.raises(ConfigError, match="quest_rerank"):
        SfiConfig(enabled=True, selector="quest", page_size=8, k=32, quest_rerank=17).validate()


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("g, d, width", [(1, 16, 6), (4, 16, 150), (3, 24, 100)])   # 1, 3 and 2 tiles
def test_candidate_evidence_equals_the_formula(kernel, g, d, width):
    if kernel == "triton" and not INTERPRETER:
        pytest.skip("needs the Triton interpreter")
    fn = quest_candidate_evidence_torch if kernel == "twin" else quest_candidate_evidence_triton
    gen = torch.Generator().manual_seed(g * 7 + d)
    hkv, bs, per_row = 2, 8, 40
    nblocks = 4 * per_row + 3
    length = per_row * bs + 5
    kv = torch.randn(nblocks, bs, hkv, 2 * d, generator=gen).transpose(1, 2)   # strided, as vLLM's view
    bt = torch.randperm(nblocks, generator=gen)[:4 * per_row].reshape(4, per_row).to(torch.int32)
    q = torch.randn(3, hkv * g, d, generator=gen) * 2
    rows = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    hi = torch.tensor([250, 300, 260, 280], dtype=torch.int32)
    cand = torch.empty((4, hkv, width), dtype=torch.int32)
    for e in range(4):                        # distinct positions per (entry, head), as a top-K gives
        for h in range(hkv):
            cand[e, h] = torch.randperm(240, generator=gen)[:width].to(torch.int32)
    cand[0, :, width - 3:] = -1               # padding past the selector's n_sel
    n_cand = torch.tensor([width - 3, width, width - 1, width], dtype=torch.int32)   # entry 2: one short
    count = torch.tensor([3], dtype=torch.int32)             # entry 3 is past the count
    out = torch.full((4, hkv, length), 7.0)
    fn(q, kv, bt, rows, cand, n_cand, hi, 0.3, out, count=count)
    assert torch.all(out[1] == 7.0) and torch.all(out[3] == 7.0), "an unused entry was written"
    for e in (0, 2):
        r = int(rows[e])
        assert torch.all(out[e, :, int(hi[e]):] == 7.0), "positions >= hi were written"
        keys, _ = gather_kv(kv, bt[e], torch.arange(per_row * bs))
        for h in range(hkv):
            want = torch.full((int(hi[e]),), float("-inf"))
            js = [int(j) for j in cand[e, h, :int(n_cand[e])] if j >= 0]
            p = torch.softmax((q[r, h * g:(h + 1) * g].double() @ keys[h, js].double().T) * 0.3, dim=-1)
            want[js] = torch.log(p.sum(0)).float()
            torch.testing.assert_close(out[e, h, :int(hi[e])], want, atol=1e-5, rtol=1e-5)


def _run_layer(kernels, keep):
    g, page, r = 2, 8, 2
    cfg = SfiConfig(enabled=True, selector="quest", page_size=page, k=24, k_min=4, n_sink=4, n_recent=10,
                    quest_rerank=r, keep_prefill=keep)
    lens = [100, 131, 58]
    slots = [1, 0, 2]
    gen = torch.Generator().manual_seed(5 + keep)
    kv, bt = make_cache([n + 4 for n in lens], gen, extra=4)
    scale = D ** -0.5
    hq = HKV * g
    max_len = max(lens) + 8
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    results = []
    with ctx:
        layer = SfiLayerBuffers(3, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=hq,
                                max_len=max_len)
        rt = SfiRuntime(cfg, capacity=3, max_rows=3, num_heads=hq, num_kv_heads=HKV, head_size=D,
                        max_len=max_len, device=torch.device("cpu"))
        assert rt.candidate_workspace is not None and rt.candidate_workspace.width == r * cfg.k
        buffers = SfiPlanBuffers(3, 3, torch.device("cpu"))
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.arange(3), seq_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32),
            first_page=torch.zeros(3, dtype=torch.int32), sfi_slot=torch.tensor(slots, dtype=torch.int32),
            max_pages=-(-max(lens) // page)), cfg, layer)
        kept = None
        if keep:
            # a prefill end kept `keep` positions per slot (the compact entries after the sink)
            pos = torch.arange(cfg.n_sink + 1, cfg.n_sink + 1 + 5 * keep, 5, dtype=torch.int32)
            layer.kept_pos.copy_(pos.expand_as(layer.kept_pos))
            for s_ in range(3):
                r_ = slots.index(s_)
                keys, vals = gather_kv(kv, bt[r_], pos.long())
                layer.compact_kv[s_, :, cfg.n_sink:cfg.n_sink + keep] = torch.cat([keys, vals], -1)
            kept = [set(pos.tolist())] * HKV
        prev = {}
        for i, modes in enumerate([[SLOW, SLOW, DENSE], [FAST, SLOW, PAD]]):
            cur = [n + i for n in lens]
            plan, t = quest_plan(buffers, cfg, modes, cur, slots, bt)
            if keep:
                live = plan.slow_sfi_slot >= 0
                plan.slow_kept.copy_(torch.where(live, keep, 0))
                plan.slow_k.sub_(plan.slow_kept)
            q = torch.randn(3, hq, D, generator=gen)
            out = torch.full_like(q, 7.0)
            sfi_decode(q, kv, bt, t, plan, cfg, layer, rt, 0, scale, out, dense_done=False)
            for row, m in enumerate(modes):
                if m == PAD:
                    assert torch.all(out[row] == 7.0)
                    continue
                if m == DENSE:
                    keys, vals = gather_kv(kv, bt[row], torch.arange(cur[row]))
                    ref = attention_over(q[row][None], keys, vals, scale)[0][0]
                elif m == SLOW:
                    ref, prev[row] = brute_rerank(q[row], kv, bt[row], cur[row], cfg, scale, cfg.k - keep,
                                                  kept=kept)
                else:                             # a fast row reads the previous selection
                    ref, _ = brute_quest(q[row], kv, bt[row], cur[row], cfg, scale, cfg.k, sel_from=prev[row],
                                         kept=kept)
                torch.testing.assert_close(out[row], ref, atol=2e-4, rtol=2e-4, msg=f"step {i} row {row} ({m})")
                results.append(out[row].clone())
    return results


@pytest.mark.parametrize("kernels", ["twins", "triton"])
@pytest.mark.parametrize("keep", [0, 6])
def test_layer_path_equals_brute_force_rerank(kernels, keep):
    if kernels == "triton" and not INTERPRETER:
        pytest.skip("needs the Triton interpreter")
    _run_layer(kernels, keep)
