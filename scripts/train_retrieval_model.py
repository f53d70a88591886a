#!/usr/bin/env python
"""Train the small retrieval model of the quality harness (models/retrieval-llama) on this CPU.

A Llama-architecture model (transformers ``LlamaForCausalLM``: RoPE, RMSNorm, SwiGLU, GQA with 4 query
/ 2 KV heads of size 32, 4 layers, hidden 128) trained from scratch on the synthetic retrieval
documents of :mod:`vllm_ext.quality.tasks` (needles with distractors, multi-value keys, key-value
pairs; several questions per document, loss on the answer tokens only), with a curriculum from
128-token to 2048-token documents. Seeded and deterministic on a given machine / torch build (fixed
thread count, data drawn from per-step seeded generators).

    .venv/bin/python scripts/train_retrieval_model.py            # writes models/retrieval-llama/
    # the second quality model: Qwen3 (q/k RMSNorm), 8 query / 2 KV heads, plain + prose haystacks
    .venv/bin/python scripts/train_retrieval_model.py --arch qwen3 --filler mix   # models/retrieval-qwen3/

Accuracy is exact match of the whole answer under teacher forcing, which is the same as greedy
decoding's exact match (greedy emits the answer iff every answer token is the arg-max given the
previous answer tokens); ``scripts/eval_quality.py`` measures it again through vLLM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# OpenMP threads that sleep instead of spinning at barriers: on a CPU shared with other jobs, spinning
# threads made steps up to 10x slower (measured: 0.6-8.4 s vs a steady 0.9 s per step).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from vllm_ext.quality import tasks as T  # noqa: E402

# (document length, documents per step, steps, fraction of repeated-sequence documents)
# Stage 0 teaches generic copying ("induction heads": a random token sequence, then the same again;
# loss on the repeat). Measured on this machine (length 64, 64 documents per step, lr 3e-3): on the
# retrieval documents alone a plain 4-layer model sat on the loss plateau for 600+ steps (no copying at
# all); on copying documents a plain 2-layer model left it after ~600 steps, a plain 4-layer model not
# within 700; with `init_position_heads` a 2-layer model after ~350 and the 4-layer model with layers
# 2-3 starting as the identity after ~460.
CURRICULUM = [(64, 64, 900, 1.0), (128, 32, 400, 0.1), (256, 16, 300, 0.1), (512, 8, 300, 0.05),
              (1024, 4, 300, 0.0), (2048, 4, 500, 0.0)]


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("llama", "qwen3"), default="llama",
                   help="llama: LlamaForCausalLM (models/retrieval-llama); qwen3: Qwen3ForCausalLM "
                        "(RMSNorm on every query / key head before RoPE)")
    p.add_argument("--filler", choices=("plain", "prose", "mix"), default="plain",
                   help="haystack style of the training documents (tasks.make_sample's filler); mix: "
                        "each document draws one, half and half; the final evaluation covers each style used")
    p.add_argument("--out", default=None, help="default models/retrieval-<arch>")
    p.add_argument("--work-dir", default="/tmp/retrieval-train",
                   help="checkpoints for --resume (not part of the model)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--curriculum", default=None,
                   help="JSON list of [length, docs_per_step, steps, repeat_fraction]; default: %s" % json.dumps(CURRICULUM))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=None, help="query heads; default hidden/32 (llama), 8 (qwen3)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads; default hidden/64 (llama), 2 (qwen3)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rope-theta", type=float, default=500000.0,
                   help="Llama-3's base: more slowly rotating RoPE pairs for content matching over 2K+")
    p.add_argument("--zero-from", type=int, default=2, help="layers from here start as the identity")
    p.add_argument("--eval-lengths", default="512,1024,2048")
    p.add_argument("--eval-per-cell", type=int, default=4, help="samples per (task, length, depth)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    if args.out is None:
        args.out = os.path.join(ROOT, "models", f"retrieval-{args.arch}")
    if args.heads is None:
        args.heads = args.hidden // 32 if args.arch == "llama" else 8
    if args.kv_heads is None:
        args.kv_heads = args.hidden // 64 if args.arch == "llama" else 2
    return args


def repeat_document(rng: random.Random, length: int) -> tuple[list[int], list[int]]:
    """Random tokens, then a random segment of them again; loss on the repeat (copying)."""
    v = len(T.VOCAB)
    n = rng.randint(8, length // 2 - 1)
    seq = [rng.randrange(4, v) for _ in range(n)]
    pre = [rng.randrange(4, v) for _ in range(length - 1 - 2 * n)]
    ids = [T.BOS] + pre + seq + seq
    mask = [0] * (1 + len(pre) + n + 1) + [1] * (n - 1)
    return ids, mask


def build_tokenizer(out_dir: str):
    """Word-level tokenizer over the task vocabulary; ``<s>`` prepended; ``\\n`` is a token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(T.WORD_ID), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(" +"), behavior="removed"),
    ])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", T.BOS)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)    # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=8192)
    fast.save_pretrained(out_dir)
    return fast


