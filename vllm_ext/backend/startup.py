"""Start-up checks: the ``speedsfi`` configuration against the served model and the engine's features.

Runs in the worker while the model is built (the first SPEEDSFI layer), before weights load and
before KV-cache profiling, so a bad configuration stops start-up with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ext.methods.registry import METHODS, enabled_methods
from vllm_ext.config import BACKEND_NAME, ConfigError, SpeedSfiConfig

logger = logging.getLogger("vllm_ext")

# Methods whose implementation is present in this build. Enabling one that is not stops start-up:
# an enabled method never silently runs densely.
IMPLEMENTED_METHODS: frozenset[str] = frozenset(cls.name for cls in METHODS)

def is_speedsfi_selected(vllm_config) -> bool:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


class Engine:
    """What one engine runs: its resolved configuration and the methods it enables (one object per
    ``VllmConfig``; the impls, builders and runner hooks of the engine share it)."""

    def __init__(self, vllm_config, config: SpeedSfiConfig):
        self.vllm_config = vllm_config
        self.config = config
        self._methods = enabled_methods(config, vllm_config)
        self._row_counters = None
        self.buffers: dict = {}          # persistent buffers the engine's layers share, by shape
        self.warmup_entry = None         # the engine's entry in vLLM's JIT warm-up registry

    def methods(self) -> list:
        return self._methods

    def row_counters(self, device):
        """The engine's row counters on ``device`` (``SPEEDSFI_ROW_COUNTERS``; None when off), which
        the builders, the dense path and the methods share."""
        if self._row_counters is None:
            from vllm_ext import row_counters

            self._row_counters = row_counters.counters_if_enabled(device) or False
            for m in self._methods:
                m.row_counters = self._row_counters or None
        return self._row_counters or None


_engine: Engine | None = None


def engine_of(vllm_config) -> Engine:
    """The engine of ``vllm_config`` (made once: one engine per process at a time, so a new config
    replaces the last)."""
    global _engine
    if _engine is None or _engine.vllm_config is not vllm_config:
        _engine = Engine(vllm_config, _resolve(vllm_config))
    return _engine


def resolve_config(vllm_config) -> SpeedSfiConfig:
    """The validated configuration for this engine (parsed once per ``VllmConfig``)."""
    return engine_of(vllm_config).config


def _resolve(vllm_config) -> SpeedSfiConfig:
    cfg = SpeedSfiConfig.from_additional_config(vllm_config.additional_config)
    if cfg.dense_delegate == "auto":
        from vllm.platforms import current_platform

        from vllm_ext.backend.dense_delegate import resolve_dense_delegate

        cfg = dataclasses.replace(cfg, dense_delegate=resolve_dense_delegate(
            cfg, vllm_config, on_cpu=current_platform.is_cpu()))
    for cls in METHODS:
        if cls.enabled(cfg):
            cfg = cls.resolve(cfg, vllm_config)
    check_engine(cfg, vllm_config)
    logger.info("vllm_ext: SPEEDSFI configuration: %s", _describe(cfg))
    return cfg


def _describe(cfg: SpeedSfiConfig) -> str:
    parts = [cls.name for cls in METHODS if cls.enabled(cfg)]
    return (f"methods on: {', '.join(parts)}" if parts else "all methods off (dense)") + \
        (f" (preset {cfg.preset})" if cfg.preset else "")


def check_engine(cfg: SpeedSfiConfig, vllm_config) -> None:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    num_layers = model_config.get_total_num_hidden_layers()
    cfg.validate_for_model(num_layers=num_layers, max_model_len=model_config.max_model_len)

    for f in dataclasses.fields(cfg):
        if getattr(getattr(cfg, f.name), "enabled", False) and f.name not in IMPLEMENTED_METHODS:
            raise ConfigError(f"speedsfi.{f.name}.enabled: {f.name} is not available in vllm-speedsfi "
                              f"yet; remove it or set it to false")

    if cfg.dense_delegate == "flash_attn":
        from vllm.platforms import current_platform

        from vllm_ext.backend.dense_delegate import check_flash_attn_delegate

        check_flash_attn_delegate(vllm_config, on_cpu=current_platform.is_cpu(),
                                  capability=None if current_platform.is_cpu()
                                  else current_platform.get_device_capability())

    if getattr(model_config, "use_mla", False):
        raise ConfigError("SPEEDSFI does not support MLA models (DeepSeek-style latent attention)")
    if model_config.is_encoder_decoder:
        raise ConfigError("SPEEDSFI does not support encoder-decoder models")
    if vllm_config.use_v2_model_runner:
        raise ConfigError("SPEEDSFI runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
    if getattr(parallel, "use_ubatching", False):
        raise ConfigError("SPEEDSFI does not support dual-batch overlap (--enable-dbo)")
    if parallel.decode_context_parallel_size > 1 or \
            getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        raise ConfigError("SPEEDSFI does not support decode/prefill context parallelism")
    if cfg.any_enabled and vllm_config.speculative_config is not None:
        raise ConfigError(f"speedsfi: the methods ({', '.join(sorted(IMPLEMENTED_METHODS))}) do not support "
                          "speculative decoding")
    for method in enabled_methods(cfg, vllm_config):
        method.check_engine()
