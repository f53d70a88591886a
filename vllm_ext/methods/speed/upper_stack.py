"""SPEED's compute saving: prompt tokens skip the upper layers (vLLM glue).

The decoder models SPEED supports (vLLM's ``LlamaModel`` and ``Qwen2Model``, which ``Qwen3Model``
inherits) run their layers in one loop. With SPEED on, :func:`speed_model_forward` replaces that
forward: the lower layers (``< l_cut``) run on every token; the hidden states, residuals and
positions of the tokens that exist in the upper layers (the anchors, the last prompt token, the
decode tokens: the plan's ``keep_idx``, built by the metadata builder from the host geometry) are
gathered; the upper layers run on those rows only; their results are scattered back before the
final norm. The other rows keep their lower-stack state: their logits are never sampled (a prompt's
last token is always kept), so prompt logprobs are refused with SPEED. Positions are not renumbered.
The upper layers' attention sees the compacted rows (``SpeedSfiImpl._forward_speed_upper``).

This follows vLLM's own token dropping between a lower and an upper stack (the KV-sharing fast
prefill of Gemma3n / YOCO). The gather has a data-dependent size, so it runs where the model runs
eagerly (``--enforce-eager`` or compilation off); where vLLM compiles the model the upper layers run
on every token with SPEED's masking (same outputs, no compute saved), logged once and counted
(``fallback.speed_compute_compiled``).
"""

from __future__ import annotations

import functools
from itertools import islice

import torch

from vllm_ext import metrics

_PATCHED_ATTR = "_speedsfi_patched"


def _current_plan():
    """The step's SPEED plan (any SPEEDSFI metadata of the forward context carries it)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if not isinstance(md, dict):
        return None
    for m in md.values():
        plan = getattr(m, "plans", {}).get("speed")
        if plan is not None:
            return plan
    return None


def speed_model_forward(model, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                        *, plan, l_cut: int, **layer_kwargs):
    """The decoder forward with the upper stack on the plan's kept rows (see module doc)."""
    hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
    residual = None
    for layer in islice(model.layers, model.start_layer, min(l_cut, model.end_layer)):
        hidden, residual = layer(positions, hidden, residual, **layer_kwargs)
    keep = plan.keep_idx
    n_keep = keep.shape[0]
    metrics.bump("speed.upper_tokens_skipped", plan.interior_tokens)
    if n_keep:
        h, r, p = hidden[keep], residual[keep], positions[keep]
        for layer in islice(model.layers, max(l_cut, model.start_layer), model.end_layer):
            h, r = layer(p, h, r, **layer_kwargs)
        hidden = hidden.index_copy(0, keep, h)
        residual = residual.index_copy(0, keep, r)
    hidden, _ = model.norm(hidden, residual)
    return hidden


def _wrap(cls) -> None:
    original = cls.forward
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        # a compiled model (traced here) keeps vLLM's loop: the fallback is logged and counted at
        # start-up (vllm_ext.backend.startup), nothing with side effects may run while tracing
        if torch.compiler.is_compiling() or not getattr(self, "do_not_compile", True):
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
        plan = _current_plan()
        if plan is None or plan.keep_idx is None:        # profiling / warm-up / capture: all rows
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
        return speed_model_forward(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                                   plan=plan, l_cut=plan.l_cut, **kw)

    setattr(forward, _PATCHED_ATTR, True)
    cls.forward = forward


def install() -> None:
    """Wrap the supported decoder models' forward (inert unless SPEEDSFI runs SPEED)."""
    from vllm.model_executor.models.llama import LlamaModel
    from vllm.model_executor.models.qwen2 import Qwen2Model

    _wrap(LlamaModel)
    _wrap(Qwen2Model)
