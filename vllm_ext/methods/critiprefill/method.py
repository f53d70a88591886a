"""CritiPrefill as the engine runs it (:class:`~vllm_ext.methods.protocol.Method`): prefill chunks of
long prompts (the step's trailing sub-batch, :mod:`vllm_ext.methods.critiprefill.slots`) attend
block-sparsely in each sparse layer (:mod:`vllm_ext.methods.critiprefill.path`); every other row
takes the dense path. Decode rows are never affected.
"""

from __future__ import annotations

import torch

from vllm_ext.config_fields import ConfigError
from vllm_ext.methods.protocol import DenseRows, LayerGeometry, Method, MethodLayer


class CritiPrefillMethod(Method):
    name = "critiprefill"

    @staticmethod
    def enabled(config) -> bool:
        return config.critiprefill.enabled

    @staticmethod
    def register_kv_specs() -> None:
        from vllm_ext.methods.critiprefill.kv_spec import register_critiprefill_kv_spec

        register_critiprefill_kv_spec()

    def check_engine(self) -> None:
        # the scheduler ends CritiPrefill chunks on segment boundaries and never leaves a one-token
        # chunk (vllm_ext.methods.critiprefill.chunking): a step must have room for a segment and one
        # token more, or a prefill could stop moving
        sched = self.vllm_config.scheduler_config
        seg = self.config.critiprefill.segment_size
        for flag, value in (("--max-num-batched-tokens", sched.max_num_batched_tokens),
                            ("--long-prefill-token-threshold",
                             getattr(sched, "long_prefill_token_threshold", 0) or None)):
            if value is not None and value <= seg:
                raise ConfigError(f"speedsfi.critiprefill.segment_size ({seg}) needs "
                                  f"{flag} > {seg} (it is {value}): a prefill chunk holds whole "
                                  f"segments of the sparse range; raise {flag} or lower the "
                                  f"segment size")

    def admission_cap(self) -> int:
        """``critiprefill.max_requests`` when it is set below ``--max-num-seqs``, else 0 (each
        prompt's state is KV-cache pages, and vLLM's block accounting decides)."""
        cap = self.config.critiprefill.max_requests
        return cap if cap and cap < self.vllm_config.scheduler_config.max_num_seqs else 0

    def scheduler_rule(self):
        from vllm_ext.methods.critiprefill.scheduling import CritiPrefillSchedulingRule

        return CritiPrefillSchedulingRule(self.config.critiprefill, self.admission_cap())

    def slot_tables(self, table, context):
        from vllm_ext.methods.critiprefill.slots import CritiPrefillSlots

        # no pool: the state of each prompt is pages of CritiPrefill's KV-cache groups
        return CritiPrefillSlots(table.num_slots, table.max_reqs, self.config.critiprefill, table.device)

    def tail_row(self, step) -> int | None:
        plan = step.plans.get(self.name)
        return None if plan is None else plan.first_row

    def order_rows(self, batch, num_scheduled_tokens) -> None:
        from vllm_ext.methods.critiprefill.chunking import move_critiprefill_rows_last

        move_critiprefill_rows_last(batch, num_scheduled_tokens, self.config.critiprefill)

    def load_cpu_kernels(self) -> None:
        """The CPU build's compiled prefill: built (once per machine) or loaded at engine start, not at
        the first long prompt. Without it the PyTorch twin attends (logged once, counted)."""
        if getattr(self, "_cpu_kernels_checked", False):
            return
        self._cpu_kernels_checked = True
        from vllm_ext import metrics
        from vllm_ext.kernels import cpu_native

        if cpu_native.library() is None:
            metrics.fallback("critiprefill_cpu_native", "vllm_ext: CritiPrefill's compiled CPU prefill is "
                             "unavailable (%s): the PyTorch twin attends its segments (slower, same outputs)",
                             cpu_native.unavailable_reason())

    def warmup_gaps(self) -> list[str]:
        return ["CritiPrefill's prefill kernels"]

    def layer(self, geometry: LayerGeometry):
        return CritiPrefillLayer(self, geometry)


class CritiPrefillLayer(MethodLayer):
    name = "critiprefill"

    def __init__(self, method: CritiPrefillMethod, geometry: LayerGeometry):
        self.method = method
        self.cfg = method.config.critiprefill
        self.g = geometry
        self.rows = method.row_counters
        self.state = None           # the state holder of a sparse layer
        self.attn = None            # vLLM's attention layer (its KV scales)
        self.page_dtype = None      # an fp8 cache's stored dtype (None: not fp8)
        self._state_view = (None, None)

    def prepare(self, forward_context: dict, act_dtype: torch.dtype) -> None:
        """Every layer that has a share registers a state holder, its dense layers included (their
        pages are never read): the state layers then match the attention layers (and SFI's compact
        layers) one for one, so vLLM keeps one group pattern for all; fewer state layers would split
        the attention layers into groups of their own block tables."""
        from vllm_ext.kernels import kv_quant
        from vllm_ext.methods.critiprefill.state_cache import register_state_layer

        self.attn = forward_context.get(self.g.layer_name)
        self.page_dtype = kv_quant.stored_dtype(getattr(self.attn, "kv_cache_dtype", "auto"))
        state = register_state_layer(forward_context, self.g.layer_name, self.cfg,
                                     num_heads=self.g.num_heads, max_len=self.g.max_len, query_dtype=act_dtype)
        if self.g.layer_index not in self.cfg.dense_layers:
            self.state = state
            if self.g.device.type == "cpu":
                self.method.load_cpu_kernels()

    def plan(self, md):
        return md.step.plans.get(self.name) if self.state is not None else None

    def claim_rows(self, rows: DenseRows, query, kv_cache, md, plan) -> None:
        rows.end = min(rows.end, plan.first_row)

    def _state_pages(self) -> torch.Tensor:
        """The state pages in the attention pages' dtype (an fp8 cache's view; kept while vLLM's
        allocation is the same tensor)."""
        from vllm_ext.kernels import kv_quant

        raw = self.state.kv_cache
        if self._state_view[0] is not raw:
            self._state_view = (raw, kv_quant.page_view(raw, self.page_dtype))
        return self._state_view[1]

    def attend_claimed(self, query, kv_cache, md, cp, output, rows: DenseRows) -> None:
        from vllm_ext.kernels.kv_quant import layer_scales
        from vllm_ext.methods.critiprefill.path import critiprefill_prefill

        state_table = cp.state_table(self.g.layer_name)
        if state_table is None:
            raise RuntimeError(f"vllm_ext: no KV-cache group holds {self.g.layer_name}'s CritiPrefill "
                               "state (vLLM did not page its state cache layer)")
        k_scale, v_scale = layer_scales(self.attn)
        critiprefill_prefill(query, kv_cache, md.block_table, cp, self.cfg, self._state_pages(), state_table,
                             self.g.layer_index, self.g.scale, output,
                             stats=md.step.table.method_tables[self.name].stats, k_scale=k_scale, v_scale=v_scale)
        if self.rows is not None:
            from vllm_ext import row_counters

            self.rows.add(row_counters.CRITIPREFILL, md.num_reqs - cp.first_row)
