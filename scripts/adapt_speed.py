#!/usr/bin/env python
"""Adapt a Llama / Qwen2 / Qwen3 checkpoint to SPEED by self-distillation (no data set).

SPEED (docs/speed.md) keeps prompt tokens' KV only in the layers below ``l_cut``; a model trained
with full attention loses answers that way. This script teaches the model the rule with its own
dense behaviour as the teacher:

1. prompts of ``--min-length``..``--max-length`` tokens from the project's text generators
   (``vllm_ext.tools.speed_adaptation_prompts``: RULER-style needles, user needles, a logbook
   question, long-answer requests; seeds disjoint from every evaluation);
2. the dense model's greedy continuation of each (``--new-tokens``), and ``--inner-splits`` cuts
   inside the prompt whose next ``--inner-tokens`` tokens of text serve as a decode phase too;
   its dense next-token distributions at every decode-phase position are the targets;
3. PEFT LoRA adapters (``--lora-layers upper``: layers ``>= l_cut``; ``all``: every layer) trained so
   that the model under SPEED's visibility (BoS anchor, prompt KV only below ``l_cut``) matches
   them: KL(dense || SPEED) over the vocabulary;
4. the adapters merged into the weights and written as a checkpoint vLLM loads as is (same
   architecture and config, safetensors, the base's tokenizer files, ``speed_adaptation.json``).

    .venv/bin/python scripts/adapt_speed.py --model .cache/real_model/SmolLM2-135M-Instruct --l-cut 22
    vllm serve .cache/speed_adapted/SmolLM2-135M-Instruct-speed-l22 --attention-backend speedsfi \\
        --no-enable-prefix-caching --enforce-eager \\
        --additional-config '{"speedsfi": {"speed": {"enabled": true, "l_cut": 22}}}'

The output directory is a cache: a finished one of the same settings is kept (``--force`` rebuilds).
Teacher records are cached under ``--work-dir`` and reused by a rerun. With ``--lora-layers upper``
the layers below the cut are the dense model's, so the student runs only the upper layers on the
tokens that exist there, from the teacher's input to layer ``l_cut`` (cheap); ``all`` runs the whole
sequence under per-layer masks (for a GPU).
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
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # see scripts/train_retrieval_model.py

from vllm_ext.methods.speed import adaptation as A  # noqa: E402
from vllm_ext.tools.speed_adaptation_prompts import SOURCES, training_prompt  # noqa: E402

SPEED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", default=None,
                   help="default .cache/speed_adapted/<model name>-speed-l<l_cut>")
    p.add_argument("--l-cut", type=int, default=None, help="default 3/4 of the layers (the backend's default)")
    p.add_argument("--anchor", choices=("bos", "none"), default="bos")
    p.add_argument("--prompts", type=int, default=64, help="training prompts")
    p.add_argument("--heldout", type=int, default=8, help="held-out prompts for the before/after numbers")
    p.add_argument("--min-length", type=int, default=1024)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--new-tokens", type=int, default=48, help="the dense model's continuation per prompt")
    p.add_argument("--inner-splits", type=int, default=1, help="cuts inside each prompt used as decode phases")
    p.add_argument("--inner-tokens", type=int, default=32)
    p.add_argument("--lora-layers", choices=("upper", "all"), default="upper")
    p.add_argument("--dense-weight", type=float, default=0.0,
                   help="weight of the term that keeps the adapted model's own dense run where the original's "
                        "was (KL against the teacher of the upper layers run dense; --lora-layers upper only); "
                        "0: SPEED's term alone")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--targets", default=",".join(A.LORA_TARGETS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="records per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (a LoRA delta can vanish when rounded to bf16)")
    p.add_argument("--teacher-minutes", type=float, default=None,
                   help="stop drawing training prompts after this long (the records so far are used)")
    p.add_argument("--work-dir", default=os.path.join(ROOT, ".cache", "speed_adapt_work"))
    p.add_argument("--results", default=None, help="also write the run's JSON here (bench/results/...)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--force", action="store_true", help="rebuild even when --out is a finished adaptation")
    args = p.parse_args(argv)
    args.model = os.path.abspath(args.model)
    return args


def log(msg) -> None:
    if not isinstance(msg, str):
        msg = json.dumps(msg)
    print(f"[adapt_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def data_spec(args, l_cut: int) -> dict:
    """What the teacher records depend on."""
    return dict(model=os.path.basename(args.model.rstrip("/")),
                weights_sha256=A.sha256(os.path.join(args.model, "model.safetensors"))
                if os.path.exists(os.path.join(args.model, "model.safetensors")) else None,
                l_cut=l_cut, anchor=args.anchor, min_length=args.min_length, max_length=args.max_length,
                sources=args.sources, new_tokens=args.new_tokens, inner_splits=args.inner_splits,
                inner_tokens=args.inner_tokens, seed=args.seed,
                **({"keep_dense": True} if args.dense_weight > 0 else {}))


def run_spec(args, data: dict) -> dict:
    return dict(data, prompts=args.prompts, heldout=args.heldout, lora_layers=args.lora_layers,
                lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, targets=args.targets,
                steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, dtype=args.dtype,
                **({"dense_weight": args.dense_weight} if args.dense_weight > 0 else {}))


# ------------------------------------------------------------------------------------------------
class RecordStore:
    """Teacher records per prompt index, cached in one file per data spec (resumable)."""

    def __init__(self, work_dir: str, spec: dict):
        import torch

        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        os.makedirs(work_dir, exist_ok=True)
        self.path = os.path.join(work_dir, f"records_{key}.pt")
        self.by_prompt: dict[int, dict] = {}
        if os.path.exists(self.path):
            self.by_prompt = torch.load(self.path, weights_only=False)

    def save(self) -> None:
        import torch

        torch.save(self.by_prompt, self.path + ".tmp")
        os.replace(self.path + ".tmp", self.path)


def build_records(model, tokenizer, store: RecordStore, indices, args, l_cut, anchor_end, eos_ids,
                  deadline: float | None) -> None:
    sources = tuple(s for s in args.sources.split(",") if s)
    fresh = 0
    for i in indices:
        if i in store.by_prompt:
            continue
        if deadline is not None and time.time() > deadline:
            log(f"teacher time budget reached after {fresh} new prompts")
            break
        t0 = time.time()
        tp = training_prompt(tokenizer, i, min_length=args.min_length, max_length=args.max_length,
                             seed=args.seed, sources=sources)
        rng = random.Random(f"speed-adapt-split|{args.seed}|{i}")
        p = len(tp.prompt_ids)
        splits = [(rng.randint(p // 4, p - args.inner_tokens), args.inner_tokens)
                  for _ in range(args.inner_splits) if p - args.inner_tokens > p // 4]
        records, generated = A.teacher_records(model, tp.prompt_ids, tp.source, l_cut=l_cut,
                                               anchor_end=anchor_end, new_tokens=args.new_tokens,
                                               eos_ids=eos_ids, inner_splits=splits,
                                               keep_dense=args.dense_weight > 0)
        store.by_prompt[i] = dict(records=records, prompt_tokens=p, generated=len(generated),
                                  seconds=time.time() - t0)
        fresh += 1
        log(dict(prompt=i, source=tp.source, tokens=p, generated=len(generated),
                 s=round(time.time() - t0, 1), text=tokenizer.decode(generated[:24])))
        if fresh % 4 == 0:
            store.save()
    if fresh:
        store.save()


def evaluate(model, records, l_cut, anchor_end, lm_head, masks=None) -> dict:
    import torch

    kls, agree = [], []
    with torch.no_grad():
        for r in records:
            kl, a = A.record_loss(model, r, l_cut=l_cut, anchor_end=anchor_end, lm_head=lm_head, masks=masks)
            kls.append(kl.item())
            agree.append(a.item())
    return dict(kl=sum(kls) / len(kls), top1_agreement=sum(agree) / len(agree), records=len(records))


def dense_drift(model, records, lm_head) -> dict:
    """The adapted model run dense against the teacher on the continuation records."""
    import torch

    kls, agree = [], []
    with torch.no_grad():
        for r in records:
            logits = model(input_ids=torch.tensor([r.ids]), use_cache=False).logits[0, r.prompt_len - 1:]
            teacher = A.teacher_logprobs(r, lm_head)
            kls.append(A.distill_kl(logits, teacher).item())
            agree.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return dict(kl=sum(kls) / len(kls), top1_agreement=sum(agree) / len(agree), records=len(records))


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None):
    args = parse(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    config = AutoConfig.from_pretrained(args.model)
    archs = set(getattr(config, "architectures", None) or [])
    if not archs & set(SPEED_ARCHITECTURES):
        raise SystemExit(f"SPEED supports {', '.join(SPEED_ARCHITECTURES)}; {args.model} is {sorted(archs)}")
    n_layers = config.num_hidden_layers
    l_cut = args.l_cut if args.l_cut is not None else max(1, 3 * n_layers // 4)
    if not 0 < l_cut < n_layers:
        raise SystemExit(f"--l-cut must be in [1, {n_layers - 1}], got {l_cut}")
    if args.dense_weight < 0 or (args.dense_weight > 0 and args.lora_layers != "upper"):
        raise SystemExit("--dense-weight: a weight >= 0, and with --lora-layers upper only (adapters below l_cut "
                         "change the dense input to the upper layers)")
    name = os.path.basename(args.model.rstrip("/"))
    out = args.out or os.path.join(ROOT, ".cache", "speed_adapted", f"{name}-speed-l{l_cut}")
    data = data_spec(args, l_cut)
    spec = run_spec(args, data)
    if not args.force and A.finished_checkpoint(out, spec):
        log(f"cached: {out}")
        print(out)
        return out

    torch._C.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    anchor_end = 1 if args.anchor == "bos" else 0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}

    # 1-2. teacher records (cached)
    store = RecordStore(args.work_dir, data)
    t0 = time.time()
    deadline = None if args.teacher_minutes is None else t0 + 60 * args.teacher_minutes
    heldout_idx = list(range(args.prompts, args.prompts + args.heldout))
    build_records(model, tokenizer, store, heldout_idx, args, l_cut, anchor_end, eos_ids, None)
    build_records(model, tokenizer, store, range(args.prompts), args, l_cut, anchor_end, eos_ids, deadline)
    teacher_s = time.time() - t0
    train_idx = [i for i in range(args.prompts) if i in store.by_prompt]
    train = [r for i in train_idx for r in store.by_prompt[i]["records"]]
    held = [r for i in heldout_idx for r in store.by_prompt[i]["records"]]
    held_cont = [r for r in held if not r.source.endswith("/text")]
    log(f"records: {len(train)} training ({len(train_idx)} prompts), {len(held)} held out; "
        f"teacher {teacher_s / 60:.1f} min")

    # 3. adapters
    model = A.attach_lora(model, l_cut=l_cut, rank=args.lora_rank, alpha=args.lora_alpha,
                          layers=args.lora_layers, targets=tuple(args.targets.split(",")))
    lm_head = model.get_base_model().lm_head
    masks = A.SpeedAttentionMasks(model, l_cut, anchor_end) if args.lora_layers == "all" else None
    with torch.no_grad():
        for r in train:            # the teacher's side of the loss, once per record (fp16 in memory)
            r.cached = A.teacher_logprobs(r, lm_head).half()
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    before = evaluate(model, held, l_cut, anchor_end, lm_head, masks)
    log({"heldout_before": before, "trainable_params": n_trainable})
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(f"speed-adapt-order|{args.seed}")
    order: list[int] = []
    history = []
    model.train()
    t1 = time.time()
    run = dict(kl=0.0, agree=0.0, dense_kl=0.0, n=0)
    rows_trained = 0
    for step in range(args.steps):
        batch = []
        while len(batch) < args.batch:
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            batch.append(train[order.pop()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=True)
        for r in batch:
            kl, agree = A.record_loss(model, r, l_cut=l_cut, anchor_end=anchor_end, lm_head=lm_head,
                                      masks=masks)
            loss = kl
            if args.dense_weight > 0:
                dense_kl = A.dense_keep_loss(model, r, l_cut=l_cut, lm_head=lm_head)
                loss = kl + args.dense_weight * dense_kl
                run["dense_kl"] += dense_kl.item()
            (loss / len(batch)).backward()
            run["kl"] += kl.item()
            run["agree"] += agree.item()
            run["n"] += 1
            rows_trained += r.decode_rows
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = dict(step=step + 1, kl=round(run["kl"] / run["n"], 4),
                       top1_agreement=round(run["agree"] / run["n"], 4), lr=round(lr_at(step, args), 6),
                       elapsed_min=round((time.time() - t1) / 60, 2),
                       **({"dense_kl": round(run["dense_kl"] / run["n"], 4)} if args.dense_weight > 0 else {}))
            history.append(rec)
            log(rec)
            run = dict(kl=0.0, agree=0.0, dense_kl=0.0, n=0)
    train_s = time.time() - t1
    model.eval()
    after = evaluate(model, held, l_cut, anchor_end, lm_head, masks)
    t2 = time.time()
    drift = dense_drift(model, held_cont, lm_head)
    drift_s = time.time() - t2
    log({"heldout_after": after, "dense_drift": drift})
    if masks is not None:
        masks.remove()

    # 4. merged checkpoint
    cmd = ".venv/bin/python scripts/adapt_speed.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    prompt_tokens = sum(store.by_prompt[i]["prompt_tokens"] for i in train_idx)
    generated = sum(store.by_prompt[i]["generated"] for i in train_idx)
    result = dict(
        command=cmd, spec=spec, base_model=args.model.replace(ROOT + "/", ""), out=out.replace(ROOT + "/", ""),
        l_cut=l_cut, num_layers=n_layers, anchor=args.anchor,
        training_prompts=len(train_idx), training_records=len(train), heldout_prompts=len(heldout_idx),
        heldout_records=len(held), teacher_prompt_tokens=prompt_tokens, teacher_generated_tokens=generated,
        decode_rows_trained=rows_trained, steps=args.steps, records_per_step=args.batch,
        trainable_params=n_trainable, sources=sorted({r.source for r in train}),
        heldout_before=before, heldout_after=after, dense_drift_heldout=drift, history=history,
        wall_s=dict(teacher=round(teacher_s, 1), train=round(train_s, 1), dense_drift_eval=round(drift_s, 1),
                    total=round(time.time() - t_start, 1),
                    # every prompt's teacher pass, those a previous run cached included
                    teacher_all_prompts=round(sum(store.by_prompt[i]["seconds"]
                                                  for i in train_idx + heldout_idx), 1)),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        torch=torch.__version__, finished=dt.datetime.now().strftime("%Y-%m-%d %H:%M"))
    A.save_merged(model, args.model, out, card=dict(result, spec=spec), dtype=args.dtype)
    result["wall_s"]["total"] = round(time.time() - t_start, 1)
    if args.results:
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(result, f, indent=1)
    log(f"wrote {out}")
    print(out)
    return out


if __name__ == "__main__":
    main()
