"""SFI's rules for vLLM's scheduler (:class:`vllm_ext.scheduler_policy.SchedulerPolicy` applies them):

- **admission** (only with ``sfi.max_requests`` below ``--max-num-seqs``): a request that decodes
  with SFI (the engine's setting and its own override) is admitted only while fewer than that many
  such requests run; it waits in vLLM's queue otherwise (``sched.sfi_admission_waits``), then runs
  with SFI like any other, so its answer never depends on what else the server is doing;
- **prefix hits** stop before the request's prompt tail (the prefill-end evidence window,
  :func:`vllm_ext.methods.sfi.prompt_tail.prefix_hit_limit`; ``sfi.prefix_hit_tokens_cut``).

The request objects are vLLM's ``Request``; nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_ext import metrics
from vllm_ext.config_fields import ConfigError, request_overrides

_WANTS_SFI = "_speedsfi_wants_sfi"       # kept on a vLLM Request


class SfiSchedulingRule:
    name = "sfi"

    def __init__(self, cfg, capacity: int):
        self.cfg = cfg
        self.capacity = capacity                     # 0: no bound of ours
        self._prefix_limit = None
        # selector quest without keep_prefill reads no prompt-tail queries (its first decode step
        # selects, and its page tables cover a prefix hit): nothing to cut
        if cfg.sfi.enabled and cfg.sfi.prefill_end_selection:
            from vllm_ext.methods.sfi.prompt_tail import prefix_hit_limit

            self._prefix_limit = lambda plen, bs: prefix_hit_limit(cfg.sfi, plen, bs)

    @property
    def active(self) -> bool:
        return bool(self.capacity or self._prefix_limit)

    def describe_bound(self) -> str | None:
        return f"{self.capacity} requests with SFI (sfi.max_requests)" if self.capacity else None

    def wants_sfi(self, request) -> bool:
        """The request decodes with SFI (the worker gives it a compact slot): the rule of
        :meth:`vllm_ext.methods.sfi.slot_tables.SfiSlotTables.assign`."""
        cached = request.__dict__.get(_WANTS_SFI)
        if cached is None:
            cached = False
            if self.capacity:
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

    def limit_chunk(self, request, computed: int, num_new: int, *, admitted: bool,
                    running: Iterable) -> int:
        if not admitted and self.capacity and self.wants_sfi(request):
            held = sum(1 for r in running if r is not request and self.wants_sfi(r))
            if held >= self.capacity:
                metrics.bump("sched.sfi_admission_waits")
                return 0
        return num_new

    def limit_prefix_hit(self, request, num_hit: int, block_size: int) -> int:
        if self._prefix_limit is None:
            return num_hit
        limit = min(num_hit, self._prefix_limit(request.num_prompt_tokens, block_size))
        if limit < num_hit:
            metrics.bump("sfi.prefix_hit_tokens_cut", num_hit - limit)
        return limit