def build_model(args):
    import torch

    torch.manual_seed(args.seed)
    if args.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=len(T.VOCAB), hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                          head_dim=args.head_dim, max_position_embeddings=8192, rope_theta=args.rope_theta,
                          tie_word_embeddings=False, bos_token_id=T.BOS, eos_token_id=T.EOS,
                          pad_token_id=T.PAD, attn_implementation="sdpa", torch_dtype="float32",
                          rms_norm_eps=1e-5)
        model = LlamaForCausalLM(cfg)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(vocab_size=len(T.VOCAB), hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                          head_dim=args.head_dim, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                          tie_word_embeddings=False, bos_token_id=T.BOS, eos_token_id=T.EOS,
                          pad_token_id=T.PAD, use_sliding_window=False, rms_norm_eps=1e-5)
        cfg._attn_implementation = "sdpa"
        model = Qwen3ForCausalLM(cfg)
    init_position_heads(model)
    zero_residual_outputs(model, args.zero_from)
    return model


def init_position_heads(model, offsets=(1, 2), n_freq=8, amp=12.0):
    """Start layer 0's first KV head as relative-position heads: query head ``h`` attends to the token
    ``offsets[h]`` back (previous token, the one before), the first half of an induction circuit.

    Every embedding gets the same value in the last coordinate, so after RMSNorm each position
    carries a constant direction; the KV head's key and the query heads read only that direction,
    on the ``n_freq`` fastest RoPE pairs, with phases set so that ``q . R(delta) k`` peaks at
    ``delta = offset`` (margin about ``0.58 * amp`` logits over every other delta up to 8K for theta
    5e5). Everything else stays random; training may change these weights like any other. Without
    this, the copying warm-up sat on its loss plateau several times longer (measured).

    Qwen3 normalises every query and key head (RMSNorm over ``head_dim``, before RoPE), which throws
    ``scale`` away: the position heads' q and k come out with RMS 1, a peak logit of ``sqrt(head_dim)``
    instead of ``n_freq * amp``. The norm also makes them exactly constant over tokens (the input's
    RMSNorm left a little variation), so the construction still holds once layer 0's ``q_norm`` /
    ``k_norm`` gains on the dimensions the heads use (``[:n_freq]`` and, for q, ``[hd/2:hd/2+n_freq]``)
    restore the peak; these gains are shared by all heads of the layer, so the other (random) heads of
    layer 0 start with those dimensions scaled as well."""
    import torch

    cfg = model.config
    hd, c0 = cfg.head_dim, cfg.hidden_size - 1
    attn = model.model.layers[0].self_attn
    inv_freq = model.model.rotary_emb.inv_freq.double()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, c0] = 1.0
        normed = emb / emb.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt()
        scale = (amp * hd ** 0.5) ** 0.5 / normed[:, c0].mean().item()
        attn.k_proj.weight[:hd] = 0
        attn.k_proj.weight[:n_freq, c0] = scale
        for h, off in enumerate(offsets):
            rows = attn.q_proj.weight[h * hd:(h + 1) * hd]
            rows.zero_()
            phase = -off * inv_freq[:n_freq]
            rows[:n_freq, c0] = (scale * torch.cos(phase)).float()
            rows[hd // 2:hd // 2 + n_freq, c0] = (scale * torch.sin(phase)).float()
        if hasattr(attn, "q_norm"):
            # after the norms the heads' q and k have RMS 1 over hd: per used pair |q| |k| = hd / n_freq;
            # gain g on both makes the peak logit g^2 * hd / sqrt(hd) = n_freq * amp, as without norms
            g = (n_freq * amp / hd ** 0.5) ** 0.5
            attn.q_norm.weight[:n_freq] = g
            attn.q_norm.weight[hd // 2:hd // 2 + n_freq] = g
            attn.k_norm.weight[:n_freq] = g


def zero_residual_outputs(model, from_layer: int):
    """Layers from ``from_layer`` up start as the identity (zero attention and MLP output weights): the
    network starts as a shallow one that finds its copying circuit quickly and grows into its depth."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers[from_layer:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def masked_loss(model, ids, mask):
    """Cross-entropy on answer tokens only (the LM head runs only there)."""
    import torch

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = ids[:, 1:]
    sel = mask[:, 1:].bool()
    logits = model.lm_head(hidden[sel])
    y = target[sel]
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss, (logits.argmax(-1) == y).float().mean()


def exact_match_tf(model, samples, batch_tokens=16384):
    """Teacher-forced exact match of every sample's whole answer (== greedy exact match)."""
    import torch

    hits = []
    with torch.no_grad():
        i = 0
        while i < len(samples):
            n = max(1, batch_tokens // (samples[i].length + 32))
            group = [s for s in samples[i:i + n] if s.length == samples[i].length]
            i += len(group)
            seqs = [s.prompt_ids + s.answer_ids[:-1] for s in group]
            width = max(len(x) for x in seqs)
            ids = torch.tensor([x + [T.PAD] * (width - len(x)) for x in seqs])
            hidden = model.model(input_ids=ids).last_hidden_state
            for row, s in enumerate(group):
                p, a = len(s.prompt_ids), len(s.answer_ids)
                pred = model.lm_head(hidden[row, p - 1:p - 1 + a]).argmax(-1).tolist()
                hits.append(pred == s.answer_ids)
    return hits


def evaluate(model, lengths, per_cell, seed=10_000, fillers=("plain",)):
    """Teacher-forced exact match per task and length; keys ``task@length``, with `` prose`` appended
    to the length for the prose filler."""
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    out = {}
    for filler in fillers:
        tag = "" if filler == "plain" else f" {filler}"
        for n in lengths:
            samples = T.make_suite(T.TASKS, [n], depths, per_cell, seed=seed, filler=filler)
            hits = exact_match_tf(model, samples)
            for task in T.TASKS:
                h = [x for x, s in zip(hits, samples) if s.task == task]
                out[f"{task}@{n}{tag}"] = sum(h) / len(h)
            out[f"all@{n}{tag}"] = sum(hits) / len(hits)
    return out


def draw_filler(rng: random.Random, filler: str) -> str:
    """The haystack style of one document; ``mix`` draws (only then is ``rng`` used, so plain and prose
    runs draw the same documents as a run that never draws a style)."""
    if filler != "mix":
        return filler
    return "prose" if rng.random() < 0.5 else "plain"


def eval_fillers(filler: str) -> list[str]:
    return ["plain", "prose"] if filler == "mix" else [filler]


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    args = parse()
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    curriculum = json.loads(args.curriculum) if args.curriculum else CURRICULUM
    total = sum(c[2] for c in curriculum)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    build_tokenizer(args.out)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01,
                            foreach=True)
    step, elapsed_before = 0, 0.0
    ckpt = os.path.join(args.work_dir, "last.pt")
    if args.resume and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed_before = state["step"], state["elapsed"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at step {step}", flush=True)
    print(f"model: {n_params / 1e6:.3f} M parameters, {total} steps, curriculum {curriculum}", flush=True)
    t0 = time.time() - elapsed_before
    history = []
    gstep = 0
    model.train()
    for stage, (length, docs, steps, rep) in enumerate(curriculum):
        run_loss, run_acc, run_n, t_log = 0.0, 0.0, 0, time.time()
        for _ in range(steps):
            if gstep < step:
                gstep += 1
                continue
            rng = random.Random(f"{args.seed}|train|{gstep}")
            batch = [repeat_document(rng, length) if rng.random() < rep
                     else T.training_document(rng, length, draw_filler(rng, args.filler))
                     for _ in range(docs)]
            ids = torch.tensor([b[0] for b in batch])
            mask = torch.tensor([b[1] for b in batch])
            for g in opt.param_groups:
                g["lr"] = lr_at(gstep, total, args)
            loss, acc = masked_loss(model, ids, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            gstep += 1
            step = gstep
            run_loss += loss.item()
            run_acc += acc.item()
            run_n += 1
            if gstep % args.log_every == 0:
                dt_ = time.time() - t_log
                rec = dict(step=gstep, length=length, loss=run_loss / run_n, token_acc=run_acc / run_n,
                           lr=lr_at(gstep, total, args), s_per_step=dt_ / run_n,
                           elapsed_min=(time.time() - t0) / 60)
                history.append(rec)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}),
                      flush=True)
                run_loss, run_acc, run_n, t_log = 0.0, 0.0, 0, time.time()
        # end of stage: checkpoint + a quick teacher-forced check at this length
        if step >= gstep and steps and rep < 1.0:
            model.eval()
            quick = evaluate(model, [max(length, 512)], 1, seed=20_000 + stage,
                             fillers=eval_fillers(args.filler))
            model.train()
            print(json.dumps({"stage_end": stage, "length": length, "step": gstep,
                              "elapsed_min": round((time.time() - t0) / 60, 2), **quick}), flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": gstep,
                        "elapsed": time.time() - t0, "torch_rng": torch.get_rng_state()}, ckpt)
    train_s = time.time() - t0
    model.eval()
    t_eval = time.time()
    lengths = [int(x) for x in args.eval_lengths.split(",") if x]
    final = evaluate(model, lengths, args.eval_per_cell, fillers=eval_fillers(args.filler))
    eval_s = time.time() - t_eval
    print(json.dumps({"final": final, "train_min": round(train_s / 60, 2),
                      "eval_min": round(eval_s / 60, 2)}), flush=True)
    model.save_pretrained(args.out, safe_serialization=True)
    write_card(args, curriculum, n_params, train_s, eval_s, final, history)


