"""Every place where SPEEDSFI changes a vLLM 0.32 internal, in one list (:data:`PATCHES`): what is
patched, why, the vLLM file it wraps, and the contract test that fails loudly when the internals it
relies on move. Each patch is narrow, idempotent and inert unless SPEEDSFI is the selected backend;
``tests/test_vllm_patch_list.py`` checks that the list is whole (every wrapped function carries the
``_speedsfi_patched`` mark and is listed) and that each contract test exists. docs/design.md gives the
count.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

_PATCHED_ATTR = "_speedsfi_patched"

from vllm_ext.backend.startup import (check_front_end_model, front_end_config,  # noqa: E402
                                      is_speedsfi_selected, names_speedsfi)


@dataclass(frozen=True)
class Patch:
    target: str           # the vLLM attribute replaced by a wrapper (or set, for the enum member)
    vllm_file: str        # where vLLM defines it (vLLM 0.32.0)
    installed_by: str     # the function of ours that installs it
    why: str
    contract_test: str    # pytest node id (path::test)


_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_SCHED = "vllm/v1/core/sched/scheduler.py"
PATCHES: tuple[Patch, ...] = (
    Patch("vllm.engine.arg_utils.EngineArgs.create_engine_config", "vllm/engine/arg_utils.py",
          "vllm_ext.vllm_patches._patch_front_end_config_check",
          "a mistake in the speedsfi section stops start-up in the front-end process (vllm serve, "
          "LLM, AsyncLLM) before vLLM reads the model, and one that needs the model (speed.l_cut) "
          "before any engine or worker starts",
          "tests/test_vllm_contract.py::test_front_end_config_hooks"),
    Patch("vllm.entrypoints.cli.serve.ServeSubcommand.validate", "vllm/entrypoints/cli/serve.py",
          "vllm_ext.vllm_patches._patch_serve_cli_check",
          "vllm serve checks the speedsfi section right after parsing its arguments, and a "
          "ConfigError in its process ends it with one line naming the field, printed last",
          "tests/test_vllm_contract.py::test_front_end_config_hooks"),
    Patch("vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls", "vllm/platforms/cpu.py",
          "vllm_ext.vllm_patches._patch_cpu_selector",
          "the CPU platform ignores the selected backend; honour SPEEDSFI after the same "
          "validate_configuration check the CUDA platform runs",
          "tests/test_registration.py::test_cpu_selector_honours_speedsfi_and_validates"),
    Patch("vllm.config.VllmConfig._get_v2_model_runner_unsupported_features", "vllm/config/vllm.py",
          "vllm_ext.vllm_patches._patch_v2_runner_opt_out",
          "the request-state hooks exist for the V1 model runner only, so SPEEDSFI makes vLLM pick it "
          "(with vLLM's own log line saying why)",
          "tests/test_vllm_contract.py::test_speedsfi_forces_the_v1_runner"),
    Patch("vllm.model_executor.layers.attention.attention.Attention.get_kv_cache_spec",
          "vllm/model_executor/layers/attention/attention.py", "vllm_ext.vllm_patches._patch_method_kv_specs",
          "with SPEED on, layers >= l_cut report SpeedUpperSpec (their own KV-cache group holding no "
          "interior prompt blocks); the layer hard-codes FullAttentionSpec and a backend's "
          "customize_spec does not know the layer",
          "tests/speed/test_speed_vllm_contract.py::test_kv_spec_registry_and_manager_api"),
    Patch("vllm.v1.core.sched.scheduler.Scheduler._get_local_prefix_cache_hit", _SCHED,
          "vllm_ext.vllm_patches._patch_prefix_hit_limit",
          "a prefix-cache hit stops before SFI's prompt tail and on a CritiPrefill segment boundary, "
          "so a request's selection never depends on what others left in the cache",
          "tests/test_vllm_contract.py::test_prefix_hit_and_batch_execution_hooks"),
    Patch("vllm.v1.core.sched.scheduler.Scheduler._reserve_prefill_lookahead", _SCHED,
          "vllm_ext.vllm_patches._patch_chunk_admission",
          "the last word on each request's num_new_tokens: SFI / CritiPrefill slot admission and "
          "CritiPrefill chunk ends (vllm_ext.scheduler_policy)",
          "tests/test_vllm_contract.py::test_chunk_admission_hook"),
    Patch("vllm.v1.engine.input_processor.InputProcessor._validate_params",
          "vllm/v1/engine/input_processor.py", "vllm_ext.vllm_patches._patch_request_validation",
          "per-request speedsfi overrides and (with SPEED) prompt logprobs are refused with a 400 "
          "naming the field",
          "tests/speed/test_speed_vllm_contract.py::test_request_validation_hook"),
    Patch("vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states", _RUNNER,
          "vllm_ext.runner_hooks.install",
          "per-request slots follow the requests (finished, preempted, resumed; kept while unscheduled)",
          "tests/test_vllm_contract.py::test_membership_facts_the_runner_hooks_read"),
    Patch("vllm.v1.worker.gpu_model_runner.GPUModelRunner._may_reorder_batch", _RUNNER,
          "vllm_ext.runner_hooks.install",
          "CritiPrefill rows move behind every other row, so its sub-batch holds them only",
          "tests/test_vllm_contract.py::test_membership_facts_the_runner_hooks_read"),
    Patch("vllm.v1.worker.gpu_model_runner.GPUModelRunner._build_attention_metadata", _RUNNER,
          "vllm_ext.runner_hooks.install",
          "the step's rows are staged for the builders just before they run (real steps only)",
          "tests/test_vllm_contract.py::test_v1_runner_methods_we_wrap"),
    Patch("vllm.v1.worker.gpu_model_runner.GPUModelRunner._determine_batch_execution_and_padding",
          _RUNNER, "vllm_ext.runner_hooks.install",
          "a step with an SFI prompt row is never replayed as a uniform-decode FULL CUDA graph",
          "tests/test_vllm_contract.py::test_prefix_hit_and_batch_execution_hooks"),
    Patch("vllm.model_executor.models.llama.LlamaModel.forward", "vllm/model_executor/models/llama.py",
          "vllm_ext.methods.speed.method.SpeedMethod.install_patches",
          "with SPEED on an eager model, prompt tokens skip the upper layers",
          "tests/speed/test_speed_vllm_contract.py::test_model_forward_shape_we_replace"),
    Patch("vllm.model_executor.models.qwen2.Qwen2Model.forward", "vllm/model_executor/models/qwen2.py",
          "vllm_ext.methods.speed.method.SpeedMethod.install_patches",
          "with SPEED on an eager model, prompt tokens skip the upper layers",
          "tests/speed/test_speed_vllm_contract.py::test_model_forward_shape_we_replace"),
    Patch("vllm.v1.attention.backends.registry.AttentionBackendEnum.SPEEDSFI.__reduce_ex__",
          "vllm/v1/attention/backends/registry.py", "vllm_ext._pickle_member_by_reference",
          "the member pickles by reference, so spawned engine cores, workers and Ray actors register "
          "the backend before unpickling the config",
          "tests/test_registration.py::test_member_pickles_by_reference_into_a_fresh_process"),
)


def install() -> None:
    _patch_front_end_config_check()
    _patch_serve_cli_check()
    _patch_cpu_selector()
    _patch_v2_runner_opt_out()
    _patch_prefix_hit_limit()
    _patch_chunk_admission()
    _patch_method_kv_specs()
    from vllm_ext.methods import registry

    registry.install_patches()
    _patch_request_validation()
    from vllm_ext import runner_hooks

    runner_hooks.install()


def _patch_front_end_config_check() -> None:
    """``EngineArgs.create_engine_config`` turns the arguments into the ``VllmConfig`` in the
    front-end process, before any engine starts: the ``speedsfi`` section's fields are checked
    first (before vLLM reads the model), the checks that need the model once it has."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        cfg = None
        if names_speedsfi(self.attention_backend, self.attention_config):
            cfg = front_end_config(self.additional_config)
        vllm_config = original(self, *args, **kwargs)
        if is_speedsfi_selected(vllm_config):       # also when chosen another way than the arguments
            cfg = cfg or front_end_config(vllm_config.additional_config)
            if cfg is not None:
                check_front_end_model(cfg, vllm_config)
        return vllm_config

    setattr(create_engine_config, _PATCHED_ATTR, True)
    EngineArgs.create_engine_config = create_engine_config


