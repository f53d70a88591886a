"""The GPU driver's models and configurations (bench/vllm_e2e.py): the model shapes (random weights), the
SPEEDSFI / baseline configurations each engine runs, and the local model folders (config.json +
a word-level tokenizer) and prompts. No vLLM, no torch at import."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(arch="LlamaForCausalLM", family="llama", layers=32, hidden=4096, heads=32,
                         kv_heads=8, head_dim=128, inter=14336, vocab=128256, rope_theta=500000.0,
                         tie=False),
    "qwen3-4b": dict(arch="Qwen3ForCausalLM", family="qwen3", layers=36, hidden=2560, heads=32,
                     kv_heads=8, head_dim=128, inter=9728, vocab=151936, rope_theta=1000000.0,
                     tie=True),
    # the smoke stage's small model (GPU)
    "tiny-llama": dict(arch="LlamaForCausalLM", family="llama", layers=4, hidden=1024, heads=8,
                       kv_heads=2, head_dim=128, inter=2816, vocab=32000, rope_theta=500000.0,
                       tie=False),
    # --cpu (the CPU build of vLLM, tests of this script)
    "cpu-tiny-llama": dict(arch="LlamaForCausalLM", family="llama", layers=2, hidden=128, heads=4,
                           kv_heads=2, head_dim=32, inter=256, vocab=1024, rope_theta=10000.0,
                           tie=False),
    "cpu-tiny-qwen3": dict(arch="Qwen3ForCausalLM", family="qwen3", layers=2, hidden=128, heads=4,
                           kv_heads=2, head_dim=32, inter=256, vocab=1024, rope_theta=10000.0,
                           tie=True),
}
TRIGGER_EVERY = 24                # about 1 in 24 vocabulary words ends in "."
N_SPECIAL = 3                     # <unk> <s> </s>

SFI_SMALL = {"sfi": {"enabled": True, "k": 64, "k_min": 4, "n_sink": 4, "n_recent": 32}}
SFI_CPU = {"sfi": {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4, "n_recent": 16}}

# name -> backend (None: vLLM picks, as `vllm serve MODEL` with no flags), SPEEDSFI section (or
# "cover": a budget covering the context), extra environment
CONFIGS: dict[str, dict[str, Any]] = {
    # what users run by default: vLLM 0.32's Model Runner V2 and the attention backend it picks
    # (FLASH_ATTN on Hopper for these models)
    "vllm_default": dict(backend=None, speedsfi=None, env={}),
    # vLLM's Triton backend on the V1 model runner, the runner SPEEDSFI uses: like for like
    "triton": dict(backend="TRITON_ATTN", speedsfi=None, env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    # vLLM's Triton backend as a user gets it (vLLM 0.32 picks Model Runner V2 for it on CUDA)
    "triton_v2": dict(backend="TRITON_ATTN", speedsfi=None, env={}),
    # every method off: the delegate (== TRITON_ATTN), and through our paged_decode (the dense kernel
    # of SFI's dense rows: SFI's like-for-like reference)
    "speedsfi_dense": dict(backend="SPEEDSFI", speedsfi={"preset": "dense"}, env={}),
    "speedsfi_dense_pd": dict(backend="SPEEDSFI", speedsfi={"preset": "dense", "dense_decode": "paged_decode"},
                              env={}),
    "speedsfi_sfi": dict(backend="SPEEDSFI", speedsfi={"preset": "sfi"}, env={}),
    # the same with FLASH_ATTN (FA3) as the dense delegate of prefill rows (opt-in, first GPU run due)
    "speedsfi_sfi_fa": dict(backend="SPEEDSFI", speedsfi={"preset": "sfi", "dense_delegate": "flash_attn"},
                            env={}),
    "speedsfi_dense_fa": dict(backend="SPEEDSFI", speedsfi={"preset": "dense", "dense_delegate": "flash_attn"},
                              env={}),
    # dense_delegate "auto": the backend vLLM picks (FLASH_ATTN/FA3 on Hopper) attends the dense rows
    # (the candidate default, opt-in until this run checks it token for token)
    "speedsfi_sfi_auto": dict(backend="SPEEDSFI", speedsfi={"preset": "sfi", "dense_delegate": "auto"}, env={}),
    "speedsfi_dense_auto": dict(backend="SPEEDSFI", speedsfi={"preset": "dense", "dense_delegate": "auto"},
                                env={}),
    # vLLM's default backend (FLASH_ATTN on Hopper) on the V1 model runner, SPEEDSFI's runner: the
    # runner's share of any gap with vllm_default, and the like-for-like reference of all off + auto
    "flash_attn_v1": dict(backend="FLASH_ATTN", speedsfi=None, env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "speedsfi_sfi_speed": dict(backend="SPEEDSFI", speedsfi={"preset": "sfi", "speed": {"enabled": True}}, env={}),
    "speedsfi_critiprefill": dict(backend="SPEEDSFI", speedsfi={"preset": "critiprefill"}, env={}),
    # a budget covering the whole context: every decode row must be dense
    "speedsfi_sfi_full": dict(backend="SPEEDSFI", speedsfi="cover", env={}),
    "speedsfi_sfi_small": dict(backend="SPEEDSFI", speedsfi=SFI_SMALL, env={}),
}


def speedsfi_section(config: str, max_model_len: int, cpu: bool, max_num_seqs: int | None = None) -> dict | None:
    """The configuration's ``speedsfi`` section. With ``max_num_seqs`` and SFI on, ``sfi.max_requests``
    is raised to it: SFI holds at most ``max_requests`` requests at once (default ``min(max_num_seqs,
    32)``) and the scheduler queues the others (``vllm_ext.scheduler_policy``), so a batch larger than
    32 would otherwise be measured 32 at a time."""
    section = _section(config, max_model_len, cpu)
    if max_num_seqs and section is not None and _sfi_on(section):
        section = dict(section, sfi=dict(section.get("sfi") or {}, max_requests=int(max_num_seqs)))
    return section


def _sfi_on(section: dict) -> bool:
    from vllm_ext.config import SpeedSfiConfig

    return SpeedSfiConfig.from_dict(section).sfi.enabled


def _section(config: str, max_model_len: int, cpu: bool) -> dict | None:
    spec = CONFIGS[config]["speedsfi"]
    if spec == "cover":
        return {"sfi": {"enabled": True, "k": int(max_model_len), "n_recent": 256}}
    if cpu and config in ("speedsfi_sfi", "speedsfi_sfi_small"):
        return SFI_CPU          # the tiny CPU prompts are shorter than the preset's budget
    if cpu and config == "speedsfi_sfi_speed":
        return dict(SFI_CPU, speed={"enabled": True})
    if cpu and config == "speedsfi_critiprefill":
        return {"critiprefill": {"enabled": True, "segment_size": 64, "block_size": 32, "budget": 64,
                                 "min_len": 96}}
    return spec


def backend_of(config: str, cpu: bool) -> str | None:
    b = CONFIGS[config]["backend"]
    if cpu and b in ("TRITON_ATTN", None):
        return "CPU_ATTN"
    return b


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    m = MODELS[model]
    return m["layers"] * m["kv_heads"] * m["head_dim"] * 2 * dtype_bytes


def param_count(model: str) -> int:
    m = MODELS[model]
    h, hd = m["hidden"], m["head_dim"]
    per_layer = h * (m["heads"] + 2 * m["kv_heads"]) * hd + m["heads"] * hd * h + 3 * h * m["inter"]
    emb = m["vocab"] * h * (1 if m["tie"] else 2)
    return m["layers"] * per_layer + emb


# ------------------------------------------------------------------------------------------------
# local model folders: config.json written with transformers + a word-level tokenizer
# ------------------------------------------------------------------------------------------------

def trigger_ids(vocab: int, seed: int = 0, every: int = TRIGGER_EVERY) -> set[int]:
    """The ids whose word ends in "." : a seeded sample of ~1/every of the non-special ids."""
    ids = list(range(N_SPECIAL, vocab))
    rng = random.Random(seed)
    return set(rng.sample(ids, round(len(ids) / every)))


def token_strings(vocab: int, seed: int = 0) -> list[str]:
    trig = trigger_ids(vocab, seed)
    words = ["<unk>", "<s>", "</s>"]
    words += [f"w{i}." if i in trig else f"w{i}" for i in range(N_SPECIAL, vocab)]
    return words


def build_tokenizer(out_dir: str | Path, vocab: int, seed: int = 0):
    """A ``PreTrainedTokenizerFast`` (WordLevel, ids 0..vocab-1) saved into ``out_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = token_strings(vocab, seed)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(out_dir))
    return fast