def write_card(args, curriculum, n_params, train_s, eval_s, final, history):
    import torch
    import transformers

    cmd = ".venv/bin/python scripts/train_retrieval_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = "\n".join(f"| {k.split('@')[0]} | {k.split('@')[1]} | {v * 100:.1f}% |"
                     for k, v in final.items())
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump({"history": history, "final": final, "train_s": train_s}, f, indent=1)
    name = os.path.basename(os.path.normpath(args.out))
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[args.arch]
    norms = " RMSNorm on every query and key head (before RoPE)," if args.arch == "qwen3" else ""
    filler = {"plain": "plain filler sentences (4-11 words, each ending in `.`)",
              "prose": "prose filler (sentences of 3-25 words with commas, ended by `.` `;` `?`, paragraph "
                       "breaks; `make_sample(..., filler=\"prose\")`)",
              "mix": "half of the haystack documents with plain filler (4-11 words, `.`), half with prose "
                     "filler (3-25 words, commas, `.` `;` `?` enders, paragraph breaks; "
                     "`make_sample(..., filler=\"prose\")`)"}[args.filler]
    qk_init = (" Under Qwen3's q/k norms the position heads' scale would be normalised away, so layer 0's "
               "`q_norm` / `k_norm` gains on the dimensions those heads use start at "
               f"{(8 * 12.0 / args.head_dim ** 0.5) ** 0.5:.2f} (same peak logit as without norms; the "
               "gains are shared by all heads of layer 0)." if args.arch == "qwen3" else "")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"""# {name}: a small model that really retrieves

Trained from scratch by `scripts/train_retrieval_model.py` for the quality harness
(`scripts/eval_quality.py`, `bench/QUALITY.md`). It answers the synthetic retrieval questions of
`vllm_ext/quality/tasks.py` (its word-level vocabulary: {len(T.VOCAB)} tokens) and nothing else.

- Architecture: `{arch}`, {args.layers} layers, hidden {args.hidden}, intermediate
  {args.intermediate}, {args.heads} query / {args.kv_heads} KV heads of size {args.head_dim},{norms} RoPE
  (theta {args.rope_theta:g}), untied embeddings, fp32, {n_params / 1e6:.3f} M parameters.
- Tokenizer: word level (`tokenizer.json`, `PreTrainedTokenizerFast`), `<s>` prepended, `.` `;` `?`
  and `\\n` are single tokens (SFI's trigger set is non-empty).
- Data: documents from `vllm_ext.quality.tasks.training_document` (haystacks with needles, hard
  distractors sharing a key word, multi-value keys, key-value pairs; several questions per
  document, loss on answer tokens only), drawn from generators seeded by (seed, step); haystacks:
  {filler}.
- Initialisation: random (std 0.02) except two documented starts that shorten the loss plateau
  before copying ("induction") circuits form: layer 0's first KV head starts as fixed relative-
  position heads (query heads 0 and 1 look 1 and 2 tokens back, through RoPE phases on a constant
  embedding coordinate; `init_position_heads`), and layers {args.zero_from}+ start as the identity
  (zero output projections).{qk_init} All weights are then trained.
- Stage 0 is a copying warm-up (random tokens, then a segment of them again; loss on the repeat);
  later stages mix in a few such documents.
- Curriculum (length, documents per step, steps, fraction of copying documents): {curriculum};
  AdamW (0.9, 0.98), lr {args.lr}
  with {args.warmup} warm-up steps and cosine decay to 10%, weight decay 0.01, gradient clip 1.0.

## Exact command
```
{cmd}
```
Seed {args.seed}; `torch.set_num_threads({args.threads})`; deterministic algorithms on.

## Machine and time
- {cpu} ({platform.machine()}), {os.cpu_count()} CPU cores visible (shared with other
  jobs while training), torch {torch.__version__}, transformers {transformers.__version__},
  Python {platform.python_version()}; finished {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}.
- Wall time: **{train_s / 60:.1f} min** of training + {eval_s / 60:.1f} min of final evaluation.

## Final accuracy (exact match of the whole answer, greedy-equivalent, dense attention)
{args.eval_per_cell} samples per (task, length, depth), depths 0, 0.25, 0.5, 0.75, 1; seeds from 10000
(disjoint from training, which draws from its own per-step generators); "prose" after the length: the
prose haystack.

| task | length | exact match |
|---|---|---|
{rows}

Accuracy through vLLM (greedy decoding, SPEEDSFI dense and SFI): `bench/QUALITY.md`.
"""
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(text)
    names = sorted(n for n in os.listdir(args.out) if n != "SHA256SUMS" and not n.startswith("."))
    with open(os.path.join(args.out, "SHA256SUMS"), "w") as f:
        for n in names:
            f.write(f"{sha256(os.path.join(args.out, n))}  {n}\n")


if __name__ == "__main__":
    main()
