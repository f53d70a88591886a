"""Self-distillation of a Hugging Face checkpoint to SPEED's visibility rule (the model side).

The student is the model under SPEED (:mod:`vllm_ext.methods.speed.visibility`: layers ``>= l_cut``
hold only the anchors and the decode-phase tokens, positions never renumbered); the teacher is the
same model, dense. The loss is KL(teacher || student) over the vocabulary at the decode-phase
positions ``P - 1 ..`` of each sequence (``P`` the prompt length).

Two student forwards, the same function of the weights:

* :func:`speed_logits` runs the whole sequence with per-layer attention masks (forward pre-hooks:
  causal below ``l_cut``, :func:`~vllm_ext.methods.speed.visibility.visible_mask` from it), for
  adapters on every layer;
* :func:`upper_stack_logits` runs only the upper layers on the tokens that exist there, from the
  dense model's input to layer ``l_cut`` (exact when the layers below ``l_cut`` are not adapted: below
  the cut SPEED is dense), the way the backend runs them (``vllm_ext.methods.speed.upper_stack``);
  among those tokens the rule is plain causal attention.

torch, transformers and peft are imported inside the functions: importing this module needs none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass

from vllm_ext.methods.speed.visibility import visible_mask

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# files a checkpoint directory carries besides its weights and config (copied as they are)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt")
CARD = "speed_adaptation.json"


def decoder(model):
    """The decoder stack (``model.model`` of a ``*ForCausalLM``; through a PEFT wrapper too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _additive(allowed):
    import torch

    out = torch.zeros(allowed.shape, dtype=torch.float32)
    return out.masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def upper_layer_mask(width: int, prompt_len: int, anchor_end: int, self_only: bool = False):
    """``[1, 1, width, width]`` additive mask of an upper layer for one sequence. Interior prompt
    queries (their upper-layer output is never used) also see themselves, so no row is empty."""
    import torch

    pos = torch.arange(width)
    allowed = visible_mask(pos, pos, prompt_len, anchor_end, self_only)
    allowed |= torch.eye(width, dtype=torch.bool) & (pos[:, None] < prompt_len - 1)
    return _additive(allowed)


def causal_mask(width: int):
    import torch

    pos = torch.arange(width)
    return _additive(pos[None, :] <= pos[:, None])


def kept_positions(prompt_len: int, total_len: int, anchor_end: int) -> list[int]:
    """The positions that exist in the upper layers: the anchors and ``[P - 1, total_len)``."""
    tail = max(prompt_len - 1, 0)
    return list(range(min(anchor_end, tail))) + list(range(tail, total_len))


class SpeedAttentionMasks:
    """Forward pre-hooks that give every decoder layer its SPEED mask for the sequence being run
    (``set(prompt_len)`` before a forward; ``None``: the model's own causal attention)."""

    def __init__(self, model, l_cut: int, anchor_end: int = 1, self_only: bool = False):
        self.l_cut, self.anchor_end, self.self_only = l_cut, anchor_end, self_only
        self.prompt_len: int | None = None
        self._masks: dict = {}
        self._handles = [layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(decoder(model).layers)]

    def set(self, prompt_len: int | None) -> None:
        self.prompt_len = prompt_len

    def _mask(self, upper: bool, width: int):
        key = (upper, width, self.prompt_len)
        if key not in self._masks:
            if len(self._masks) > 8:
                self._masks.clear()
            self._masks[key] = (upper_layer_mask(width, self.prompt_len, self.anchor_end, self.self_only)
                                if upper else causal_mask(width))
        return self._masks[key]

    def _hook(self, index: int):
        def pre(module, args, kwargs):
            if self.prompt_len is not None:
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                mask = self._mask(index >= self.l_cut, hidden.shape[1])
                kwargs["attention_mask"] = mask.to(hidden.dtype)
            return args, kwargs
        return pre

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def speed_logits(model, masks: SpeedAttentionMasks, ids: list[int], prompt_len: int):
    """Logits ``[len(ids), vocab]`` of the whole sequence under SPEED (rows ``>= P - 1`` are the
    ones SPEED defines; the others belong to tokens the backend never samples from)."""
    import torch

    masks.set(prompt_len)
    try:
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        masks.set(None)


def upper_stack_logits(model, h_cut, positions, l_cut: int):
    """Logits ``[K, vocab]`` of the ``K`` kept tokens (``positions``, ascending, int64) from their
    input to layer ``l_cut`` (``h_cut [K, hidden]``): the upper layers with causal attention among
    the kept tokens at their own positions, the final norm and the LM head."""
    inner = decoder(model)
    h = h_cut[None]
    pos = positions[None]
    mask = causal_mask(h.shape[1]).to(h.dtype)
    emb = inner.rotary_emb(h, position_ids=pos)
    for layer in inner.layers[l_cut:]:
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=emb)
        h = out[0] if isinstance(out, tuple) else out
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.lm_head(inner.norm(h))[0]