def write_config(out_dir: str | Path, model: str, max_position: int) -> dict:
    """config.json with transformers (architectures and dtype bfloat16 set)."""
    import transformers

    m = MODELS[model]
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[m["family"]]
    kw = dict(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
              num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
              num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
              max_position_embeddings=max_position, tie_word_embeddings=m["tie"],
              bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    try:
        cfg = cls(**kw, rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]})
    except TypeError:                                   # transformers < 5
        cfg = cls(**kw, rope_theta=m["rope_theta"])
    cfg.architectures = [m["arch"]]
    if hasattr(cfg, "dtype"):                           # transformers 5: "dtype" (4: torch_dtype)
        cfg.dtype = "bfloat16"
    else:                                               # pragma: no cover - transformers 4
        cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(str(out_dir))
    with open(Path(out_dir) / "config.json") as f:
        return json.load(f)


def make_model_dir(root: str | Path, model: str, max_position: int = 262144) -> str:
    """``root/model`` with config.json + tokenizer; reused when already made with the same inputs."""
    d = Path(root) / model
    stamp = d / ".vllm_e2e_stamp"
    want = json.dumps({"model": MODELS[model], "max_position": max_position, "trigger_every": TRIGGER_EVERY})
    if stamp.is_file() and stamp.read_text() == want:
        return str(d)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    write_config(d, model, max_position)
    build_tokenizer(d, MODELS[model]["vocab"])
    stamp.write_text(want)
    return str(d)


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Distinct random token-id prompts (non-special ids), one per length, seeded."""
    out = []
    for i, n in enumerate(lengths):
        rng = random.Random(f"{seed}:{n}:{i}")
        out.append([rng.randrange(N_SPECIAL, vocab) for _ in range(n)])
    return out


