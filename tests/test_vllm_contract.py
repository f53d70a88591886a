"""Contract tests: the vLLM 0.32 internals vllm_ext relies on. When one of these fails after a vLLM
upgrade, the matching hook in vllm_ext/vllm_patches.py or vllm_ext/runner_hooks.py must move with it."""

import dataclasses
import inspect

import pytest

pytestmark = pytest.mark.e2e


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_pinned_version():
    import vllm

    import vllm_ext

    assert vllm.__version__.split("+")[0] == vllm_ext.SUPPORTED_VLLM


def test_v1_runner_methods_we_wrap():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner)   # the CPU build runs the V1 runner
    assert _params(GPUModelRunner._update_states)[:2] == ["self", "scheduler_output"]
    params = _params(GPUModelRunner._build_attention_metadata)
    assert params[:4] == ["self", "num_tokens", "num_reqs", "max_query_len"]
    for name in ("num_reqs_padded", "for_cudagraph_capture", "num_scheduled_tokens"):
        assert name in params
    src = inspect.getsource(GPUModelRunner.execute_model)
    assert "num_scheduled_tokens=scheduler_output.num_scheduled_tokens" in src
    assert "self.synchronize_input_prep()" in src


def test_runner_state_we_read():
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    assert {"finished_req_ids", "total_num_scheduled_tokens"} <= {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert "resumed_req_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}
    assert {"sampling_params", "num_computed_tokens"} <= {f.name for f in dataclasses.fields(CachedRequestState)}
    assert "num_prompt_tokens" in inspect.getsource(CachedRequestState)
    src = inspect.getsource(InputBatch.__init__)
    for attr in ("self.num_prompt_tokens =", "self.num_computed_tokens_cpu =", "self._req_ids"):
        assert attr in src
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    init = inspect.getsource(GPUModelRunner.__init__)
    for attr in ("self.input_ids =", "self.query_start_loc =", "self.max_num_reqs ="):
        assert attr in init


def test_config_and_platform_hooks():
    from vllm.config import VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    assert callable(VllmConfig._get_v2_model_runner_unsupported_features)
    assert isinstance(inspect.getattr_static(VllmConfig, "use_v2_model_runner"), property)
    assert "_get_v2_model_runner_unsupported_features" in inspect.getsource(
        inspect.getattr_static(VllmConfig, "use_v2_model_runner").fget)
    assert _params(CpuPlatform.get_attn_backend_cls) == ["selected_backend", "attn_selector_config",
                                                          "num_heads"]


def test_backend_api_shapes():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import register_backend

    assert _params(AttentionImpl.forward)[:8] == ["self", "layer", "query", "key", "value", "kv_cache",
                                                  "attn_metadata", "output"]
    assert _params(AttentionMetadataBuilder.build)[:3] == ["self", "common_prefix_len", "common_attn_metadata"]
    assert _params(register_backend)[:2] == ["backend", "class_path"]
    src = inspect.getsource(Attention.__init__)
    # positional impl arguments, in this order, and the enum lookup by get_name()
    assert "num_heads,\n            head_size,\n            scale,\n            num_kv_heads,\n            " \
           "alibi_slopes,\n            sliding_window,\n            kv_cache_dtype," in src
    assert "AttentionBackendEnum[self.attn_backend.get_name()]" in src


def test_speedsfi_forces_the_v1_runner(tiny_models):
    """With SPEEDSFI selected, VllmConfig lists it among the V2 runner's unsupported features."""
    import vllm_ext
    from vllm.engine.arg_utils import EngineArgs

    vllm_ext.register()
    args = EngineArgs(model=tiny_models["qwen3"], attention_backend="SPEEDSFI", max_model_len=256,
                      enforce_eager=True)
    cfg = args.create_engine_config()
    assert any("SPEEDSFI" in f for f in cfg._get_v2_model_runner_unsupported_features())
    assert cfg.use_v2_model_runner is False
    other = EngineArgs(model=tiny_models["qwen3"], max_model_len=256, enforce_eager=True).create_engine_config()
    assert not any("SPEEDSFI" in f for f in other._get_v2_model_runner_unsupported_features())


def test_prefix_hit_and_batch_execution_hooks():
    """Traffic independence (vllm_ext.methods.sfi.prompt_tail): the scheduler's local prefix-cache hit (cut
    before the prompt tail) and the runner's uniform-decode decision (no FULL graph for a step with
    a prompt row) are where vllm_patches / runner_hooks wrap them."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _params(Scheduler._get_local_prefix_cache_hit) == ["self", "request"]
    src = inspect.getsource(Scheduler.schedule)
    assert "request.shared_prefix_boundary,\n                        hit_diverged,\n" \
           "                    ) = self._get_local_prefix_cache_hit(request)" in src
    assert [f.name for f in dataclasses.fields(KVCacheBlocks)] == ["blocks"]
    params = _params(GPUModelRunner._determine_batch_execution_and_padding)
    assert params[:3] == ["self", "num_tokens", "num_reqs"] and "force_uniform_decode" in params
    src = inspect.getsource(GPUModelRunner.execute_model)
    assert "self._determine_batch_execution_and_padding(\n                num_tokens=" in src
    call = src.split("_determine_batch_execution_and_padding(")[1].split("\n            )\n")[0]
    assert "allow_microbatching=" in call and "force_uniform_decode" not in call


def test_chunk_admission_hook():
    """vllm_ext.scheduler_policy acts through Scheduler._reserve_prefill_lookahead: both of the
    scheduler's loops (running, then waiting) pass every request's num_new_tokens through it last and
    then treat 0 as "cannot be scheduled this step"; running requests carry RUNNING status there."""
    from vllm.v1.core.sched.scheduler import Scheduler

    assert _params(Scheduler._reserve_prefill_lookahead) == ["self", "request", "num_computed_tokens",
                                                             "num_new_tokens"]
    src = inspect.getsource(Scheduler.schedule)
    assert src.count("self._reserve_prefill_lookahead(") == 2
    _, running, waiting = src.split("self._reserve_prefill_lookahead(")
    for part in (running, waiting):
        after = part.split(")\n", 1)[1]
        assert after.lstrip().startswith("if num_new_tokens == 0:")
    assert "request, request.num_computed_tokens, num_new_tokens" in running
    assert "request, num_computed_tokens, num_new_tokens" in waiting
    assert "self.running.append(request)" in src and "request.status = RequestStatus.RUNNING" in src


def test_membership_facts_the_runner_hooks_read():
    """vllm_ext.runner_hooks keeps a request's slot while it is unscheduled (the V1 runner removes
    such requests from its persistent batch but keeps them in ``self.requests``) and releases it
    when the scheduler preempts it (every preemption is listed in ``SchedulerOutput.preempted_req_ids``)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "preempted_req_ids" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert "self.reset_preempted_req_ids.add(request.request_id)" in inspect.getsource(Scheduler._preempt_request)
    assert "preempted_req_ids=self.reset_preempted_req_ids" in inspect.getsource(Scheduler.schedule)
    src = inspect.getsource(GPUModelRunner._update_states)
    assert "self.requests.pop(req_id, None)" in src
    assert "for req_id in unscheduled_req_ids:\n            self.input_batch.remove_request(req_id)" in src
    assert "self._may_reorder_batch(scheduler_output)" in src
    params = inspect.signature(GPUModelRunner._may_reorder_batch).parameters
    assert list(params) == ["self", "scheduler_output"]


