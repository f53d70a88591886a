"""An independent reference of SPEED's visibility rule: the Hugging Face model (eager attention)
with a per-layer additive mask, greedy decoding by full recomputation. Lower layers are causal;
upper layers follow :func:`vllm_ext.methods.speed.visibility.visible_mask` (interior prompt queries see
themselves here, to stay finite; their upper-layer output is never used)."""

from __future__ import annotations

import torch

from vllm_ext.methods.speed.visibility import visible_mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float32)
    return out.masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]


def speed_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, l_cut: int,
                 anchor: str = "bos", variant: str = "speed") -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    anchor_end = 1 if anchor == "bos" else 0
    layers = model.model.layers
    state: dict[str, torch.Tensor] = {}

    def hook(index):
        def pre(module, args, kwargs):
            kwargs["attention_mask"] = state["upper" if index >= l_cut else "lower"]
            return args, kwargs
        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    outs = []
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = list(prompt)
                for _ in range(max_tokens):
                    n = len(ids)
                    pos = torch.arange(n)
                    causal = pos[None, :] <= pos[:, None]
                    upper = visible_mask(pos, pos, len(prompt), anchor_end, variant == "self_only")
                    upper |= torch.eye(n, dtype=torch.bool) & (pos[:, None] < len(prompt) - 1)
                    state["lower"], state["upper"] = _additive(causal), _additive(upper)
                    logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                    ids.append(int(logits.argmax()))
                outs.append(ids[len(prompt):])
    finally:
        for h in handles:
            h.remove()
    return outs
