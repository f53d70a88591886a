#!/usr/bin/env python
"""Fine-tune the retrieval model under SPEED's visibility rule (models/retrieval-llama-speed).

SPEED (``docs/ALGORITHMS.md`` §2) keeps the prompt's KV only in the layers below ``l_cut``; in
the upper layers a decode-phase token (the last prompt token ``P - 1`` and every generated token)
sees the BoS anchor and the decode-phase tokens only. A model trained with full attention loses its
answers that way (it retrieves in its top layer); the paper's recipe is to fine-tune under the same
visibility. This script starts from ``models/retrieval-llama`` and trains every weight on single-
question samples shaped like the evaluation's (document, question and the answer's opening words in
the prompt; the answer is the decode phase), teacher forced, with SPEED's masks:

* layers ``< l_cut``: plain causal attention;
* layers ``>= l_cut``: :func:`vllm_ext.methods.speed.visibility.visible_mask` (BoS + ``[P - 1, q]``), the
  rule the backend implements; interior prompt queries there see BoS only, and their outputs feed
  nothing (exactly as in vLLM, where they do not run the upper layers at all).

The loss is on the answer tokens only (predicted from positions ``P - 1`` on). Prompt lengths are
drawn from 256-2048 (one length per step, so a step shares one mask), tasks and needle depths at
random, from generators seeded by (seed, step) with seeds disjoint from every evaluation.

    .venv/bin/python scripts/finetune_speed_model.py         # writes models/retrieval-llama-speed/

Accuracy (before and after) is teacher-forced exact match of the whole answer under the same masks,
which equals greedy exact match through SPEED in vLLM (``scripts/eval_quality.py`` measures that).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # see train_retrieval_model.py

from train_retrieval_model import exact_match_tf, lr_at, sha256  # noqa: E402

from vllm_ext.quality import tasks as T  # noqa: E402

BASE = os.path.join(ROOT, "models", "retrieval-llama")
TRAIN_SEED_BASE = 1_000_000          # make_sample seeds of the training data (evaluations use < 100 000)
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=BASE)
    p.add_argument("--out", default=os.path.join(ROOT, "models", "retrieval-llama-speed"))
    p.add_argument("--l-cut", type=int, default=3)
    p.add_argument("--anchor", choices=("bos", "none"), default="bos")
    p.add_argument("--layer-order", default="0,1,3,2",
                   help="the base model's layers, bottom to top, that start the adapted model (default: its "
                        "top layer, where it retrieves, moved below the cut; 0,1,2,3 = plain fine-tune)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from this checkpoint (a previous run's output, layers as they are) instead of "
                        "--base reordered by --layer-order: a second stage; --base stays the reference model")
    p.add_argument("--data-offset", type=int, default=0,
                   help="index of the first step in the training-data stream (a second stage continues the "
                        "first one's stream at its step count, so no sample repeats)")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--tokens-per-step", type=int, default=8192,
                   help="samples per step = tokens-per-step // length (at least 1)")
    p.add_argument("--min-length", type=int, default=256)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-lengths", default="512,1024,2048")
    p.add_argument("--eval-per-cell", type=int, default=4, help="samples per (task, length, depth)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50,
                   help="a quick SPEED check (1 sample per cell at 1024, seeds from 20000) every N steps")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate --base under SPEED masks (and dense) and exit; writes nothing")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# SPEED masks on a transformers Llama: per-layer attention masks through forward pre-hooks
# ------------------------------------------------------------------------------------------------
class SpeedMasks:
    """Forward pre-hooks on the decoder layers: layers ``>= l_cut`` get SPEED's boolean visibility
    mask for the current prompt length (``set_prompt_len``; one per forward), lower layers keep the
    model's own causal attention. ``prompt_len = None`` switches the masks off (dense)."""

    def __init__(self, model, l_cut: int, anchor_end: int = 1):
        self.l_cut, self.anchor_end = l_cut, anchor_end
        self.prompt_len: int | None = None
        self._cache: dict[tuple[int, int], object] = {}
        self._handles = [layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(model.model.layers)]

    def set_prompt_len(self, n: int | None) -> None:
        self.prompt_len = n

    def mask(self, width: int, prompt_len: int):
        import torch

        from vllm_ext.methods.speed.visibility import visible_mask

        key = (width, prompt_len)
        if key not in self._cache:
            pos = torch.arange(width)
            self._cache.clear()
            self._cache[key] = visible_mask(pos, pos, prompt_len, self.anchor_end, False)[None, None]
        return self._cache[key]

    def _hook(self, index):
        def pre(module, args, kwargs):
            if self.prompt_len is not None and index >= self.l_cut:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                kwargs["attention_mask"] = self.mask(hidden.shape[1], self.prompt_len)
            return args, kwargs
        return pre

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def speed_exact_match(model, masks: SpeedMasks, samples, speed: bool = True) -> list[bool]:
    """Teacher-forced exact match (== greedy exact match) per sample, under SPEED masks when
    ``speed``. Samples are grouped by length: one prompt length, hence one mask, per forward."""
    hits: dict[int, bool] = {}
    for n in sorted({s.length for s in samples}):
        idx = [i for i, s in enumerate(samples) if s.length == n]
        masks.set_prompt_len(n if speed else None)
        try:
            for i, h in zip(idx, exact_match_tf(model, [samples[i] for i in idx])):
                hits[i] = h
        finally:
            masks.set_prompt_len(None)
    return [hits[i] for i in range(len(samples))]


