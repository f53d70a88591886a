"""Feeds ``RequestStateTable`` from vLLM's V1 model runner (``GPUModelRunner``; the CPU build's
``CPUModelRunner`` is a subclass), and publishes each step's ``StepState`` to the SPEEDSFI builders.

Two methods are wrapped, both inert unless the runner's config selects SPEEDSFI:
- ``_update_states(scheduler_output)``: after vLLM has updated its persistent batch, slots follow it
  (finished / aborted / resumed-after-preemption requests get fresh state).
- ``_build_attention_metadata(...)``: just before the builders run, the step's rows are published
  (``current_step()``). A real step is recognised by ``num_scheduled_tokens`` (``execute_model``
  passes it; profiling, warm-up and CUDA-graph capture runs do not) and ``for_cudagraph_capture``.
"""

from __future__ import annotations

import functools

from vllm_ext.request_state import RequestStateTable, StepState

_TABLE_ATTR = "_speedsfi_request_table"
_PATCHED_ATTR = "_speedsfi_patched"
_current_step: StepState | None = None


def current_step() -> StepState | None:
    return _current_step


def table_of(runner) -> RequestStateTable | None:
    """The runner's table, created on first use when the runner serves SPEEDSFI."""
    table = runner.__dict__.get(_TABLE_ATTR, False)
    if table is False:
        from vllm_ext.vllm_patches import is_speedsfi_selected

        table = _make_table(runner) if is_speedsfi_selected(runner.vllm_config) else None
        runner.__dict__[_TABLE_ATTR] = table
    return table


def sfi_capacity(vllm_config) -> int:
    """Requests that can hold SFI compact state at once (``speedsfi.sfi.max_requests``)."""
    from vllm_ext.backend.startup import resolve_config

    cfg = resolve_config(vllm_config).sfi
    if not cfg.enabled:
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(cfg.max_requests or min(max_seqs, 32), max_seqs)


def _make_table(runner) -> RequestStateTable:
    from vllm_ext.backend.startup import resolve_config

    cfg = resolve_config(runner.vllm_config)
    lut = None
    if cfg.sfi.enabled:
        from vllm_ext.sfi.triggers import trigger_lut, trigger_token_ids

        model_config = runner.vllm_config.model_config
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(model_config)
        ids = trigger_token_ids(tokenizer, cfg.sfi.trigger_chars)
        lut = trigger_lut(ids, model_config.get_vocab_size(), runner.device)
        import logging

        logging.getLogger("vllm_ext").info("vllm_ext: SFI trigger set: %d of %d vocabulary ids end in "
                                           "%r", len(ids), model_config.get_vocab_size(),
                                           "".join(cfg.sfi.trigger_chars))
    table = RequestStateTable(runner.max_num_reqs, runner.device, config=cfg,
                              sfi_capacity=sfi_capacity(runner.vllm_config), trigger_lut=lut)
    if table.sfi_enabled:
        from vllm_ext import metrics
        from vllm_ext.sfi import step_plan

        names = {step_plan.STAT_SLOW: "sfi.slow_steps", step_plan.STAT_FAST: "sfi.fast_steps",
                 step_plan.STAT_DENSE: "sfi.dense_rows",
                 step_plan.STAT_RETAINED: "sfi.fast_retained_tokens",
                 step_plan.STAT_CONTEXT: "sfi.fast_context_tokens",
                 step_plan.STAT_PREFILL_END: "sfi.prefill_end_selections"}

        def sfi_counters(stats=table.sfi_stats) -> dict[str, int]:
            values = stats.tolist()
            return {name: values[i] for i, name in names.items()}

        metrics.add_provider("sfi", sfi_counters)
    return table


def _live_requests(runner) -> dict:
    live = {}
    for req_id in runner.input_batch.req_ids:
        if req_id is None:
            continue
        state = runner.requests[req_id]
        params = state.sampling_params
        extra = (params.extra_args or {}).get("speedsfi") if params is not None else None
        live[req_id] = (state.num_prompt_tokens, extra)
    return live


def _after_update_states(runner, scheduler_output) -> None:
    table = table_of(runner)
    if table is None:
        return
    reset = set(scheduler_output.finished_req_ids)
    reset |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
    table.sync_membership(reset, _live_requests(runner))


def _publish_step(runner, num_reqs: int, num_reqs_padded: int | None, real: bool) -> None:
    global _current_step
    table = table_of(runner)
    if table is None:
        _current_step = None
        return
    num_rows = num_reqs_padded or num_reqs
    if real:
        batch = runner.input_batch
        is_decode = (batch.num_computed_tokens_cpu[:num_reqs]
                     >= batch.num_prompt_tokens[:num_reqs])
        _current_step = table.begin_step(batch.req_ids, num_reqs, num_rows, runner.input_ids.gpu,
                                         runner.query_start_loc.gpu, is_decode, runner.seq_lens,
                                         (runner.query_start_loc.np, batch.num_computed_tokens_cpu))
    else:
        _current_step = table.begin_step([], 0, num_rows, None, None, None)


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

    build = GPUModelRunner._build_attention_metadata
    if not getattr(build, _PATCHED_ATTR, False):
        @functools.wraps(build)
        def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
            real = (kwargs.get("num_scheduled_tokens") is not None
                    and not kwargs.get("for_cudagraph_capture", False))
            _publish_step(self, num_reqs, kwargs.get("num_reqs_padded"), real)
            return build(self, num_tokens, num_reqs, max_query_len, *args, **kwargs)

        setattr(_build_attention_metadata, _PATCHED_ATTR, True)
        GPUModelRunner._build_attention_metadata = _build_attention_metadata
