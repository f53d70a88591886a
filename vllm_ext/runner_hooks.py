"""Feeds the engine's request table (``EngineRequestTable``) from vLLM's V1 model runner
(``GPUModelRunner``; the CPU build's ``CPUModelRunner`` is a subclass). The hooks stage host-side
facts only; the SPEEDSFI metadata builders (bound to the runner's table here, once) build the device
plan from them.

Four methods are wrapped, all inert unless the runner's config selects SPEEDSFI:
- ``_update_states(scheduler_output)``: after vLLM has updated its persistent batch, slots follow the
  requests (finished / aborted / preempted ones give theirs back, resumed ones get fresh state; a
  request merely not scheduled in a step keeps its slot and state).
- ``_may_reorder_batch(scheduler_output)``: after vLLM's own reordering (decode rows first), each
  method may reorder the rows it needs together (``Method.order_rows``: CritiPrefill's sub-batch
  last).
- ``_build_attention_metadata(...)``: just before the builders run, the step's rows are staged. A real
  step is recognised by ``num_scheduled_tokens`` (``execute_model`` passes it; profiling, warm-up and
  CUDA-graph capture runs do not) and ``for_cudagraph_capture``.
- ``_determine_batch_execution_and_padding(...)``: a step a method marks (``Method.breaks_uniform_decode``)
  never replays a FULL CUDA graph (:func:`breaks_uniform_decode`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_ext.backend.request_table import EngineRequestTable

_TABLE_ATTR = "_speedsfi_request_table"
_BOUND_ATTR = "_speedsfi_builders_bound"
_PATCHED_ATTR = "_speedsfi_patched"
_GROUPS_ATTR = "_speedsfi_method_groups"


def method_kv_groups(kv_cache_config, forward_context=None) -> dict[str, dict[int, tuple]]:
    """The KV-cache groups that hold a method's per-request memory (their spec names the method in
    ``speedsfi_method``: ``vllm_ext.method_slots``): method -> group id -> (blocks per request (the
    most, for a growing allocation), layer names, the group's spec, layer name -> the page memory
    vLLM bound to that layer in ``forward_context`` (for a method that reads its pages outside a
    layer's forward, e.g. SFI's token history in the step plan; empty without a context))."""
    out: dict[str, dict[int, tuple]] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        method = getattr(spec, "speedsfi_method", None)
        if method:
            names = list(group.layer_names)
            pages = {} if forward_context is None else {
                n: forward_context[n].kv_cache for n in names if n in forward_context}
            out.setdefault(method, {})[gid] = (int(spec.blocks_per_request), names, spec, pages)
    return out


def _staged_group_tables(runner, num_reqs: int) -> dict | None:
    """The real rows' block-table rows of the methods' groups, whether each row holds all the
    blocks its group gives a request, and how many it holds (the runner's count: rows' stale
    entries are never trusted)."""
    groups = runner.__dict__.get(_GROUPS_ATTR)
    if not groups:
        return None
    tables = runner.input_batch.block_table
    out = {}
    for gid, n in groups.items():
        bt = tables[gid]
        held = bt.num_blocks_per_row[:num_reqs]
        out[gid] = (bt.get_device_tensor(num_reqs), held >= n, held)
    return out


def table_of(runner) -> EngineRequestTable | None:
    """The runner's table, created on first use when the runner serves SPEEDSFI."""
    table = runner.__dict__.get(_TABLE_ATTR, False)
    if table is False:
        from vllm_ext.backend.startup import is_speedsfi_selected

        table = _make_table(runner) if is_speedsfi_selected(runner.vllm_config) else None
        runner.__dict__[_TABLE_ATTR] = table
    return table


def _make_table(runner) -> EngineRequestTable:
    from vllm_ext.backend.request_table import EngineRequestTable
    from vllm_ext.backend.startup import engine_of

    engine = engine_of(runner.vllm_config)
    model_config = runner.vllm_config.model_config

    def tokenizer():
        from vllm.tokenizers import cached_tokenizer_from_config

        return cached_tokenizer_from_config(model_config)

    table = EngineRequestTable(runner.max_num_reqs, runner.device, config=engine.config,
                               methods=engine.methods(), tokenizer=tokenizer,
                               vocab_size=model_config.get_vocab_size(),
                               max_model_len=model_config.max_model_len, paged_history=True)
    table.add_metric_providers()
    return table


def _bind_builders(runner, table: EngineRequestTable) -> None:
    """Hand the table to every SPEEDSFI metadata builder of the runner, once per KV cache: the
    builders live as long as the runner's ``kv_cache_config``. On CUDA with graphs, vLLM first builds
    a minimal KV cache to profile graph memory, clears ``attn_groups`` and builds the real one with
    new builders (``_init_minimal_kv_cache_for_profiling``), so binding only once leaves the real
    builders without a table."""
    kv_cache_config = getattr(runner, "kv_cache_config", None)
    if runner.__dict__.get(_BOUND_ATTR) is kv_cache_config and kv_cache_config is not None:
        return
    from vllm_ext.backend.metadata import SpeedSfiMetadataBuilder

    if kv_cache_config is not None and hasattr(table, "bind_kv_groups"):
        groups = method_kv_groups(kv_cache_config, runner.compilation_config.static_forward_context)
        runner.__dict__[_GROUPS_ATTR] = {gid: n for by_gid in groups.values()
                                         for gid, (n, *_) in by_gid.items()}
        table.bind_kv_groups(groups)

    found = 0
    for groups in getattr(runner, "attn_groups", []) or []:
        for group in groups:
            for builder in getattr(group, "metadata_builders", []) or []:
                if isinstance(builder, SpeedSfiMetadataBuilder):
                    builder.bind_request_state(table)
                    found += 1
    if found:
        runner.__dict__[_BOUND_ATTR] = kv_cache_config


