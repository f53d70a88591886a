"""``vllm_ext.quality.teacher_forced_selection``: the offline harness behind the Quest-candidate
analysis in bench/QUALITY.md. Its selection of one answer row against brute force (Quest page order,
candidates by group attention mass, the oracle), and on the committed model a budget covering every
allowed set gives the dense logits."""

import os

import pytest
import torch

from vllm_ext.quality.teacher_forced_selection import Selection, answer_logits, select_row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "retrieval-llama")


def _brute(q, keys, sel, scale):
    hkv, t, _ = keys.shape
    lo, hi = sel.n_sink, t - sel.n_recent
    out = []
    for h in range(hkv):
        bounds = []
        for p in range(-(-t // sel.page_size)):
            kp = keys[h, p * sel.page_size:(p + 1) * sel.page_size].double()
            bounds.append(max(float(torch.maximum(qg.double() * kp.max(0).values,
                                                  qg.double() * kp.min(0).values).sum()) * scale for qg in q[h]))
        order = [j for p in sorted(range(len(bounds)), key=lambda p: (-bounds[p], p))
                 for j in range(p * sel.page_size, min((p + 1) * sel.page_size, t)) if lo <= j < hi]
        if sel.rerank is None:
            cand = list(range(lo, hi))
        else:
            cand = order[:sel.k * (sel.rerank or 1)]
        if sel.rerank == 0:
            chosen = cand
        else:
            p = torch.softmax((q[h].double() @ keys[h, cand].double().T) * scale, dim=-1).sum(0)
            chosen = sorted(cand, key=lambda j: (-float(p[cand.index(j)]), j))[:sel.k]
        out.append(set(chosen) | set(range(lo)) | set(range(hi, t)))
    return out


@pytest.mark.parametrize("rerank", [0, 2, None])
@pytest.mark.parametrize("g", [1, 3])
def test_one_row_selection_equals_brute_force(rerank, g):
    gen = torch.Generator().manual_seed(g + 10 * (rerank or 7))
    keys = torch.randn(2, 90, 8, generator=gen)
    q = torch.randn(2, g, 8, generator=gen) * 2
    sel = Selection(k=12, page_size=4, rerank=rerank, n_sink=3, n_recent=10)
    mask = select_row(q, keys, sel, 0.4)
    want = _brute(q, keys, sel, 0.4)
    for h in range(2):
        assert set(torch.nonzero(mask[h]).flatten().tolist()) == want[h], f"head {h}"
        assert int(mask[h].sum()) == 3 + 12 + 10


def test_budget_covering_the_allowed_set_is_dense():
    from transformers import AutoModelForCausalLM

    from vllm_ext.quality import tasks as T

    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager", dtype=torch.float32).eval()
    sample = T.make_sample("niah_single", 512, 0.5, 0)
    assert len(sample.answer_ids) >= 4
    dense, _ = answer_logits(model, sample, None)
    for rerank in (0, 4, None):
        sparse, records = answer_logits(model, sample, Selection(k=512, page_size=16, rerank=rerank))
        torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=1e-4)
    small, records = answer_logits(model, sample, Selection(k=64, page_size=16, rerank=4))
    assert not torch.allclose(small, dense, atol=1e-3)
    n = len(sample.prompt_ids)
    # an answer row attends to sink + k + recent of its keys; prompt rows are causal and dense
    allowed = records[0]["allowed"]
    assert int(allowed[0, n + 3].sum()) == 4 + 64 + 64
    assert int(allowed[0, n - 2].sum()) == n - 1
