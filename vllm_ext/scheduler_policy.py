"""What SPEEDSFI asks of vLLM's scheduler so that an answer depends on its request alone (DESIGN.md:
never on batch composition, chunk boundaries or other traffic).

By default every method's per-request memory is vLLM's KV-cache blocks (SFI's compact segments:
``vllm_ext.methods.sfi.kv_spec``; CritiPrefill's state: ``vllm_ext.methods.critiprefill.kv_spec``) and the
scheduler's own block accounting admits requests. Only when ``sfi.max_requests`` /
``critiprefill.max_requests`` is set below ``--max-num-seqs`` does the worker bound the requests
using a method (``C_sfi`` / ``C_cp``, optional upper bounds). A request over such a bound used to be
served densely (counted as a fallback): its answer then depended on what else the server was doing.
Here the scheduler, which sees every request, keeps each bound instead, and the request waits in
vLLM's queue (the same way a request waits for KV blocks), then runs with its method like any other:

1. **SFI admission**: a request that decodes with SFI (the engine's setting and its own override)
   is admitted only while fewer than ``C_sfi`` such requests run (the worker holds a slot from a
   request's first step until it leaves the batch).
2. **CritiPrefill admission** (only with ``critiprefill.max_requests`` set): the first chunk of a
   prompt with a sparse range is scheduled only while fewer than ``C_cp`` such prompts are
   prefilling.
3. **CritiPrefill chunk ends** fall on segment boundaries inside the sparse range, prefix-cache hits
   are cut to one, and no chunk of such a prompt has one token (``vllm_ext.methods.critiprefill.chunking``),
   so every sparse segment is computed in one chunk, and every position by the same kernel,
   whatever the token budget left for the request.
4. **SFI prefix hits** stop before the prompt tail (``vllm_ext.methods.sfi.prompt_tail.prefix_hit_limit``).

A request held back waits at most until a request under a bound leaves or a step has budget for a whole segment;
each wait is counted (``sched.sfi_admission_waits``, ``sched.critiprefill_admission_waits``,
``sched.critiprefill_chunk_cuts``). Start-up refuses a token budget smaller than one CritiPrefill
segment (the prefill could never move: ``vllm_ext.backend.startup``).

The request objects are vLLM's ``Request`` (read: ``num_prompt_tokens``, ``num_computed_tokens``,
``sampling_params``, ``num_preemptions``); nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_ext import metrics
from vllm_ext.config import ConfigError, SpeedSfiConfig, request_overrides
from vllm_ext.methods.critiprefill import chunking

# attributes SPEEDSFI keeps on a vLLM Request
_WANTS_SFI = "_speedsfi_wants_sfi"
_CP_LIFE = "_speedsfi_cp_life"          # num_preemptions when the request took a CritiPrefill slot


class SchedulerPolicy:
    def __init__(self, cfg: SpeedSfiConfig, *, sfi_capacity: int, critiprefill_capacity: int,
                 sfi_prefix_limit=None):
        self.cfg = cfg
        self.sfi_capacity = sfi_capacity
        self.cp_capacity = critiprefill_capacity     # 0: no bound (the chunk rules still apply)
        self.cp_on = cfg.critiprefill.enabled
        self._sfi_prefix_limit = sfi_prefix_limit    # (prompt_len, block_size) -> tokens, or None

    @property
    def active(self) -> bool:
        return bool(self.sfi_capacity or self.cp_on or self._sfi_prefix_limit)

    # ------------------------------------------------------------------ per request
    def wants_sfi(self, request) -> bool:
        """The request decodes with SFI (the worker assigns it a compact slot): the rule of
        ``vllm_ext.methods.sfi.slot_tables.SfiSlotTables.assign``."""
        cached = request.__dict__.get(_WANTS_SFI)
        if cached is None:
            cached = False
            if self.sfi_capacity:
                cfg = self.cfg
                try:
                    overrides = request_overrides(getattr(request.sampling_params, "extra_args", None))
                    if overrides:
                        cfg = cfg.with_overrides(overrides)
                except ConfigError:
                    cfg = self.cfg                     # the worker ignores it the same way
                cached = cfg.sfi.enabled
            request.__dict__[_WANTS_SFI] = cached
        return cached

    def _holds_cp_slot(self, request) -> bool:
        return (request.__dict__.get(_CP_LIFE) == request.num_preemptions
                and request.num_computed_tokens < request.num_prompt_tokens)

    def limit_chunk(self, request, computed: int, num_new: int, *, admitted: bool,
                    running: Iterable) -> int:
        """The scheduler's ``num_new_tokens`` for ``request`` (chunk ``[computed, computed +
        num_new)``), held back (0) or shortened by the rules above. ``admitted``: the request is
        already running (else it is being admitted from the waiting queue); ``running``: the
        scheduler's running requests, those admitted earlier in this step included."""
        if num_new <= 0:
            return num_new
        if not admitted and self.sfi_capacity and self.wants_sfi(request):
            held = sum(1 for r in running if r is not request and self.wants_sfi(r))
            if held >= self.sfi_capacity:
                metrics.bump("sched.sfi_admission_waits")
                return 0
        if not self.cp_on:
            return num_new
        cp = self.cfg.critiprefill
        plen = request.num_prompt_tokens
        if computed >= plen:
            return num_new
        aligned = chunking.aligned_chunk(cp, plen, computed, num_new)
        if aligned != num_new:
            metrics.bump("sched.critiprefill_chunk_cuts")
            num_new = aligned
            if num_new == 0:
                return 0
        if self.cp_capacity and chunking.is_critiprefill_chunk(cp, plen, computed, num_new) \
                and not self._holds_cp_slot(request):
            held = sum(1 for r in running if r is not request and self._holds_cp_slot(r))
            if held >= self.cp_capacity:
                metrics.bump("sched.critiprefill_admission_waits")
                return 0
            request.__dict__[_CP_LIFE] = request.num_preemptions
        return num_new

    def limit_prefix_hit(self, request, num_hit: int, block_size: int) -> int:
        """The usable part of a local prefix-cache hit of ``num_hit`` tokens (whole blocks); the
        tokens cut are counted per rule (``sfi.prefix_hit_tokens_cut``,
        ``critiprefill.prefix_hit_tokens_cut``)."""
        limit = num_hit
        plen = request.num_prompt_tokens
        if self._sfi_prefix_limit is not None:
            sfi_limit = min(limit, self._sfi_prefix_limit(plen, block_size))
            if sfi_limit < limit:
                metrics.bump("sfi.prefix_hit_tokens_cut", limit - sfi_limit)
                limit = sfi_limit
        if self.cp_on:
            cp_limit = chunking.prefix_hit_limit(self.cfg.critiprefill, plen, limit, block_size)
            if cp_limit < limit:
                metrics.bump("critiprefill.prefix_hit_tokens_cut", limit - cp_limit)
                limit = cp_limit
        return limit