def distill_kl(student_logits, teacher_logprobs):
    """Mean over rows of KL(teacher || student), in nats (fp32)."""
    import torch.nn.functional as F

    t = teacher_logprobs.float()
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def teacher_logprobs(record: "TeacherRecord", lm_head):
    """The teacher's log-probabilities at the record's decode-phase rows (``record.cached`` when set:
    a training run computes them once per record)."""
    import torch

    if record.cached is not None:
        return record.cached
    with torch.no_grad():
        return torch.log_softmax(lm_head(record.final).float(), dim=-1)


def dense_keep_loss(model, record: TeacherRecord, *, l_cut: int, lm_head):
    """KL(teacher || the adapted model run dense) at the record's decode-phase rows, with adapters in
    the upper layers only (below ``l_cut`` the adapted model is the original, so its dense input to
    layer ``l_cut`` is the teacher's ``h_dense``): the term that keeps an adapted checkpoint's dense
    run where the original's was."""
    import torch

    if record.h_dense is None:
        raise ValueError("dense_keep_loss: the record keeps no h_dense (teacher_records(keep_dense=True))")
    positions = torch.arange(len(record.ids), dtype=torch.int64)
    logits = upper_stack_logits(model, record.h_dense, positions, l_cut)[record.prompt_len - 1:]
    return distill_kl(logits, teacher_logprobs(record, lm_head))


# ------------------------------------------------------------------------------------------------
# The teacher: the dense model's continuation and its distributions
# ------------------------------------------------------------------------------------------------
@dataclass
class TeacherRecord:
    """One training sequence. ``ids``: the tokens fed (prompt, then the continuation but its last
    token); decode-phase positions ``P - 1 .. len(ids) - 1``, one teacher distribution each.
    ``positions`` / ``h_cut``: the tokens that exist in the upper layers and their input to layer
    ``l_cut``; ``final``: the dense model's final-norm output at the decode-phase positions (teacher
    logits are ``lm_head(final)``, recomputed: a full vocabulary per position does not fit)."""

    source: str
    ids: list[int]
    prompt_len: int
    positions: object      # int64 [K]
    h_cut: object          # [K, hidden]
    final: object          # [len(ids) - P + 1, hidden]
    cached: object = None  # teacher log-probabilities, kept in memory by a training run
    h_dense: object = None  # [len(ids), hidden]: every position's input to layer l_cut (dense_keep_loss)

    @property
    def decode_rows(self) -> int:
        return len(self.ids) - self.prompt_len + 1


class HiddenCapture:
    """Forward hooks that keep the input of layer ``l_cut`` and the final norm's output."""

    def __init__(self, model, l_cut: int):
        inner = decoder(model)
        self.h_cut = self.final = None
        n = len(inner.layers)
        self._handles = [inner.norm.register_forward_hook(self._keep_final)]
        if l_cut < n:
            self._handles.append(inner.layers[l_cut].register_forward_pre_hook(self._keep_cut,
                                                                                with_kwargs=True))

    def _keep_cut(self, module, args, kwargs):
        self.h_cut = kwargs.get("hidden_states", args[0] if args else None)[0].detach()

    def _keep_final(self, module, args, out):
        self.final = out[0].detach()

    def remove(self):
        for h in self._handles:
            h.remove()


def teacher_records(model, prompt_ids: list[int], source: str, *, l_cut: int, anchor_end: int,
                    new_tokens: int, eos_ids: set[int], inner_splits: list[tuple[int, int]] = (),
                    keep_dense: bool = False):
    """The dense model's greedy continuation of ``prompt_ids`` (at most ``new_tokens``, stopping
    after an end-of-sequence token) as one record, plus one record per ``(P', n)`` of
    ``inner_splits``: the prompt cut at ``P'`` with its own next ``n`` tokens as the decode phase
    (the document's text, with the dense model's distributions over it). One prefill and one step
    per generated token, KV-cached. ``keep_dense``: each record also keeps every position's input to
    layer ``l_cut`` (``h_dense``, for :func:`dense_keep_loss`)."""
    import torch

    cap = HiddenCapture(model, l_cut)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
            cut_rows, final_rows = [cap.h_cut], [cap.final[-1:]]
            prompt_cut, prompt_final = cap.h_cut, cap.final
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated = [token]
            while len(generated) < new_tokens and token not in eos_ids:
                out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                cut_rows.append(cap.h_cut)
                final_rows.append(cap.final)
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
    finally:
        cap.remove()
    p = len(prompt_ids)
    ids = list(prompt_ids) + generated[:-1]
    h_cut_all = torch.cat(cut_rows, 0)          # positions 0 .. len(ids) - 1
    records = [_record(source, ids, p, h_cut_all, torch.cat(final_rows, 0), anchor_end, keep_dense)]
    for split, n in inner_splits:
        if not (1 < split and split + n - 1 <= p):
            raise ValueError(f"inner split ({split}, {n}) outside a {p}-token prompt")
        sub = list(prompt_ids[:split + n - 1])
        records.append(_record(f"{source}/text", sub, split, prompt_cut[:len(sub)],
                               prompt_final[split - 1:split + n - 1], anchor_end, keep_dense))
    return records, generated