def test_a_step_with_an_sfi_prompt_row_is_not_a_uniform_decode_batch():
    from types import SimpleNamespace

    import numpy as np

    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.registry import enabled_methods

    batch = SimpleNamespace(num_computed_tokens_cpu=np.array([50, 99, 7]),
                            num_prompt_tokens=np.array([40, 100, 7]))
    runner = SimpleNamespace(input_batch=batch)

    def breaks(cfg):
        return any(m.breaks_uniform_decode(runner, 3) for m in enabled_methods(cfg, None))

    sfi = SpeedSfiConfig.from_dict({"sfi": {"enabled": True}})
    assert breaks(sfi)                                     # row 1 computes its last prompt token
    batch.num_computed_tokens_cpu[1] = 100
    assert not breaks(sfi)
    batch.num_computed_tokens_cpu[1] = 99
    assert not breaks(SpeedSfiConfig())                    # SFI off


def test_front_end_config_hooks(tiny_models):
    """The ``speedsfi`` section is checked in the front-end process: ``vllm serve`` loads its CLI
    module before plugins load (our ``register`` runs while its parser is built) and validates the
    parsed arguments before it starts anything; ``EngineArgs.create_engine_config`` turns the
    arguments into the ``VllmConfig`` (``additional_config`` as given) before any engine starts."""
    import json

    import vllm.entrypoints.cli.main as cli_main
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_ext
    from vllm_ext import vllm_patches
    from vllm_ext.config import ConfigError

    main_src = inspect.getsource(cli_main.main)
    assert main_src.index("import vllm.entrypoints.cli.serve") < main_src.index("cmd.subparser_init(subparsers)")
    assert main_src.index("cmd.validate(args)") < main_src.index("args.dispatch_function(args)")
    assert "make_arg_parser(serve_parser)" in inspect.getsource(serve.ServeSubcommand.subparser_init)
    assert "load_general_plugins()" in inspect.getsource(AsyncEngineArgs.add_cli_args)
    assert _params(serve.ServeSubcommand.validate) == ["self", "args"]
    assert _params(EngineArgs.create_engine_config)[:2] == ["self", "usage_context"]
    assert "additional_config=self.additional_config" in inspect.getsource(EngineArgs.create_engine_config)
    assert {"attention_backend", "attention_config", "additional_config"} <= {
        f.name for f in dataclasses.fields(EngineArgs)}

    vllm_ext.register()
    vllm_patches.install()                   # the CLI hook, where register() ran before serve loaded
    bad = {"speedsfi": {"sfi": {"n_recnt": 5}}}
    model = tiny_models["qwen3"]
    parser = FlexibleArgumentParser()
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    for backend in (["--attention-backend", "speedsfi"], ["--attention-config", '{"backend": "SPEEDSFI"}']):
        args = parser.parse_args(["serve", model, *backend, "--additional-config", json.dumps(bad)])
        with pytest.raises(ConfigError, match=r"speedsfi\.sfi\.n_recnt: unknown field"):
            cmd.validate(args)
    cmd.validate(parser.parse_args(["serve", model, "--additional-config", json.dumps(bad)]))
    assert vllm_patches.names_speedsfi(None, {"backend": "SPEEDSFI"})
    assert not vllm_patches.names_speedsfi("CPU_ATTN", None)

    with pytest.raises(ConfigError, match=r"speedsfi\.sfi\.n_recnt: unknown field"):
        EngineArgs(model="/nonexistent/model", attention_backend="SPEEDSFI", additional_config=bad,
                   enforce_eager=True).create_engine_config()             # before vLLM reads the model
    with pytest.raises(ConfigError, match=r"speedsfi\.speed\.l_cut \(3\) must be <= the model's number "
                                          r"of layers \(2\)"):
        EngineArgs(model=model, attention_backend="SPEEDSFI", max_model_len=256, enforce_eager=True,
                   additional_config={"speedsfi": {"speed": {"enabled": True, "l_cut": 3}}}).create_engine_config()
    # another backend: the section is not SPEEDSFI's business
    EngineArgs(model=model, max_model_len=256, enforce_eager=True, additional_config=bad).create_engine_config()
