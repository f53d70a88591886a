"""Tiny Llama / Qwen2 / Qwen3 checkpoints with a locally trained BPE tokenizer, made offline.

They serve the demo (an embedded model when none is given) and the end-to-end tests. With
``sharp=True`` the 2-D weights are drawn with std 0.15 instead of 0.02, so attention is far from
uniform and an attention bug changes the greedy tokens (at 0.02 a broken attention can still
produce the same tokens).

    python -m vllm_ext.tools.tiny_models OUT_DIR [--arch llama qwen2 qwen3] [--dense]
"""

from __future__ import annotations

import argparse
import json
import os
import random

VOCAB = 512
ARCHS = ("llama", "qwen2", "qwen3")

_WORDS = ("the quick brown fox jumps over the lazy dog while sparse attention selects a few "
          "important blocks of keys and values for each decode step paged kv cache block table "
          "slot mapping query head group norm rotary embedding llama qwen model engine scheduler "
          "token prompt sample greedy").split()


def _corpus():
    rng = random.Random(0)
    ends = [".", ".", "?", "!", ";", ",", ""]
    for _ in range(3000):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
        yield words + rng.choice(ends) + ("\n" if rng.random() < 0.2 else "")
    for i in range(1000):
        yield f"number {i} {i * 7 % 1000} {i * 13 % 997}."


def build_tokenizer(out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def _config(arch: str, tok, num_layers: int, max_position: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_position, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "llama":
        return LlamaConfig(head_dim=32, **kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)          # head_dim = hidden / heads = 32
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, **kwargs)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def make_model(out_dir: str, arch: str = "qwen3", *, sharp: bool = True, num_layers: int = 2,
               max_position: int = 4096, dtype: str = "float32", seed: int = 0) -> str:
    """Write a checkpoint + tokenizer into ``out_dir`` (skipped when it is already there)."""
    import torch
    from transformers import AutoModelForCausalLM

    marker = os.path.join(out_dir, "tiny_model.json")
    spec = dict(arch=arch, sharp=sharp, num_layers=num_layers, max_position=max_position,
                dtype=dtype, seed=seed, vocab=VOCAB)
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == spec:
                return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, tok, num_layers, max_position))
    if sharp:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.15)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(spec, f)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", nargs="+", default=["qwen3"], choices=ARCHS)
    ap.add_argument("--dense", action="store_true", help="default init (std 0.02) instead of sharp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    for arch in args.arch:
        path = make_model(os.path.join(args.out_dir, f"tiny-{arch}"), arch, sharp=not args.dense,
                          num_layers=args.layers, dtype=args.dtype)
        print(path)


if __name__ == "__main__":
    main()