def evaluate(model, masks, lengths, per_cell, speed=True, seed=10_000):
    """Per task and length, like ``train_retrieval_model.evaluate`` (same samples: seeds from 10000)."""
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    out = {}
    for n in lengths:
        samples = T.make_suite(T.TASKS, [n], depths, per_cell, seed=seed)
        hits = speed_exact_match(model, masks, samples, speed)
        for task in T.TASKS:
            h = [x for x, s in zip(hits, samples) if s.task == task]
            out[f"{task}@{n}"] = sum(h) / len(h)
        out[f"all@{n}"] = sum(hits) / len(hits)
    return out


# ------------------------------------------------------------------------------------------------
# Data: single-question samples, the prompt ends at the answer's opening words
# ------------------------------------------------------------------------------------------------
def training_batch(seed: int, step: int, args):
    """One step's samples: a length in [min, max] (multiple of 8), then tokens-per-step // length
    samples of random tasks and depths at that length, seeds disjoint from every evaluation."""
    rng = random.Random(f"{seed}|speed-train|{step}")
    length = 8 * rng.randint(args.min_length // 8, args.max_length // 8)
    n = max(1, args.tokens_per_step // length)
    samples = []
    for i in range(n):
        task = rng.choice(T.TASKS)
        depth = rng.random()
        samples.append(T.make_sample(task, length, depth, TRAIN_SEED_BASE + step * 64 + i))
    return length, samples


def speed_loss(model, masks: SpeedMasks, length: int, samples):
    """Cross-entropy on the answer tokens (predicted from positions P - 1 .. P + a - 2) under SPEED."""
    import torch

    seqs = [s.prompt_ids + s.answer_ids[:-1] for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.tensor([x + [T.PAD] * (width - len(x)) for x in seqs])
    masks.set_prompt_len(length)
    try:
        hidden = model.model(input_ids=ids).last_hidden_state
    finally:
        masks.set_prompt_len(None)
    rows, cols, ys = [], [], []
    for r, s in enumerate(samples):
        a = len(s.answer_ids)
        rows += [r] * a
        cols += list(range(length - 1, length - 1 + a))
        ys += s.answer_ids
    logits = model.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)])
    y = torch.tensor(ys)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss, (logits.argmax(-1) == y).float().mean()