def _live_requests(runner) -> dict:
    live = {}
    for req_id in runner.input_batch.req_ids:
        if req_id is None:
            continue
        state = runner.requests[req_id]
        params = state.sampling_params
        live[req_id] = (state.num_prompt_tokens, _overrides(params))
    return live


def _overrides(params):
    """The request's overrides (checked when the request came in: ``vllm_patches``)."""
    from vllm_ext.config import ConfigError, request_overrides

    try:
        return request_overrides(getattr(params, "extra_args", None))
    except ConfigError as e:
        from vllm_ext import metrics

        metrics.fallback("request_override_invalid", "ignoring a request's speedsfi override: %s", e)
        return None


def _after_update_states(runner, scheduler_output) -> None:
    table = table_of(runner)
    if table is None:
        return
    resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
    preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
    reset = set(scheduler_output.finished_req_ids) | set(resumed) | set(preempted)
    table.sync_membership(reset, _live_requests(runner), resumed, known=runner.requests)
    if not scheduler_output.total_num_scheduled_tokens:
        # no forward this step (vLLM's step that hands back finished requests): the last forward's
        # device counts would otherwise wait for the next request's plan to be published
        table.publish_device_counters()


def _stage_step(runner, num_reqs: int, num_reqs_padded: int | None, real: bool) -> None:
    table = table_of(runner)
    if table is None:
        return
    _bind_builders(runner, table)
    num_rows = num_reqs_padded or num_reqs
    if real:
        batch = runner.input_batch
        is_decode = (batch.num_computed_tokens_cpu[:num_reqs]
                     >= batch.num_prompt_tokens[:num_reqs])
        table.stage(batch.req_ids, num_reqs, num_rows, real=True, input_ids=runner.input_ids.gpu,
                    query_start_loc=runner.query_start_loc.gpu, row_is_decode=is_decode,
                    host_geometry=(runner.query_start_loc.np, batch.num_computed_tokens_cpu),
                    group_tables=_staged_group_tables(runner, num_reqs), token_ids=batch.token_ids_cpu)
    else:
        table.stage([], 0, num_rows, real=False)


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    update_states = GPUModelRunner._update_states
    if not getattr(update_states, _PATCHED_ATTR, False):
        @functools.wraps(update_states)
        def _update_states(self, scheduler_output):
            result = update_states(self, scheduler_output)
            _after_update_states(self, scheduler_output)
            return result

        setattr(_update_states, _PATCHED_ATTR, True)
        GPUModelRunner._update_states = _update_states

    reorder = GPUModelRunner._may_reorder_batch
    if not getattr(reorder, _PATCHED_ATTR, False):
        @functools.wraps(reorder)
        def _may_reorder_batch(self, scheduler_output):
            result = reorder(self, scheduler_output)
            if table_of(self) is not None:
                from vllm_ext.backend.startup import engine_of

                for method in engine_of(self.vllm_config).methods():
                    method.order_rows(self.input_batch, scheduler_output.num_scheduled_tokens)
            return result

        setattr(_may_reorder_batch, _PATCHED_ATTR, True)
        GPUModelRunner._may_reorder_batch = _may_reorder_batch

    build = GPUModelRunner._build_attention_metadata
    if not getattr(build, _PATCHED_ATTR, False):
        @functools.wraps(build)
        def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
            real = (kwargs.get("num_scheduled_tokens") is not None
                    and not kwargs.get("for_cudagraph_capture", False))
            _stage_step(self, num_reqs, kwargs.get("num_reqs_padded"), real)
            return build(self, num_tokens, num_reqs, max_query_len, *args, **kwargs)

        setattr(_build_attention_metadata, _PATCHED_ATTR, True)
        GPUModelRunner._build_attention_metadata = _build_attention_metadata

    decide = GPUModelRunner._determine_batch_execution_and_padding
    if not getattr(decide, _PATCHED_ATTR, False):
        @functools.wraps(decide)
        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *args, **kwargs):
            if kwargs.get("force_uniform_decode") is None and breaks_uniform_decode(self, num_reqs):
                kwargs["force_uniform_decode"] = False
            return decide(self, num_tokens, num_reqs, *args, **kwargs)

        setattr(_determine_batch_execution_and_padding, _PATCHED_ATTR, True)
        GPUModelRunner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding


def breaks_uniform_decode(runner, num_reqs: int) -> bool:
    """Whether a method says this real step must not replay a FULL CUDA graph
    (``Method.breaks_uniform_decode``: e.g. a prompt row with host-planned work)."""
    if table_of(runner) is None or num_reqs <= 0:
        return False
    from vllm_ext.backend.startup import engine_of

    return any(m.breaks_uniform_decode(runner, num_reqs) for m in engine_of(runner.vllm_config).methods())
