"""The runner hooks hand the request-state table to the SPEEDSFI metadata builders of every KV cache
the runner builds: on CUDA with graphs, vLLM first builds a minimal KV cache to profile graph memory
and then the real one, each with its own builders (``_init_minimal_kv_cache_for_profiling``)."""

from types import SimpleNamespace

from vllm_ext.backend.metadata import SpeedSfiMetadataBuilder
from vllm_ext.runner_hooks import _bind_builders


def _builder():
    b = SpeedSfiMetadataBuilder.__new__(SpeedSfiMetadataBuilder)
    b._state = None
    return b


def _init_kv_cache(runner):
    """What vLLM's ``initialize_kv_cache`` does to the runner that matters here."""
    runner.kv_cache_config = object()
    runner.attn_groups.clear()
    builders = [_builder(), _builder()]
    runner.attn_groups.append([SimpleNamespace(metadata_builders=builders[:1]),
                               SimpleNamespace(metadata_builders=builders[1:])])
    return builders


def test_builders_of_the_real_kv_cache_are_bound_after_the_profiling_one():
    runner = SimpleNamespace(attn_groups=[])
    runner.__dict__["kv_cache_config"] = None
    table = object()
    profiling = _init_kv_cache(runner)
    _bind_builders(runner, table)
    assert all(b._state is table for b in profiling)

    real = _init_kv_cache(runner)                   # attn_groups cleared, new builders, new config
    _bind_builders(runner, table)
    assert all(b._state is table for b in real)


def test_binding_is_done_once_per_kv_cache():
    runner = SimpleNamespace(attn_groups=[])
    builders = _init_kv_cache(runner)
    _bind_builders(runner, "table")
    builders[0]._state = "other"                    # a second call must not walk the groups again
    _bind_builders(runner, "table")
    assert builders[0]._state == "other"


def test_no_builder_yet_binds_nothing_and_retries():
    runner = SimpleNamespace(attn_groups=[], kv_cache_config=None)
    _bind_builders(runner, "table")                 # before the KV cache exists
    builders = _init_kv_cache(runner)
    _bind_builders(runner, "table")
    assert all(b._state == "table" for b in builders)
