"""Which needle tokens would SFI's first selection keep? (offline, Hugging Face model, no vLLM)

For one task sample it runs the model densely (eager attention), takes each layer's attention of the
prompt's last ``w_prefill`` queries as the evidence (exactly what the prefill's end hands to SFI),
runs the reference selector (:func:`vllm_ext.kernels.sfi_selector_torch.select`) with the given budget, and prints,
per layer and KV head, whether each token of the target needle (key words, ``is``/``=``, value
digits, terminator) is selected, with its rank among the allowed positions (0 = best).

    python -m vllm_ext.quality.selection_probe --model models/retrieval-llama \\
        --task niah_single --length 2048 --depth 0.5 --k 256 --n-recent 64

It explains results of ``scripts/eval_quality.py``: a value copied token by token needs its later
tokens in the selected memory on fast steps, while the evidence points at the key and the first value
token.
"""

from __future__ import annotations

import argparse
import json


def probe(model, sample, sfi_cfg, needles: str = "first") -> list[dict]:
    import torch

    from vllm_ext.kernels.sfi_selector_torch import select, selector_scores
    from vllm_ext.methods.sfi.selector_params import selector_params

    ids = torch.tensor([sample.prompt_ids])
    t = ids.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    cfg = model.config
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    g, w = hq // hk, sfi_cfg.w_prefill
    spans = sample.target_spans if needles == "all" else sample.target_spans[:1]
    # the needle from its third word (key words .. terminator); "whole": every word of it
    targets = [list(range(a if needles == "all" or sample.task == "kv_lookup" else a + 3, b)) for a, b in spans]
    lo = torch.tensor([sfi_cfg.n_sink])
    hi = torch.tensor([t - sfi_cfg.n_recent])
    rows = []
    for li, att in enumerate(out.attentions):
        layer = model.model.layers[li]
        with torch.no_grad():
            h = layer.input_layernorm(out.hidden_states[li])
            knorm = layer.self_attn.k_proj(h).view(1, t, hk, d).norm(dim=-1).permute(0, 2, 1)
        probs = att[0, :, t - w:, :]                                   # [Hq, W, T]
        ev = torch.log(probs.clamp_min(0)).reshape(hk, g * w, t)[None]  # q heads of a group together
        k = sfi_cfg.keep_prefill or sfi_cfg.k       # with keep_prefill: the set kept for the decode
        sel, _ = select(ev, knorm, lo, hi, selector_params(sfi_cfg), k)
        score, _ = selector_scores(ev, knorm, lo, hi, selector_params(sfi_cfg))
        for h_ in range(hk):
            chosen = set(sel[0, h_].tolist())
            s = score[0, h_]
            for n, span in enumerate(targets):
                rows.append(dict(layer=li, kv_head=h_, needle=n, positions=span,
                                 selected=[p in chosen or p >= t - sfi_cfg.n_recent for p in span],
                                 rank=[int((s > s[p]).sum()) for p in span]))
    return rows


def summary(model, args, cfg) -> dict:
    """Per (layer, KV head): the samples whose target needles are all kept whole; per layer: the
    samples where some target needle is kept whole by none of the layer's KV heads."""
    from vllm_ext.quality import tasks as T

    whole: dict = {}
    lost: dict = {}
    n = 0
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        for seed in range(args.seeds):
            rows = probe(model, T.make_sample(args.task, args.length, depth, seed), cfg, args.needles)
            n += 1
            heads: dict = {}
            needles: dict = {}
            for r in rows:
                ok = all(r["selected"])
                key = (r["layer"], r["kv_head"])
                heads[key] = heads.get(key, True) and ok
                nk = (r["layer"], r["needle"])
                needles[nk] = needles.get(nk, False) or ok
            for key, ok in heads.items():
                whole[key] = whole.get(key, 0) + ok
            for layer in {k[0] for k in needles}:
                missing = any(not ok for (lay, _), ok in needles.items() if lay == layer)
                lost[layer] = lost.get(layer, 0) + missing
    print(f"{args.task} length {args.length}, {n} samples, k={cfg.k} keep_prefill={cfg.keep_prefill} "
          f"span={cfg.select_span} back={cfg.select_span_back}: samples with every target needle whole")
    for (layer, head), c in sorted(whole.items()):
        print(f"  layer {layer} kv head {head}: {c}/{n}")
    for layer, c in sorted(lost.items()):
        print(f"  layer {layer}: some needle whole in no KV head: {c}/{n}")
    return dict(samples=n, whole={f"{k[0]}/{k[1]}": v for k, v in whole.items()}, lost=lost)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/retrieval-llama")
    p.add_argument("--task", default="niah_single")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--n-recent", type=int, default=64)
    p.add_argument("--sfi", default="{}", help="JSON of further SfiConfig fields (e.g. '{\"mu\": 0}')")
    p.add_argument("--needles", choices=("first", "all"), default="first",
                   help="first: the target needle from its key words; all: every target needle "
                        "(niah_multivalue has 4), each whole")
    p.add_argument("--seeds", type=int, default=1, help="with --summary: seeds 0..n-1 at every depth")
    p.add_argument("--summary", action="store_true",
                   help="per layer and KV head: how many samples keep every word of every target needle "
                        "(selected or in the recent window), over depths 0, .25, .5, .75, 1 and --seeds")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch
    from transformers import LlamaForCausalLM

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.quality import tasks as T

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = LlamaForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    cfg = SfiConfig(enabled=True, k=args.k, n_recent=args.n_recent, **json.loads(args.sfi))
    if args.summary:
        return summary(model, args, cfg)
    sample = T.make_sample(args.task, args.length, args.depth, args.seed)
    rows = probe(model, sample, cfg, args.needles)
    if args.json:
        print(json.dumps(rows))
        return rows
    words = T.words_of([sample.prompt_ids[i] for i in rows[0]["positions"]])
    print(f"{args.task} length {args.length} depth {args.depth}: needle tokens {' '.join(words)} at "
          f"{rows[0]['positions'][0]}..{rows[0]['positions'][-1]}; k={args.k}, n_recent={args.n_recent}")
    for r in rows:
        marks = "".join("Y" if x else "." for x in r["selected"])
        print(f"  layer {r['layer']} kv head {r['kv_head']}: selected {marks}  ranks {r['rank']}")
    return rows


if __name__ == "__main__":
    main()