def _patch_serve_cli_check() -> None:
    """``vllm serve`` validates its parsed arguments (``ServeSubcommand.validate``) before it starts
    anything: the ``speedsfi`` section is checked there too, and from then on a ``ConfigError`` that
    reaches the top of the process prints as one line, ``ConfigError: <field> ...``, with no
    traceback (:func:`_config_errors_print_one_line`). Installed where vLLM's CLI module is loaded
    when plugins load (the ``vllm`` command's own process); engines and workers never import it."""
    serve = sys.modules.get("vllm.entrypoints.cli.serve")
    cls = getattr(serve, "ServeSubcommand", None)
    if cls is None:
        return
    original = cls.validate
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def validate(self, args):
        original(self, args)
        if names_speedsfi(getattr(args, "attention_backend", None), getattr(args, "attention_config", None)):
            _config_errors_print_one_line()
            front_end_config(getattr(args, "additional_config", None))

    setattr(validate, _PATCHED_ATTR, True)
    cls.validate = validate


def _config_errors_print_one_line() -> None:
    """An uncaught ``ConfigError`` ends the process with ``ConfigError: <message>`` on stderr (after
    whatever stdout holds), exit status 1; any other exception goes to the hook that was there."""
    previous = sys.excepthook
    if getattr(previous, "_speedsfi_config_errors", False):
        return

    def excepthook(exc_type, exc, tb):
        from vllm_ext.config_fields import ConfigError

        if not issubclass(exc_type, ConfigError):
            return previous(exc_type, exc, tb)
        sys.stdout.flush()
        print(f"ConfigError: {exc}", file=sys.stderr, flush=True)

    excepthook._speedsfi_config_errors = True
    sys.excepthook = excepthook