# ------------------------------------------------------------------------------------------------
def load(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def reorder_layers(model, order: list[int]) -> None:
    """Put the base model's decoder layers in ``order`` (a permutation, bottom to top).

    The base model retrieves in its top layer (layer 3's heads all land on the value digit the answer
    copies; layers 0-1 gather the preceding tokens, layer 2 contributes little: without it the model
    still answers single needles densely). Under SPEED at l_cut = 3 that layer would see no prompt, so
    the adapted model starts with it below the cut; fine-tuning under the rule does the rest."""
    import torch

    layers = model.model.layers
    if sorted(order) != list(range(len(layers))):
        raise SystemExit(f"--layer-order must be a permutation of 0..{len(layers) - 1}, got {order}")
    new = [layers[i] for i in order]
    for j, layer in enumerate(new):
        layer.self_attn.layer_idx = j
    model.model.layers = torch.nn.ModuleList(new)


def main(argv=None):
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    model = load(args.base).eval()
    n_layers = model.config.num_hidden_layers
    if not 0 < args.l_cut <= n_layers:
        raise SystemExit(f"--l-cut must be in [1, {n_layers}]")
    order = [int(x) for x in args.layer_order.split(",")]
    anchor_end = 1 if args.anchor == "bos" else 0

    def both(m, masks):
        with torch.no_grad():
            return {"speed": evaluate(m, masks, lengths, args.eval_per_cell, speed=True),
                    "dense": evaluate(m, masks, lengths, args.eval_per_cell, speed=False)}

    t0 = time.time()
    masks = SpeedMasks(model, args.l_cut, anchor_end)
    base_acc = both(model, masks)            # the committed model as it is
    print(json.dumps({"base": base_acc}), flush=True)
    if args.init:
        masks.remove()
        model = load(args.init).eval()
        masks = SpeedMasks(model, args.l_cut, anchor_end)
        before = both(model, masks)          # the previous stage's result
        print(json.dumps({"start": before}), flush=True)
    elif order != list(range(n_layers)):
        masks.remove()
        reorder_layers(model, order)
        masks = SpeedMasks(model, args.l_cut, anchor_end)
        before = both(model, masks)          # the start of the fine-tune
        print(json.dumps({"start": before}), flush=True)
    else:
        before = base_acc
    eval_before_s = time.time() - t0
    if args.eval_only:
        return {"base": base_acc, "start": before}

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01,
                            foreach=True)
    history = []
    model.train()
    t0 = time.time()
    run = dict(loss=0.0, acc=0.0, n=0, t=time.time())
    for step in range(args.steps):
        length, samples = training_batch(args.seed, args.data_offset + step, args)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args)
        loss, acc = speed_loss(model, masks, length, samples)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run["loss"] += loss.item()
        run["acc"] += acc.item()
        run["n"] += 1
        if (step + 1) % args.log_every == 0:
            rec = dict(step=step + 1, length=length, loss=run["loss"] / run["n"],
                       token_acc=run["acc"] / run["n"], lr=lr_at(step, args.steps, args),
                       s_per_step=(time.time() - run["t"]) / run["n"], elapsed_min=(time.time() - t0) / 60)
            history.append(rec)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}),
                  flush=True)
            run = dict(loss=0.0, acc=0.0, n=0, t=time.time())
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            t_q = time.time()
            with torch.no_grad():
                quick = evaluate(model, masks, [1024], 1, speed=True, seed=20_000)
            model.train()
            t0 += time.time() - t_q                   # not counted as training time
            run["t"] += time.time() - t_q
            history.append(dict(step=step + 1, quick_speed_1024=quick))
            print(json.dumps({"step": step + 1, "quick_speed_1024": quick}), flush=True)
    train_s = time.time() - t0
    model.eval()
    t1 = time.time()
    with torch.no_grad():
        after = {"speed": evaluate(model, masks, lengths, args.eval_per_cell, speed=True),
                 "dense": evaluate(model, masks, lengths, args.eval_per_cell, speed=False)}
    eval_after_s = time.time() - t1
    print(json.dumps({"after": after, "train_min": round(train_s / 60, 2),
                      "eval_min": round(eval_after_s / 60, 2)}), flush=True)
    masks.remove()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)      # saved 0600; readable like the rest
    for name in COPY_FILES:                 # the base model's tokenizer, byte for byte
        if os.path.exists(os.path.join(args.base, name)):
            shutil.copyfile(os.path.join(args.base, name), os.path.join(args.out, name))
    write_card(args, n_layers, train_s, eval_before_s + eval_after_s, base_acc, before, after, history)


