"""CritiPrefill's rules for vLLM's scheduler (:class:`vllm_ext.scheduler_policy.SchedulerPolicy`
applies them), so that every sparse segment is computed in one chunk and every position by the same
kernel, whatever the token budget left for the request (:mod:`vllm_ext.methods.critiprefill.chunking`):

- **chunk ends** fall on segment boundaries inside the sparse range, and no chunk of such a prompt has
  one token (``sched.critiprefill_chunk_cuts``);
- **admission** (only with ``critiprefill.max_requests`` below ``--max-num-seqs``): the first chunk
  of a prompt with a sparse range is scheduled only while fewer than that many such prompts are
  prefilling (``sched.critiprefill_admission_waits``);
- **prefix hits** are cut to a segment start of the sparse range (``critiprefill.prefix_hit_tokens_cut``).

Start-up refuses a token budget smaller than one segment (the prefill could never move). The request
objects are vLLM's ``Request``; nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_ext import metrics
from vllm_ext.methods.critiprefill import chunking

_CP_LIFE = "_speedsfi_cp_life"   # on a vLLM Request: num_preemptions when it took a CritiPrefill slot


class CritiPrefillSchedulingRule:
    name = "critiprefill"
    active = True

    def __init__(self, cfg, capacity: int):
        self.cfg = cfg                               # the engine's CritiPrefillConfig
        self.capacity = capacity                     # 0: no bound (the chunk rules still apply)

    def describe_bound(self) -> str | None:
        return (f"{self.capacity} prompts in a CritiPrefill sparse prefill (critiprefill.max_requests)"
                if self.capacity else None)

    def _holds_slot(self, request) -> bool:
        return (request.__dict__.get(_CP_LIFE) == request.num_preemptions
                and request.num_computed_tokens < request.num_prompt_tokens)

    def limit_chunk(self, request, computed: int, num_new: int, *, admitted: bool,
                    running: Iterable) -> int:
        cp = self.cfg
        plen = request.num_prompt_tokens
        if computed >= plen:
            return num_new
        aligned = chunking.aligned_chunk(cp, plen, computed, num_new)
        if aligned != num_new:
            metrics.bump("sched.critiprefill_chunk_cuts")
            num_new = aligned
            if num_new == 0:
                return 0
        if self.capacity and chunking.is_critiprefill_chunk(cp, plen, computed, num_new) \
                and not self._holds_slot(request):
            held = sum(1 for r in running if r is not request and self._holds_slot(r))
            if held >= self.capacity:
                metrics.bump("sched.critiprefill_admission_waits")
                return 0
            request.__dict__[_CP_LIFE] = request.num_preemptions
        return num_new

    def limit_prefix_hit(self, request, num_hit: int, block_size: int) -> int:
        limit = chunking.prefix_hit_limit(self.cfg, request.num_prompt_tokens, num_hit, block_size)
        if limit < num_hit:
            metrics.bump("critiprefill.prefix_hit_tokens_cut", num_hit - limit)
        return limit