def _patch_cpu_selector() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    plat_cls = type(current_platform)
    original = plat_cls.get_attn_backend_cls
    if getattr(original, _PATCHED_ATTR, False):
        return
    original_func = original.__func__

    @functools.wraps(original_func)
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from vllm_ext.config import BACKEND_NAME

        if selected_backend is None or selected_backend.name != BACKEND_NAME:
            return original_func(cls, selected_backend, attn_selector_config, num_heads)
        backend_cls = selected_backend.get_class()
        reasons = backend_cls.validate_configuration(device_capability=None,
                                                     **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend.name} is not valid for this "
                             f"configuration. Reason: {reasons}")
        from vllm.logger import init_logger

        init_logger(__name__).info_once("Using %s backend (vllm_ext) on the CPU platform.",
                                        selected_backend.name)
        return selected_backend.get_path()

    setattr(get_attn_backend_cls, _PATCHED_ATTR, True)
    plat_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _patch_v2_runner_opt_out() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def _get_v2_model_runner_unsupported_features(self):
        unsupported = list(original(self))
        if is_speedsfi_selected(self):
            unsupported.append("the SPEEDSFI attention backend (vllm_ext's request-state adapter "
                               "targets the V1 model runner)")
        return unsupported

    setattr(_get_v2_model_runner_unsupported_features, _PATCHED_ATTR, True)
    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features


def _patch_method_kv_specs() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if not is_speedsfi_selected(vllm_config):
            return spec
        from vllm_ext.backend.startup import engine_of

        for method in engine_of(vllm_config).methods():
            spec = method.attention_kv_spec(spec, self.layer_name)
        return spec

    setattr(get_kv_cache_spec, _PATCHED_ATTR, True)
    Attention.get_kv_cache_spec = get_kv_cache_spec


def _patch_prefix_hit_limit() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._get_local_prefix_cache_hit
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def _get_local_prefix_cache_hit(self, request):
        result = original(self, request)
        policy = scheduler_policy_of(self)
        if policy is None or not result[1]:
            return result
        return limit_prefix_hit(self, request, policy, result)

    setattr(_get_local_prefix_cache_hit, _PATCHED_ATTR, True)
    Scheduler._get_local_prefix_cache_hit = _get_local_prefix_cache_hit