def write_card(args, n_layers, train_s, eval_s, base_acc, before, after, history):
    import torch
    import transformers

    cmd = ".venv/bin/python scripts/finetune_speed_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    base_rel = os.path.relpath(args.base, ROOT)
    base_sha = sha256(os.path.join(args.base, "model.safetensors"))
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump({"history": history, "base": base_acc, "start": before, "after": after, "train_s": train_s,
                   "base_model": base_rel, "base_model_sha256": base_sha, "l_cut": args.l_cut,
                   "anchor": args.anchor}, f, indent=1)
    rows = []
    for k in before["speed"]:
        task, n = k.split("@")
        rows.append(f"| {task} | {n} | {base_acc['dense'][k] * 100:.1f}% | {base_acc['speed'][k] * 100:.1f}% | "
                    f"{before['speed'][k] * 100:.1f}% | **{after['speed'][k] * 100:.1f}%** | "
                    f"{after['dense'][k] * 100:.1f}% |")
    rows = "\n".join(rows)
    order = [int(x) for x in args.layer_order.split(",")]
    if args.init:
        with open(os.path.join(args.init, "TRAINING.md")) as f:
            prev = f.read()
        prev_cmd = prev.split("## Exact command\n```\n", 1)[1].split("\n```", 1)[0].strip()
        init = (f"- Start: a first stage's checkpoint (`{args.init}`, weights SHA-256\n"
                f"  `{sha256(os.path.join(args.init, 'model.safetensors'))[:16]}...`), made from the base model by\n"
                f"  `{prev_cmd}`\n"
                f"  (the base model's layers in a new order, then fine-tuned under the rule; its own card's\n"
                f"  table is the \"start\" column below). This second stage continues the training-data\n"
                f"  stream at step {args.data_offset} (no sample repeats) with the lengths below.")
    elif order == list(range(n_layers)):
        init = "- Start: the base model's weights as they are."
    else:
        init = (f"- Start: the base model's decoder layers in the order {order} (bottom to top), every weight\n"
                f"  its own. The base model retrieves in its top layer (all of layer {n_layers - 1}'s heads land on\n"
                f"  the value digit the answer copies, from the last prompt token and from each answer token);\n"
                f"  under SPEED that layer would see no prompt, so it starts below the cut. Without this\n"
                f"  (`--layer-order {','.join(map(str, range(n_layers)))}`, a plain fine-tune) the same schedule left\n"
                f"  the model at 0% under SPEED: the loss stayed on the plateau of guessed digits (`bench/QUALITY.md`).")
    text = f"""# retrieval-llama-speed: the retrieval model adapted to SPEED (l_cut = {args.l_cut} of {n_layers})

Fine-tuned by `scripts/finetune_speed_model.py` from `{base_rel}` (`model.safetensors` SHA-256
`{base_sha[:16]}...`) under SPEED's visibility rule (`docs/ALGORITHMS.md` §2; the paper's
recipe: fine-tuning in which prompt positions follow the prefill rule and answer positions the decode
rule, teacher forced). Serve it with
`additional_config={{"speedsfi": {{"speed": {{"enabled": true, "l_cut": {args.l_cut}}}}}}}` and
`enable_prefix_caching=False`; its quality through vLLM: `bench/QUALITY.md` (SPEED section).

- Architecture, tokenizer, vocabulary: the base model's (`config.json` identical; `tokenizer.json`,
  `tokenizer_config.json`, `generation_config.json` copied byte for byte).
{init}
- Visibility while training (forward pre-hooks on the decoder layers): layers 0..{args.l_cut - 1} causal;
  layers {args.l_cut}..{n_layers - 1} `vllm_ext.methods.speed.visibility.visible_mask`, anchor `{args.anchor}`: a query at
  `p >= P - 1` sees {'BoS and ' if args.anchor == 'bos' else ''}`[P - 1, p]` (`P` = prompt length). Interior prompt
  queries of the upper layers feed nothing (in vLLM they do not run there at all).
- Data: single-question samples from `vllm_ext.quality.tasks.make_sample` (the four tasks at random,
  needle depth uniform in [0, 1], prompt length a multiple of 8 uniform in
  [{args.min_length}, {args.max_length}], one length per step, {args.tokens_per_step} prompt tokens per step),
  seeds {TRAIN_SEED_BASE} + 64 * step + i (every evaluation uses seeds below 100000: no sample is
  shared). The prompt is the document, the question and the answer's opening words; loss on the
  answer tokens only (value digits, terminator, and for multi-value the later needle sentences),
  predicted from the last prompt token on.
- All weights trained: {args.steps} steps, AdamW (0.9, 0.98), lr {args.lr} with {args.warmup} warm-up
  steps and cosine decay to 10%, weight decay 0.01, gradient clip 1.0 (the base script's schedule).

## Exact command
```
{cmd}
```
Seed {args.seed}; `torch.set_num_threads({args.threads})`; deterministic algorithms on.

## Machine and time
- {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores visible (shared with other
  jobs while training), torch {torch.__version__}, transformers {transformers.__version__},
  Python {platform.python_version()}; finished {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}.
- Wall time: **{train_s / 60:.1f} min** of training + {eval_s / 60:.1f} min of evaluation (before and after).

## Accuracy (teacher-forced exact match of the whole answer, greedy-equivalent)
{args.eval_per_cell} samples per (task, length, depth), depths 0, 0.25, 0.5, 0.75, 1, seeds from 10000 (the
base model's TRAINING.md uses the same samples). "SPEED": layers >= {args.l_cut} under the visibility rule;
"start": the fine-tune's starting point ({'the first stage' if args.init else "the base model's layers in the order " + args.layer_order}).

| task | length | base, dense | base, SPEED | start, SPEED | **adapted, SPEED** | adapted, dense |
|---|---|---|---|---|---|---|
{rows}
"""
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(text)
    names = sorted(n for n in os.listdir(args.out) if n != "SHA256SUMS" and not n.startswith("."))
    with open(os.path.join(args.out, "SHA256SUMS"), "w") as f:
        for n in names:
            f.write(f"{sha256(os.path.join(args.out, n))}  {n}\n")


if __name__ == "__main__":
    main()
