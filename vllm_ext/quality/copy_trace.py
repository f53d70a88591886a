"""Where do the digits go? (offline, Hugging Face model, teacher forcing, no vLLM)

For an answer that SFI wrote differently from dense (a value with digits lost mid-value), this
replays SFI's state at the step that wrote the first wrong token and prints, per layer and KV head,
whether the value's remaining tokens (the first one the model had to copy next, and the rest) were
in the compact segment (sink + the prefill end's kept selection + the last slow step's selection),
in the recent window, or in neither, and what dense attention put on them at that step.

The run: the prompt and SFI's own answer up to the wrong token go through the model densely
(teacher forcing, fp32). The schedule is replayed from the answer's tokens (the preset's
``refresh_warmup`` steps, sentence-end triggers, the copy trigger unless ``copy_ngram`` resolves to 0); the
selections are the reference selector's (:func:`vllm_ext.kernels.sfi_selector_torch.select`) on the
same evidence the backend hands it (prefill end: the last ``w_prefill`` prompt queries; a slow step:
its own query), with ``keep_prefill`` and ``select_span(_back)`` applied as in
:mod:`vllm_ext.methods.sfi.path`. bf16 serving and fp32 here can differ in near ties.

    python -m vllm_ext.quality.copy_trace --model $M --results bench/results/X.json --config sfi_preset
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math

import torch


class _Recorder:
    """Eager attention (SDPA for the output) that also keeps, per layer, the softmax rows of chosen
    query positions over every key, and the key norms."""

    def __init__(self, rows: list[int]):
        self.rows = rows
        self.probs: dict[int, torch.Tensor] = {}     # layer -> [Hq, len(rows), T]
        self.key_norms: dict[int, torch.Tensor] = {}  # layer -> [Hkv, T]

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        from transformers.models.llama.modeling_llama import repeat_kv

        _, hq, t, _ = query.shape
        g = hq // key.shape[1]
        kr = repeat_kv(key, g)
        out = torch.nn.functional.scaled_dot_product_attention(query, kr, repeat_kv(value, g), is_causal=True,
                                                               scale=scaling)
        rows = torch.tensor(self.rows)
        logits = torch.matmul(query[0][:, rows], kr[0].transpose(1, 2)) * scaling       # [Hq, R, T]
        causal = torch.arange(t)[None, :] <= rows[:, None]
        self.probs[module.layer_idx] = torch.softmax(logits.masked_fill(~causal[None], -math.inf).float(), -1)
        self.key_norms[module.layer_idx] = key[0].float().norm(dim=-1)
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _patched(fn):
    import transformers.models.llama.modeling_llama as llama

    old = llama.eager_attention_forward
    llama.eager_attention_forward = fn
    try:
        yield
    finally:
        llama.eager_attention_forward = old


def slow_steps(cfg, answer_ids: list[int], prompt_ids: list[int], upto: int, tokenizer) -> list[int]:
    """Decode steps ``1..upto`` (step ``i`` reads answer token ``i - 1`` and writes token ``i``) that the
    schedule makes slow: the warm-up's budget, sentence-end triggers (``fire_at`` sentence_end, no
    cooldown: the preset's), the copy trigger."""
    from vllm_ext.methods.sfi.triggers import ends_in_trigger

    slow, since, gap = [], 0, 1 if cfg.refresh_warmup else cfg.refresh
    m, copying = cfg.resolved_copy_ngram, False
    tokens = list(prompt_ids)
    for i in range(1, upto + 1):
        tokens.append(answer_ids[i - 1])
        nth = since + 1
        text = tokenizer.decode([answer_ids[i - 1]], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        fire = nth >= min(gap, cfg.refresh) or ends_in_trigger(text, cfg.trigger_chars)
        if m:
            t = len(tokens)
            tail = tokens[t - m:]
            hits = sum(tokens[j - m + 1:j + 1] == tail
                       for j in range(max(cfg.n_sink - 1, m - 1), t - cfg.n_recent - 1))
            hit = hits > 0 and (not cfg.copy_max_matches or hits <= cfg.copy_max_matches)
            # copy_once: only the first step of a run of copying steps (kernels.copy_match's `prev`)
            fire |= hit and not (cfg.copy_once and copying)
            copying = hit
        if fire:
            slow.append(i)
            since, gap = 0, min(gap * 2, cfg.refresh)
        else:
            since = nth
    return slow


def _evidence(probs: torch.Tensor, hkv: int) -> torch.Tensor:
    """Per-head softmax rows ``[Hq, R, T]`` -> the selector's evidence ``[1, Hkv, G*R, T]``."""
    hq, r, t = probs.shape
    return torch.log(probs.clamp_min(0)).reshape(hkv, (hq // hkv) * r, t)[None]


def trace(model, tokenizer, prompt_ids: list[int], answer_ids: list[int], wrong: int, value_pos: list[int],
          written: int, cfg) -> dict:
    """The state at decode step ``wrong`` (it writes ``answer_ids[wrong]``, the first wrong token);
    ``value_pos``: the value's token positions in the prompt; ``written``: its tokens already
    copied right (the next one to copy is ``value_pos[written]``)."""
    from vllm_ext.kernels.sfi_selector_torch import select
    from vllm_ext.methods.sfi.selector_params import selector_params

    p = len(prompt_ids)
    ids = prompt_ids + answer_ids[:wrong]                 # inputs up to the query of step `wrong`
    slows = [s for s in slow_steps(cfg, answer_ids, prompt_ids, wrong, tokenizer)]
    last_slow = max([s for s in slows if s < wrong], default=0)   # 0: the prefill end's selection
    w = cfg.w_prefill
    q_rows = list(range(p - w, p)) + [p + last_slow - 1] * (last_slow > 0) + [p + wrong - 1]
    rec = _Recorder(q_rows)
    with _patched(rec), torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    hkv = model.config.num_key_value_heads
    t_miss = p + wrong
    remaining = value_pos[written:]
    out = {"prompt_len": p, "wrong_step": wrong, "slow_steps": slows, "last_slow": last_slow,
           "miss_is_slow": wrong in slows, "next_value_pos": remaining[:1], "remaining": remaining,
           "layers": []}
    kept_cfg = dataclasses.replace(cfg, k_min=0)
    for layer, probs in sorted(rec.probs.items()):
        knorm = rec.key_norms[layer][None]
        # prefill end: allowed [n_sink, p - n_recent), the kept best keep_prefill and the rest
        lo0, hi0 = torch.tensor([cfg.n_sink]), torch.tensor([p - cfg.n_recent])
        ev0 = _evidence(probs[:, :w, :p], hkv)
        kept, n_kept = select(ev0, knorm[..., :p], lo0, hi0, selector_params(kept_cfg),
                              min(cfg.keep_prefill or cfg.k, cfg.k))
        kept = kept[:, :, :cfg.keep_prefill] if cfg.keep_prefill else kept
        if last_slow:
            t = p + last_slow
            ev = _evidence(probs[:, w:w + 1, :t], hkv)
            lo, hi = torch.tensor([cfg.n_sink]), torch.tensor([t - cfg.n_recent])
            norms = knorm[..., :t]
        else:
            t, ev, lo, hi, norms = p, ev0, lo0, hi0, knorm[..., :p]
        if cfg.keep_prefill:
            rest, _ = select(ev, norms, lo, hi, selector_params(kept_cfg), cfg.k - int(n_kept[0]), exclude=kept)
            chosen = torch.cat([kept, rest], -1)
        else:
            chosen, _ = select(ev, norms, lo, hi, selector_params(cfg), cfg.k)
        dense = probs[:, -1, :t_miss]                      # the miss step's dense attention [Hq, T]
        g = dense.shape[0] // hkv
        heads = []
        for h in range(hkv):
            sel = set(chosen[0, h].tolist())
            kept_h = set(kept[0, h].tolist())
            where = ["sink" if q < cfg.n_sink else "recent" if q >= t_miss - cfg.n_recent else
                     "kept" if q in kept_h else "selected" if q in sel else "neither" for q in remaining]
            mass = dense[h * g:(h + 1) * g]
            heads.append({"where": where,
                          "dense_mass_next": [round(float(x), 4) for x in mass[:, remaining[0]]] if remaining else [],
                          "dense_mass_remaining": [round(float(x), 4) for x in mass[:, remaining].sum(-1)],
                          "dense_top": [int(x) for x in mass.amax(0).topk(3).indices]})
        out["layers"].append({"layer": layer, "heads": heads})
    return out


def _value_positions(tokenizer, prompt_ids: list[int], value: str) -> list[int]:
    """The prompt positions of the value's tokens (its last occurrence before the question)."""
    want = tokenizer(value, add_special_tokens=False)["input_ids"]
    for start in range(len(prompt_ids) - len(want), -1, -1):
        if prompt_ids[start:start + len(want)] == want:
            return list(range(start, start + len(want)))
    raise ValueError(f"value {value!r} not found in the prompt")


def summarise(tr: dict) -> list[str]:
    lines = [f"prompt {tr['prompt_len']} tokens; traced decode step {tr['wrong_step']} (the first token unlike dense; a right answer: its value's last token) "
             f"(slow steps {tr['slow_steps']}; selection from "
             f"{'step %d' % tr['last_slow'] if tr['last_slow'] else 'the prefill end'}); "
             f"value tokens still to copy at positions {tr['remaining']}",
             "layer | next value token per KV head (where) | dense mass on it (max over the group's q heads)"
             " | dense mass on all remaining (max)"]
    for lay in tr["layers"]:
        where = " ".join(h["where"][0] if h["where"] else "-" for h in lay["heads"])
        nxt = " ".join(f"{max(h['dense_mass_next']):.3f}" if h["dense_mass_next"] else "-" for h in lay["heads"])
        rem = " ".join(f"{max(h['dense_mass_remaining']):.3f}" for h in lay["heads"])
        lines.append(f"{lay['layer']:>2} | {where} | {nxt} | {rem}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--results", required=True, help="an eval_quality JSON with dense and the config")
    p.add_argument("--config", required=True, help="the configuration's name in that JSON")
    p.add_argument("--sfi", default=None, help="JSON of the SfiConfig to replay (default: the preset 'sfi')")
    p.add_argument("--max-samples", type=int, default=4)
    p.add_argument("--include-correct", action="store_true",
                   help="also answers SFI got right (traced at the step that wrote the value's last token)")
    p.add_argument("--length", type=int, default=None, help="only samples of this requested length")
    p.add_argument("--json", default=None, help="write the traces here")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.quality import tasks as T
    from vllm_ext.quality import user_needles

    cfg = SpeedSfiConfig.from_dict(json.loads(args.sfi) if args.sfi else {"preset": "sfi"}).sfi
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    data = json.load(open(args.results))
    by_name = {c["name"]: c for c in data["configs"]}
    dense = {(r["task"], r["length"], r["depth"], r["seed"]): r for r in by_name["dense"]["samples"]}
    misses = [r for r in by_name[args.config]["samples"]
              if r["task"] == "niah_single" and dense[(r["task"], r["length"], r["depth"], r["seed"])]["correct"]
              and (args.include_correct or not r["correct"])
              and (args.length is None or r["length"] == args.length)]
    traces = []
    for r in misses[:args.max_samples]:
        if user_needles.is_user_wording(r.get("wording", "ruler")):
            s = user_needles.rebuild(r, tok)
        else:
            s = T.chat_sample(T.make_text_sample(r["task"], r["length"], r["depth"], r["seed"], tok,
                                                 wording=r.get("wording", "ruler"),
                                                 value_digits=len(r["expected"])), tok)
        mine = r["output_ids"]
        ref = dense[(r["task"], r["length"], r["depth"], r["seed"])]["output_ids"]
        vpos = _value_positions(tok, s.prompt_ids, r["expected"])
        value_ids = [s.prompt_ids[q] for q in vpos]
        wrong = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if r["correct"]:                    # right: the step that wrote the value's last token
            wrong = next(i + len(value_ids) - 1 for i in range(len(mine))
                         if mine[i:i + len(value_ids)] == value_ids)
        # value tokens already written right: the longest prefix of the value that ends the answer
        written = max((n for n in range(len(value_ids) + 1) if mine[max(0, wrong - n):wrong] == value_ids[:n]),
                      default=0)
        print(f"\n== {r['wording'] if 'wording' in r else 'ruler'} {r['length']} depth {r['depth']} seed "
              f"{r['seed']}: expected {r['expected']}, SFI wrote {r['output']!r}, dense {dense[(r['task'], r['length'], r['depth'], r['seed'])]['output']!r}")
        tr = trace(model, tok, list(s.prompt_ids), mine, wrong, vpos, written, cfg)
        tr.update(sample={k: r[k] for k in ("task", "length", "depth", "seed", "expected", "output")},
                  written=written)
        print("\n".join(summarise(tr)), flush=True)
        traces.append(tr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(traces, f, indent=1)


if __name__ == "__main__":
    main()