def _patch_chunk_admission() -> None:
    """``Scheduler._reserve_prefill_lookahead`` is the last word on every request's
    ``num_new_tokens`` (running and waiting alike) before the scheduler's "cannot be scheduled now"
    check (0: a running request is skipped this step, a waiting one stays queued): SPEEDSFI's
    admission and chunk rules (``vllm_ext.scheduler_policy``) apply there."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    original = Scheduler._reserve_prefill_lookahead
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = original(self, request, num_computed_tokens, num_new_tokens)
        policy = scheduler_policy_of(self)
        if policy is None or num_new_tokens <= 0:
            return num_new_tokens
        return policy.limit_chunk(request, num_computed_tokens, num_new_tokens,
                                  admitted=request.status == RequestStatus.RUNNING,
                                  running=self.running)

    setattr(_reserve_prefill_lookahead, _PATCHED_ATTR, True)
    Scheduler._reserve_prefill_lookahead = _reserve_prefill_lookahead


def scheduler_policy_of(scheduler):
    """The engine's :class:`vllm_ext.scheduler_policy.SchedulerPolicy` when SPEEDSFI runs a method
    that needs one, else None (cached on the scheduler)."""
    cached = scheduler.__dict__.get("_speedsfi_policy", False)
    if cached is False:
        cached = None
        if is_speedsfi_selected(scheduler.vllm_config):
            from vllm_ext.backend.startup import engine_of
            from vllm_ext.scheduler_policy import SchedulerPolicy

            policy = SchedulerPolicy([m.scheduler_rule() for m in
                                     engine_of(scheduler.vllm_config, announce=False).methods()])
            cached = policy if policy.active else None
            if policy.bounds():
                import logging

                logging.getLogger("vllm_ext").info(
                    "vllm_ext: the scheduler runs at most %s at once; others wait in the queue "
                    "rather than run densely", " and ".join(policy.bounds()))
        scheduler.__dict__["_speedsfi_policy"] = cached
    return cached


def limit_prefix_hit(scheduler, request, policy, result):
    """``result`` (blocks, hit tokens, shared-prefix boundary, diverged) cut to whole blocks where
    the policy says (SFI: before the request's prompt tail; CritiPrefill: at a segment start of its
    sparse range). Every request of the engine is cut the same way (a request that turns SFI off
    loses at most ``w_prefill + block_size`` cached tokens), so the cut never depends on which
    requests run. A layout the cut cannot express (groups of other block sizes) is left as it is
    and counted; the worker then pads the window it could not fill (also counted)."""
    from vllm_ext import metrics

    blocks, num_hit = result[0], result[1]
    bs = scheduler.block_size
    limit = policy.limit_prefix_hit(request, num_hit, bs)
    if limit >= num_hit:
        return result
    groups = scheduler.kv_cache_config.kv_cache_groups
    # groups that never prefix-cache (SFI's compact blocks) hold no hit blocks: nothing to cut there
    cached = [i for i, g in enumerate(groups) if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
    if num_hit % bs or any(groups[i].kv_cache_spec.block_size != bs for i in cached) or any(
            len(blocks.blocks[i]) * bs != num_hit for i in cached):
        metrics.fallback("prefix_hit_uncut", "a prefix-cache hit could not be cut where SPEEDSFI "
                         "needs it (block layout); that request's prompt-tail window is padded "
                         "(SFI) or its first segment is represented by its computed queries only "
                         "(CritiPrefill)")
        return result
    keep = limit // bs
    cut = type(blocks)(tuple(list(b[:keep]) for b in blocks.blocks))
    return (cut, limit) + tuple(result[2:])


def _patch_request_validation() -> None:
    """Requests are checked when they come in (HTTP 400 through the server, an exception from
    ``LLM.generate``), with the field named: per-request ``speedsfi`` overrides
    (``vllm_ext.config.check_request_overrides``: unknown fields, wrong types, impossible values,
    engine-wide fields, SFI on a server without it, ``k`` above the server's); and with SPEED on,
    prompt logprobs (prompt tokens never reach the upper layers, so their logits would be wrong)."""
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, _PATCHED_ATTR, False):
        return

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        result = original(self, params, supported_tasks)
        if is_speedsfi_selected(self.vllm_config):
            check_request(self.__dict__, self.vllm_config, params)
        return result

    setattr(_validate_params, _PATCHED_ATTR, True)
    InputProcessor._validate_params = _validate_params


def check_request(cache: dict, vllm_config, params) -> None:
    """Raise vLLM's ``VLLMValidationError`` (a 400 with the parameter named) for a request SPEEDSFI
    cannot serve as asked. ``cache``: where the engine's parsed configuration is kept."""
    from vllm.exceptions import VLLMValidationError

    from vllm_ext.config import ConfigError, SpeedSfiConfig, check_request_overrides, request_overrides

    cfg = cache.get("_speedsfi_config")
    if cfg is None:
        cfg = cache["_speedsfi_config"] = SpeedSfiConfig.from_additional_config(vllm_config.additional_config)
    extra = getattr(params, "extra_args", None)
    if extra and "speedsfi" in extra:
        try:
            check_request_overrides(cfg, request_overrides(extra))
        except ConfigError as e:
            raise VLLMValidationError(str(e), parameter="vllm_xargs.speedsfi") from None
    if cfg.speed.enabled and getattr(params, "prompt_logprobs", None) is not None:
        raise VLLMValidationError(
            "prompt_logprobs are not available with speedsfi.speed: prompt tokens do not "
            "run the upper layers, so their logits are not the model's",
            parameter="prompt_logprobs")
