#!/usr/bin/env python
"""The demo's document question over several logbooks, per configuration, through real vLLM (offline).

The demo (``scripts/demo.sh``) asks one question about one ~5K-token logbook through the chat
endpoint, with no answer prefix: the model writes a sentence and reaches the number mid-sentence. This
asks the same question about ``--seeds`` logbooks (``vllm_ext.quality.document``) for each
configuration, greedy, in one in-process engine per configuration, and records each answer, whether
it is right, and SFI's counters (slow and fast steps, the KV its fast steps read). Writes
``bench/results/<name>.json``.

    M=$(.venv/bin/python -m vllm_ext.tools.real_model | tail -1)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/eval_document_question.py --model $M --seeds 0,1,2,3,4,5 \\
        --configs '{"dense": {}, "default": {"sfi": {"enabled": true}}}' --name document_question_smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (python -m vllm_ext.tools.real_model)")
    p.add_argument("--seeds", default="0,1,2,3,4,5", help="one logbook per seed")
    p.add_argument("--length", type=int, default=5000, help="prompt tokens, chat template included")
    p.add_argument("--depth", type=float, default=0.5, help="where the fact sits (0 start, 1 end)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--configs", required=True,
                   help="JSON (inline or a file): a mapping name -> speedsfi section ({} = every method off)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default="document_question")
    return p.parse_args(argv)


def run_config(args, section, questions) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ext import metrics

    metrics.reset()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, attention_backend="SPEEDSFI",
              max_model_len=args.length + args.max_tokens + 64, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=1 << 30, seed=0,
              additional_config={"speedsfi": section} if section else {})
    try:
        t0 = time.time()
        outs = llm.chat([q.messages() for q in questions],
                        SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        seconds = time.time() - t0
        counters = {k: v for k, v in metrics.snapshot().items()
                    if k.startswith(("sfi.slow_steps", "sfi.fast_steps", "sfi.fast_retained_tokens",
                                     "sfi.fast_context_tokens", "critiprefill.", "fallback."))}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    answers = [{"seed": q.seed, "expected": q.answer, "answer": o.outputs[0].text,
                "correct": q.correct(o.outputs[0].text)} for q, o in zip(questions, outs)]
    fast_read = (counters.get("sfi.fast_retained_tokens", 0) / counters["sfi.fast_context_tokens"]
                 if counters.get("sfi.fast_context_tokens") else None)
    return {"speedsfi": section, "answers": answers, "correct": sum(a["correct"] for a in answers),
            "seconds": round(seconds, 1), "counters": counters, "fast_step_read": fast_read}


def _machine() -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from eval_quality import device_name

    kind, name = device_name()
    return name if kind == "cuda" else f"{name} (vLLM CPU build)"


def main(argv=None):
    args = parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # SPEEDSFI's counters in-process
    from transformers import AutoTokenizer

    from vllm_ext.quality.document import make_document_question

    text = open(args.configs).read() if os.path.isfile(args.configs) else args.configs
    configs = json.loads(text)
    tok = AutoTokenizer.from_pretrained(args.model)
    seeds = [int(s) for s in args.seeds.split(",")]
    questions = [make_document_question(tok, args.length, args.depth, s) for s in seeds]
    results = {}
    for name, section in configs.items():
        results[name] = run_config(args, section, questions)
        print(f"[document_question] {name}: {results[name]['correct']} / {len(questions)} "
              f"({results[name]['seconds']} s)", flush=True)
        for a in results[name]["answers"]:
            print(f"    seed {a['seed']} [{a['expected']}] {'right' if a['correct'] else 'wrong'}: {a['answer']!r}",
                  flush=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"model": os.path.basename(os.path.normpath(args.model)), "question": questions[0].question,
           "length": args.length, "depth": args.depth, "seeds": seeds, "max_tokens": args.max_tokens,
           "dtype": args.dtype, "machine": _machine(), "commit": commit,
           "command": "python scripts/eval_document_question.py " + " ".join(
               f"'{a}'" if a.startswith("{") else a for a in (argv if argv is not None else sys.argv[1:])),
           "results": results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"[document_question] wrote {path}")


if __name__ == "__main__":
    main()
