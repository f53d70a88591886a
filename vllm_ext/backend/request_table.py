"""The engine's per-request table: the generic slot table (:mod:`vllm_ext.request_state`) with the
per-slot tables of the methods the engine runs registered in it (``Method.slot_tables``), and the
views the backend, the runner hooks and the tests read them through. Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vllm_ext import metrics
from vllm_ext.config import SpeedSfiConfig
from vllm_ext.methods.registry import METHODS, enabled_methods
from vllm_ext.request_state import RequestStateTable, StepState

_METHOD_NAMES = frozenset(cls.name for cls in METHODS)


class EngineStepState(StepState):
    def __getattr__(self, name: str):
        # a method's plan of the step by the method's name (None when it has none)
        if name in _METHOD_NAMES:
            return self.plans.get(name)
        raise AttributeError(name)


class EngineRequestTable(RequestStateTable):
    step_type = EngineStepState

    def __init__(self, max_reqs: int, device: torch.device | str, *,
                 config: SpeedSfiConfig | None = None, methods: list | None = None, **context: Any):
        """``methods``: the engine's method objects (default: those ``config`` enables, outside an
        engine); ``context``: what the methods' tables may need (``tokenizer``, ``vocab_size``,
        ``max_model_len``, ``paged_history``, and a method's own sizes)."""
        super().__init__(max_reqs, device)
        self.config = config or SpeedSfiConfig()
        self.method_tables: dict[str, Any] = {}
        if methods is None:
            methods = enabled_methods(self.config, None)
        for method in methods:
            tables = method.slot_tables(self, context)
            if tables is not None:
                self.method_tables[method.name] = self.register(tables)

    def __getattr__(self, name: str):
        # a method's tables by the method's name (None when the engine runs none)
        if name in _METHOD_NAMES:
            return self.__dict__.get("method_tables", {}).get(name)
        raise AttributeError(name)

    def add_metric_providers(self) -> None:
        """The methods' device counters in ``vllm_ext.metrics`` (read without synchronising: the
        latest completed copy)."""
        for name, tables in self.method_tables.items():
            if hasattr(tables, "counter_values"):
                metrics.add_provider(name, tables.counter_values)

    def acquire(self, req_id: str, prompt_len: int, overrides: Mapping[str, Any] | None = None, *,
                resumed: bool = False) -> int:
        new = req_id not in self.slot_of
        slot = super().acquire(req_id, prompt_len, overrides, resumed=resumed)
        if new and isinstance(overrides, Mapping):
            for name, section in overrides.items():
                if isinstance(section, Mapping) and section.get("enabled") and name not in self.method_tables:
                    metrics.fallback(f"{name}_not_configured", "a request enabled %s but the engine was "
                                     "started without it; it runs without %s", name, name)
        return slot

    def publish_device_counters(self) -> None:
        """Queue a copy of the methods' device counters (no host sync). The builders do this at each
        step's plan, which covers the steps before it; a step without a forward (vLLM runs one to
        hand back finished requests) calls this so that the last forward's counts are published."""
        for tables in self.method_tables.values():
            counters = getattr(tables, "counters", None)
            if counters is not None:
                counters.publish()

    def snapshot(self, step: StepState, row_req_ids: list[str | None]) -> dict[str, dict[str, int]]:
        views = super().snapshot(step, row_req_ids)
        for view in views.values():
            # a row no method schedules decodes densely; its steps since the last slow step are its
            # decode steps since the slot was assigned
            view.setdefault("steps_since_slow", int(self.decode_steps[view["slot"]]))
            view.setdefault("mode", "dense")
        return views
