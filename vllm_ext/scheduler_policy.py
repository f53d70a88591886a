"""What SPEEDSFI asks of vLLM's scheduler so that an answer depends on its request alone (DESIGN.md:
never on batch composition, chunk boundaries or other traffic).

By default every method's per-request memory is vLLM's KV-cache blocks, and the scheduler's own block
accounting admits requests. A method adds its rules (``Method.scheduler_rule``): an optional bound
on the requests using it at once (a request over it waits in vLLM's queue, the way a request waits
for KV blocks, then runs with the method like any other: never densely), chunk ends it needs, and
where a prefix-cache hit must stop. The scheduler, which sees every request, applies them here, in
the registry's order; each wait and cut is counted.

The request objects are vLLM's ``Request`` (read: ``num_prompt_tokens``, ``num_computed_tokens``,
``sampling_params``, ``num_preemptions``); nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable


class SchedulerPolicy:
    def __init__(self, rules: list):
        self.rules = [rule for rule in rules if rule is not None and rule.active]

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def rule(self, name: str):
        return next((r for r in self.rules if r.name == name), None)

    def bounds(self) -> list[str]:
        """The bounds on concurrent requests the rules keep, in words (for the start-up log)."""
        return [b for b in (r.describe_bound() for r in self.rules) if b]

    def limit_chunk(self, request, computed: int, num_new: int, *, admitted: bool,
                    running: Iterable) -> int:
        """The scheduler's ``num_new_tokens`` for ``request`` (chunk ``[computed, computed +
        num_new)``), held back (0) or shortened by the rules. ``admitted``: the request is already
        running (else it is being admitted from the waiting queue); ``running``: the scheduler's
        running requests, those admitted earlier in this step included."""
        if num_new <= 0:
            return num_new
        running = list(running)
        for rule in self.rules:
            num_new = rule.limit_chunk(request, computed, num_new, admitted=admitted, running=running)
            if num_new <= 0:
                return num_new
        return num_new

    def limit_prefix_hit(self, request, num_hit: int, block_size: int) -> int:
        """The usable part of a local prefix-cache hit of ``num_hit`` tokens (whole blocks)."""
        for rule in self.rules:
            num_hit = rule.limit_prefix_hit(request, num_hit, block_size)
        return num_hit