def _record(source, ids, prompt_len, h_cut_all, final, anchor_end, keep_dense=False) -> TeacherRecord:
    import torch

    keep = kept_positions(prompt_len, len(ids), anchor_end)
    idx = torch.tensor(keep, dtype=torch.int64)
    return TeacherRecord(source=source, ids=ids, prompt_len=prompt_len, positions=idx,
                         h_cut=h_cut_all[idx].clone(), final=final.clone(),
                         h_dense=h_cut_all[:len(ids)].clone() if keep_dense else None)


def record_loss(model, record: TeacherRecord, *, l_cut: int, anchor_end: int, lm_head,
                masks: SpeedAttentionMasks | None = None):
    """(KL, top-1 agreement) of the student on one record: :func:`upper_stack_logits` when
    ``masks`` is None, else :func:`speed_logits` (adapters below ``l_cut`` too)."""
    teacher = teacher_logprobs(record, lm_head)
    if masks is None:
        logits = upper_stack_logits(model, record.h_cut, record.positions, l_cut)
        student = logits[-record.decode_rows:]
    else:
        student = speed_logits(model, masks, record.ids, record.prompt_len)[record.prompt_len - 1:]
    kl = distill_kl(student, teacher)
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return kl, agree


# ------------------------------------------------------------------------------------------------
# Adapters and the merged checkpoint
# ------------------------------------------------------------------------------------------------
def attach_lora(model, *, l_cut: int, rank: int, alpha: float, layers: str = "upper",
                targets=LORA_TARGETS):
    """PEFT LoRA on ``targets`` of the layers from ``l_cut`` (``layers="upper"``) or of every layer."""
    from peft import LoraConfig, get_peft_model

    n = model.config.num_hidden_layers
    if layers not in ("upper", "all"):
        raise ValueError(f"layers must be 'upper' or 'all', got {layers!r}")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                     layers_to_transform=list(range(l_cut, n)) if layers == "upper" else None,
                     layers_pattern="layers" if layers == "upper" else None, bias="none")
    return get_peft_model(model, cfg)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_merged(peft_model, base_dir: str, out_dir: str, card: dict, dtype: str = "float32") -> str:
    """Merge the adapters into the weights and write a checkpoint vLLM loads as it loads the base:
    the base's ``config.json`` (its ``dtype`` set to the weights' dtype), safetensors weights, the
    base's tokenizer files byte for byte and ``speed_adaptation.json`` (``card`` and checksums).
    Written beside ``out_dir`` and renamed into place, so a partial directory never looks done."""
    import torch

    model = peft_model.merge_and_unload()
    model = model.to(getattr(torch, dtype))
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(base_dir, "config.json")) as f:
        config = json.load(f)
    stored = {k: dtype for k in ("dtype", "torch_dtype") if k in config and config[k] != dtype}
    if stored:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dict(config, **stored), f, indent=2)
            f.write("\n")
    else:
        shutil.copyfile(os.path.join(base_dir, "config.json"), os.path.join(tmp, "config.json"))
    for name in TOKENIZER_FILES:
        src = os.path.join(base_dir, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(tmp, name))
    files = sorted(n for n in os.listdir(tmp) if not n.startswith("."))
    for n in files:
        os.chmod(os.path.join(tmp, n), 0o644)
    card = dict(card, files={n: sha256(os.path.join(tmp, n)) for n in files})
    with open(os.path.join(tmp, CARD), "w") as f:
        json.dump(card, f, indent=1)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def finished_checkpoint(out_dir: str, spec: dict) -> bool:
    """Whether ``out_dir`` holds a finished adaptation of ``spec`` with every file intact."""
    path = os.path.join(out_dir, CARD)
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        card = json.load(f)
    if card.get("spec") != spec:
        return False
    return all(os.path.isfile(os.path.join(out_dir, n)) and sha256(os.path.join(out_dir, n)) == h
               for n, h in card.get("files", {}).items())
