"""A vLLM v1 logits processor that teacher-forces a reference answer and records what the engine
would have chosen instead (:mod:`vllm_ext.quality.forced_agreement` reads the
records).

A request opts in with ``SamplingParams(extra_args={FORCE_KEY: {"tag": ..., "tokens": [...]}})``
(:func:`force_args`). At each sampling step of such a request the processor

1. reads the step's index: the tokens the request has generated so far (``len(output_tok_ids)``,
   the running list vLLM hands it when the request joins the batch);
2. records the greedy choice of the engine's own logits (vLLM's greedy argmax, the one greedy
   decoding uses), how far the reference token's logit is below the best and how far the second
   best is (:class:`ForcedStep`), in :data:`RECORDS` under the request's tag;
3. masks every token but the reference's next token, so the request writes the reference answer
   whatever the engine would have picked, and the next step's context (its KV) is the reference's.

``tokens`` None records without forcing (the reference run itself: its greedy choices and how
close each was).

Requests without the key pass through untouched. Steps past the reference's end are not forced
(the caller asks for ``max_tokens = len(tokens)``). A partial prefill chunk is sampled and
discarded by vLLM; its record (step 0) is overwritten by the chunk that ends the prompt.

The records live in this process: the engine must run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as the project's evaluation scripts run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCE_KEY = "forced_tokens"


@dataclass(frozen=True)
class ForcedStep:
    step: int           # index of the generated token (0: the token the prefill's end samples)
    reference: int      # the token forced (record-only: the engine's own choice)
    argmax: int         # the engine's greedy choice before forcing
    margin: float       # best logit - the reference token's logit (0: the reference ties the best)
    gap: float          # best logit - the second best (how decided the engine's choice was)


# tag -> step -> record (a later record of the same step replaces an earlier one)
RECORDS: dict[str, dict[int, ForcedStep]] = {}


def force_args(tag: str, tokens: Sequence[int] | None) -> dict:
    """``SamplingParams.extra_args`` entry that makes a request write ``tokens`` under ``tag``
    (None: record its own greedy choices, force nothing)."""
    return {FORCE_KEY: {"tag": str(tag), "tokens": None if tokens is None else [int(t) for t in tokens]}}


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy choice as vLLM's sampler makes it (its own CPU op on the CPU build)."""
    from vllm.v1.sample.sampler import Sampler

    return Sampler.greedy_sample(logits)


class ForcedTokensProcessor(LogitsProcessor):
    """Records each opted-in request's greedy choice, then forces its reference token."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch index -> (tag, reference tokens, the request's running output tokens)
        self.rows: dict[int, tuple[str, list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        spec = (sampling_params.extra_args or {}).get(FORCE_KEY)
        if spec is None:
            return
        if not isinstance(spec, dict) or "tag" not in spec or not isinstance(spec.get("tokens"), (list, type(None))):
            raise ValueError(f"extra_args[{FORCE_KEY!r}] must be {{'tag': str, 'tokens': [int, ...] or None}}")

    def is_argmax_invariant(self) -> bool:
        return False                                   # it changes the greedy choice

    @staticmethod
    def _new_row(params: SamplingParams, _prompt, output_tok_ids: list[int]):
        spec = (params.extra_args or {}).get(FORCE_KEY)
        if spec is None:
            return None
        RECORDS.setdefault(spec["tag"], {})
        return spec["tag"], spec["tokens"], output_tok_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        plan = [(row, tag, len(out), ref) for row, (tag, ref, out) in self.rows.items()
                if row < logits.shape[0] and (ref is None or len(out) < len(ref))]
        if not plan:
            return logits
        rows = torch.tensor([p[0] for p in plan], dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, rows)
        choice = greedy_argmax(sub).view(-1).long()
        refs = torch.tensor([-1 if ref is None else ref[step] for _, _, step, ref in plan],
                            dtype=torch.long, device=logits.device)
        refs = torch.where(refs < 0, choice, refs)
        top2 = sub.topk(2, dim=-1).values
        margin = (top2[:, 0] - sub.gather(1, refs[:, None])[:, 0]).tolist()
        gap = (top2[:, 0] - top2[:, 1]).tolist()
        for (_, tag, step, _), r, a, m, g in zip(plan, refs.tolist(), choice.tolist(), margin, gap):
            RECORDS[tag][step] = ForcedStep(step, int(r), int(a), float(m), float(g))
        force = [i for i, p in enumerate(plan) if p[3] is not None]
        if force:
            idx = torch.tensor(force, dtype=torch.long, device=logits.device)
            forced = torch.full((len(force), sub.shape[1]), float("-inf"), dtype=sub.dtype, device=sub.device)
            forced.scatter_(1, refs[idx][:, None], 0.0)
            logits.index_copy_(0, rows[idx], forced)
        return logits
