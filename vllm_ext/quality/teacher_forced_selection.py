"""Which decode-time selection could answer? (offline, Hugging Face model, teacher forcing, no vLLM)

For one task sample the model reads the prompt and the expected answer in one forward (teacher
forcing). The prompt's rows attend densely (the prefill is dense in SPEEDSFI); every answer row
attends, in every layer and KV head, to sink + its selection + the recent window, with the selection
made from that row's own query (a selection at every step, as ``sfi.selector: quest`` with
``refresh`` 1):

- ``--rerank 0``: Quest: pages of ``--page-size`` tokens ranked by the bound
  ``scale * sum_d max(q_d kmax_d, q_d kmin_d)`` (max over the GQA group), ``k`` tokens in page order;
- ``--rerank r``: ``sfi.quest_rerank``: the first ``r * k`` tokens in page order are candidates, and
  the ``k`` with the largest group attention mass over the candidates are kept;
- ``--rerank all``: the oracle of that criterion: every allowed position is a candidate.

A sample counts as answered when the argmax at every answer position is the expected token. The
``keep_prefill`` kept set is not simulated. It is the harness behind bench/QUALITY.md, "Exact
scores of the Quest candidates":

    python -m vllm_ext.quality.teacher_forced_selection --model models/retrieval-llama \\
        --task niah_multivalue --k 320 --page-size 16 --rerank all

``--explain DEPTH SEED STEP`` prints, for one answer step, each query head's dense attention mass
inside its selection, its best keys (``X``: not selected) and the bound rank of that key's page.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    k: int
    page_size: int = 16
    rerank: int | None = 0        # None: every allowed position is a candidate (the oracle)
    n_sink: int = 4
    n_recent: int = 64


def page_bounds(q: torch.Tensor, keys: torch.Tensor, page: int, scale: float) -> torch.Tensor:
    """Quest's bound per page: ``q [Hkv, G, D]``, ``keys [Hkv, T, D]`` -> ``[Hkv, ceil(T / page)]``."""
    hkv, t, d = keys.shape
    nb = -(-t // page)
    pad = nb * page - t
    kp = torch.nn.functional.pad(keys, (0, 0, 0, pad)).reshape(hkv, nb, page, d)
    valid = (torch.arange(nb * page) < t).reshape(1, nb, page, 1)
    kmax = torch.where(valid, kp, float("-inf")).amax(2)
    kmin = torch.where(valid, kp, float("inf")).amin(2)
    ub = torch.maximum(q[:, :, None] * kmax[:, None], q[:, :, None] * kmin[:, None]).sum(-1) * scale
    return ub.amax(1)


def _top(score: torch.Tensor, n: int) -> torch.Tensor:
    """Per row the ``n`` best positions, ties to the lower position (as the selector)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :n]


def select_row(q: torch.Tensor, keys: torch.Tensor, sel: Selection, scale: float) -> torch.Tensor:
    """The mask ``[Hkv, T]`` of one answer row (``T`` = its keys, the newest last)."""
    hkv, t, _ = keys.shape
    lo, hi = sel.n_sink, t - sel.n_recent
    mask = torch.zeros(hkv, t, dtype=torch.bool)
    mask[:, :min(lo, t)] = True
    mask[:, max(hi, 0):] = True
    if hi <= lo:
        return mask
    pos = torch.arange(t)
    allowed = (pos >= lo) & (pos < hi)
    if sel.rerank is None:
        order = torch.where(allowed, 0.0, float("-inf")).expand(hkv, t)
        n_cand = int(allowed.sum())
    else:
        order = page_bounds(q, keys, sel.page_size, scale)[:, pos // sel.page_size]
        order = torch.where(allowed, order, float("-inf"))
        n_cand = sel.k * sel.rerank if sel.rerank else sel.k
    cand = _top(order, min(n_cand, int(allowed.sum())))                 # [Hkv, C]
    if sel.rerank == 0:
        chosen = cand
    else:
        logits = torch.einsum("hgd,hcd->hgc", q, torch.gather(keys, 1, cand[..., None].expand(-1, -1, keys.shape[2])))
        mass = torch.logsumexp(torch.log_softmax(logits * scale, dim=-1), dim=1)    # [Hkv, C]
        # ties to the lower position: candidates in ascending position order first
        asc = torch.sort(cand, dim=-1).values
        mass = torch.gather(mass, 1, torch.argsort(cand, dim=-1))
        chosen = torch.gather(asc, 1, _top(mass, min(sel.k, asc.shape[1])))
    mask.scatter_(1, chosen, True)
    return mask


class _SparseAnswerRows:
    """Patches the eager attention of Llama / Qwen3 so rows ``>= prompt_len`` attend to their selection."""

    def __init__(self, prompt_len: int, sel: Selection | None):
        self.prompt_len, self.sel = prompt_len, sel
        self.records: dict[int, dict] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        from transformers.models.llama.modeling_llama import repeat_kv

        _, hq, t, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        logits = torch.matmul(query, repeat_kv(key, g).transpose(2, 3)) * scaling
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None].repeat(hq, 1, 1)
        dense = torch.softmax(logits.masked_fill(~allowed[None], float("-inf")).float(), -1)
        if self.sel is not None:
            for row in range(self.prompt_len, t):
                m = select_row(query[0, :, row].reshape(hkv, g, d).float(), key[0, :, :row + 1].float(),
                               self.sel, scaling)
                allowed[:, row, :row + 1] = m.repeat_interleave(g, 0)
        probs = torch.softmax(logits.masked_fill(~allowed[None], float("-inf")).float(), -1)
        self.records[module.layer_idx] = dict(dense=dense[0], allowed=allowed, query=query[0], key=key[0],
                                              scale=scaling)
        return torch.matmul(probs.to(value.dtype), repeat_kv(value, g)).transpose(1, 2).contiguous(), probs


@contextlib.contextmanager
def _patched(fn):
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    old = llama.eager_attention_forward, qwen3.eager_attention_forward
    llama.eager_attention_forward = qwen3.eager_attention_forward = fn
    try:
        yield
    finally:
        llama.eager_attention_forward, qwen3.eager_attention_forward = old


def answer_logits(model, sample, sel: Selection | None) -> tuple[torch.Tensor, dict]:
    """Logits at the answer positions ``[len(answer), vocab]`` (row ``i`` predicts answer token ``i``)
    and the per-layer attention records; ``sel`` None = dense."""
    ids = list(sample.prompt_ids) + list(sample.answer_ids)
    n = len(sample.prompt_ids)
    attn = _SparseAnswerRows(n, sel)
    with _patched(attn), torch.no_grad():
        out = model(input_ids=torch.tensor([ids[:-1]]))
    return out.logits[0, n - 1:], attn.records


def answered(model, sample, sel: Selection | None) -> list[int]:
    """The answer positions whose argmax is not the expected token (empty: answered)."""
    logits, _ = answer_logits(model, sample, sel)
    want = torch.tensor(sample.answer_ids)
    return torch.nonzero(logits.argmax(-1) != want).flatten().tolist()


def explain(model, sample, sel: Selection, step: int, words) -> None:
    n = len(sample.prompt_ids)
    ids = list(sample.prompt_ids) + list(sample.answer_ids)
    dense, _ = answer_logits(model, sample, None)
    sparse, records = answer_logits(model, sample, sel)
    row = n - 1 + step
    print(f"answer so far: {' '.join(words(ids[n:row + 1]))} | expected {words([ids[row + 1]])}")
    print(f"dense top {words(dense[step].topk(3).indices.tolist())}  sparse top "
          f"{words(sparse[step].topk(3).indices.tolist())}")
    for layer, r in sorted(records.items()):
        hq = r["dense"].shape[0]
        hkv = r["key"].shape[0]
        g = hq // hkv
        keys = r["key"][:, :row + 1].float()
        q = r["query"][:, row].reshape(hkv, g, -1).float()
        bounds = page_bounds(q, keys, sel.page_size, r["scale"])
        for h in range(hq):
            p = r["dense"][h, row, :row + 1]
            m = r["allowed"][h, row, :row + 1]
            top = p.topk(3)
            best = int(top.indices[0])
            b = bounds[h // g]
            rank = int((b > b[best // sel.page_size]).sum())
            logit = float(q[h // g, h % g] @ keys[h // g, best]) * r["scale"]
            items = "  ".join(f"{j}:{words([ids[j]])[0]}:{v:.2f}{'' if m[j] else 'X'}"
                              for v, j in zip(top.values.tolist(), top.indices.tolist()))
            print(f"L{layer} q{h}: mass in selection {float((p * m).sum()):.2f} | {items} | page of the "
                  f"best key: bound {float(b[best // sel.page_size]):.1f} (its logit {logit:.1f}), rank "
                  f"{rank} of {b.numel()}; median page bound {float(b.median()):.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/retrieval-llama")
    p.add_argument("--filler", default="plain", help="plain (retrieval-llama) or prose (retrieval-qwen3)")
    p.add_argument("--task", default="niah_multivalue")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--per-cell", type=int, default=3, help="seeds 0..n-1 at depths 0, .25, .5, .75, 1")
    p.add_argument("--k", type=int, default=320)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rerank", default="0", help="0 (Quest), r (quest_rerank) or 'all' (the oracle)")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-recent", type=int, default=64)
    p.add_argument("--explain", nargs=3, metavar=("DEPTH", "SEED", "STEP"), default=None)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from vllm_ext.quality import tasks as T

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    sel = Selection(k=args.k, page_size=args.page_size, rerank=None if args.rerank == "all" else int(args.rerank),
                    n_sink=args.n_sink, n_recent=args.n_recent)
    if args.explain:
        depth, seed, step = float(args.explain[0]), int(args.explain[1]), int(args.explain[2])
        explain(model, T.make_sample(args.task, args.length, depth, seed, filler=args.filler), sel, step,
                T.words_of)
        return None
    samples = T.make_suite([args.task], [args.length], [0, 0.25, 0.5, 0.75, 1], args.per_cell, seed=0,
                           filler=args.filler)
    result = {}
    for name, s_ in (("dense", None), (f"k {sel.k}, page {sel.page_size}, rerank {args.rerank}", sel)):
        wrong = {(s.depth, s.seed): answered(model, s, s_) for s in samples}
        ok = sum(not w for w in wrong.values())
        result[name] = ok
        misses = ", ".join(f"depth {d} seed {e} at {w[0]}" for (d, e), w in wrong.items() if w)
        print(f"{name}: {ok}/{len(samples)} answered" + (f" (missed: {misses})" if misses else ""), flush=True)
    return result


if __name__ == "__main__":
    main()
