"""SFI as the engine runs it (:class:`~vllm_ext.methods.protocol.Method`): how many requests hold SFI
state, the per-request tables (with the trigger set read off the served model's tokenizer), the
slow-step runtime every layer shares, and a layer share for each attention layer it decodes
sparsely.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ext import metrics
from vllm_ext.config_fields import ConfigError
from vllm_ext.methods.sfi.config import MAINTENANCE_BUDGET_BYTES, auto_maintenance_rows
from vllm_ext.methods.protocol import LayerGeometry, Method

logger = logging.getLogger("vllm_ext")


class SfiMethod(Method):
    name = "sfi"

    def __init__(self, config, vllm_config, *, row_counters=None):
        super().__init__(config, vllm_config, row_counters=row_counters)
        self._runtime = None
        self._cpu_kernels_checked = False

    @staticmethod
    def enabled(config) -> bool:
        return config.sfi.enabled

    @staticmethod
    def resolve(config, vllm_config):
        if config.sfi.maintenance_rows is not None:
            return config
        from vllm.platforms import current_platform

        rows = resolve_maintenance_rows(config, vllm_config, on_cpu=current_platform.is_cpu())
        return dataclasses.replace(config, sfi=dataclasses.replace(config.sfi, maintenance_rows=rows))

    @staticmethod
    def register_kv_specs() -> None:
        from vllm_ext.methods.sfi.history_kv_spec import register_history_kv_spec
        from vllm_ext.methods.sfi.kv_spec import register_sfi_kv_spec
        from vllm_ext.methods.sfi.quest_kv_spec import register_quest_kv_spec

        register_sfi_kv_spec()
        register_history_kv_spec()
        register_quest_kv_spec()

    @property
    def capacity(self) -> int:
        """Requests that can hold SFI state at once: every request the engine runs
        (``--max-num-seqs``); the compact segments themselves are vLLM's KV-cache blocks.
        ``speedsfi.sfi.max_requests``, when set, is an upper bound."""
        return 0 if self.vllm_config is None else sfi_capacity(self.config, self.vllm_config)

    def admission_cap(self) -> int:
        cap = self.capacity
        return cap if cap < self.vllm_config.scheduler_config.max_num_seqs else 0

    def scheduler_rule(self):
        from vllm_ext.methods.sfi.scheduling import SfiSchedulingRule

        return SfiSchedulingRule(self.config, self.admission_cap())

    def owns_decode_rows(self) -> bool:
        return True

    def breaks_uniform_decode(self, runner, num_reqs: int) -> bool:
        """A step with a prompt row (a prefill chunk, maybe of one token) never replays a FULL CUDA
        graph: a replayed graph would skip that row's host-planned prompt-tail work
        (:mod:`vllm_ext.methods.sfi.prompt_tail`), and whether a one-token chunk lands in an
        otherwise all-decode step depends on the other requests."""
        if num_reqs <= 0:
            return False
        batch = runner.input_batch
        return bool((batch.num_computed_tokens_cpu[:num_reqs] < batch.num_prompt_tokens[:num_reqs]).any())

    def slot_tables(self, table, context):
        from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

        # outside an engine (tests) the caller sizes the tables and may hand a trigger table in
        capacity = context["sfi_capacity"] if "sfi_capacity" in context else self.capacity
        if capacity <= 0:
            return None
        lut = context.get("trigger_lut")
        tokenizer = context.get("tokenizer")
        if lut is None and tokenizer is not None:
            lut = self._trigger_lut(tokenizer(), context["vocab_size"], table.device)
        return SfiSlotTables(table.num_slots, capacity, table.max_reqs, self.config, lut, table.device,
                             max_model_len=context.get("max_model_len", 0),
                             paged_history=context.get("paged_history", False))

    def _trigger_lut(self, tokenizer, vocab_size: int, device):
        from vllm_ext.methods.sfi.triggers import boundary_token_ids, trigger_lut

        cfg = self.config.sfi
        ids, spaces = boundary_token_ids(tokenizer, cfg.trigger_chars)
        logger.info("vllm_ext: SFI trigger set: %d of %d vocabulary ids end in %r (%d whitespace-only "
                    "ids; refreshes fire at the %s)", len(ids), vocab_size, "".join(cfg.trigger_chars),
                    len(spaces), cfg.fire_at.replace("_", " "))
        return trigger_lut(ids, vocab_size, device, whitespace_ids=spaces)

    def warm_up(self, shape) -> None:
        """The copy trigger's per-step kernels, once per engine, over the real token-history pages."""
        cfg = self.config.sfi
        if not cfg.resolved_copy_ngram or self.vllm_config is None:
            return
        from vllm_ext.methods.sfi.warmup import history_pages_of, warm_up_copy_trigger

        pages = history_pages_of(self.vllm_config)
        if pages is not None:
            warm_up_copy_trigger(cfg=cfg, pages=pages, max_len=self.vllm_config.model_config.max_model_len,
                                 capacity=self.capacity, max_rows=shape.max_rows)

    def load_cpu_kernels(self) -> None:
        """The CPU build's compiled kernels: built (once per machine) or loaded at engine start, not
        at the first request's first slow step. Without them the PyTorch twins run (logged once,
        counted)."""
        if self._cpu_kernels_checked:
            return
        self._cpu_kernels_checked = True
        from vllm_ext.kernels import cpu_native

        if cpu_native.library() is None:
            reason = cpu_native.unavailable_reason()
            metrics.fallback("cpu_native", "vllm_ext: SFI's compiled CPU kernels are unavailable (%s): "
                             "the PyTorch twins run SFI's slow steps (slower, same selections)", reason)

    def layer(self, geometry: LayerGeometry):
        from vllm_ext.methods.sfi.layer import SfiLayer

        return SfiLayer(self, geometry)

    def runtime(self, g: LayerGeometry):
        """The slow-step runtime every layer of the engine shares (allocated at the first layer's
        ``prepare``, before vLLM profiles memory: it comes out of its budget)."""
        if self._runtime is None:
            from vllm_ext.methods.sfi.runtime import LARGE_RUNTIME_BYTES, SfiRuntime

            rt = SfiRuntime(self.config.sfi, capacity=self.capacity, max_rows=g.max_rows,
                            num_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_size=g.head_size,
                            max_len=g.max_len, device=g.device)
            logger.info("vllm_ext: %s; maintenance %s", rt.describe(),
                        "on a side stream" if rt.ring.dual else "serial")
            if rt.nbytes > LARGE_RUNTIME_BYTES:
                # the scratch follows the maintenance chunk B and max_model_len, not the request count
                logger.warning("vllm_ext: SFI's slow-step scratch takes %.1f GiB (%d slow rows per "
                               "maintenance chunk at max_model_len %d), out of the KV cache's memory; a "
                               "smaller speedsfi.sfi.maintenance_rows shrinks it (more, smaller chunks "
                               "per step: docs/sfi.md)", rt.nbytes / 2**30, rt.maintenance_rows, g.max_len)
            self._runtime = rt
            self._runtime_heads = (g.num_heads, g.num_kv_heads, g.head_size)
        elif self._runtime_heads != (g.num_heads, g.num_kv_heads, g.head_size):
            raise ConfigError("SPEEDSFI: SFI needs every attention layer of the model to have the same "
                              "head geometry")
        return self._runtime

    def log_buffers(self, layer_bytes: int, g: LayerGeometry) -> None:
        cfg = self.config.sfi
        if cfg.selector == "quest":
            metrics.log_once("sfi_buffers", "vllm_ext: SFI (selector quest) per layer %.2f MiB of slot "
                             "tables; the compact segments%s and the page max/min of K (one block per "
                             "block_size x page_size %d tokens of a request) are blocks of vLLM's KV cache "
                             "(docs/per_request_memory.md)", layer_bytes / 2**20,
                             " and kept positions" if cfg.keep_prefill else "", cfg.page_size)
        else:
            metrics.log_once("sfi_buffers", "vllm_ext: SFI per layer %.2f MiB of slot tables; its "
                             "per-request state (compact segment, Hkv %d x (n_sink + k) %d entries; "
                             "prompt-tail queries w_prefill %d x Hq %d x D %d%s) is in blocks of vLLM's "
                             "KV cache (docs/per_request_memory.md)", layer_bytes / 2**20,
                             g.num_kv_heads, cfg.n_sink + cfg.k, cfg.w_prefill, g.num_heads, g.head_size,
                             "; kept positions Hkv x %d int32" % cfg.keep_prefill if cfg.keep_prefill else "")


def sfi_capacity(config, vllm_config) -> int:
    if not config.sfi.enabled:
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(config.sfi.max_requests or max_seqs, max_seqs)


def resolve_maintenance_rows(cfg, vllm_config, *, on_cpu: bool) -> int:
    """``sfi.maintenance_rows`` left unset: the rows a 1 GiB slow-step scratch holds for this model's
    heads (per GPU) at ``max_model_len``, at least 16 (:func:`~vllm_ext.methods.sfi.config.auto_maintenance_rows`; docs/sfi.md).
    The ring has ``side_stream_slots`` slots with the side stream (CUDA), one otherwise."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    ring = cfg.sfi.side_stream_slots if (cfg.sfi.dual_stream and not on_cpu) else 1
    rows = auto_maintenance_rows(num_heads=model.get_num_attention_heads(parallel),
                                 num_kv_heads=model.get_num_kv_heads(parallel),
                                 max_len=model.max_model_len, ring_slots=ring)
    logger.info("vllm_ext: speedsfi.sfi.maintenance_rows unset: %d slow rows per maintenance chunk "
                "(a %d MiB budget at max_model_len %d; docs/sfi.md)", rows,
                MAINTENANCE_BUDGET_BYTES >> 20, model.max_model_len)
    return rows
