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
METHOD_NAMES: frozenset[str] = frozenset(cls.name for cls in METHODS)

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


def check_flash_attn_delegate(vllm_config, *, on_cpu: bool, capability) -> None:
    """``speedsfi.dense_delegate = "flash_attn"``: FLASH_ATTN must take this model, cache and GPU,
    or start-up stops naming what it refuses (never a silent switch back to TRITON_ATTN)."""
    if on_cpu:
        logger.info("vllm_ext: speedsfi.dense_delegate = 'flash_attn' applies to CUDA; the CPU build "
                    "attends dense rows with CPU_ATTN")
        return
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    head = vllm_config.model_config.get_head_size()
    cache_dtype = vllm_config.cache_config.cache_dtype
    why = None
    if not FlashAttentionBackend.supports_head_size(head):
        why = f"head size {head}"
    elif not FlashAttentionBackend.supports_kv_cache_dtype(cache_dtype):
        why = f"KV cache dtype {cache_dtype}"
    elif capability is not None and not FlashAttentionBackend.supports_compute_capability(capability):
        why = f"compute capability {capability}"
    if why is not None:
        raise ConfigError(f"speedsfi.dense_delegate = 'flash_attn': vLLM's FLASH_ATTN does not support "
                          f"this {why}; use 'triton'")


# vLLM backends SPEEDSFI can hand its dense rows to, by vLLM's backend name
DELEGATES = {"FLASH_ATTN": "flash_attn", "TRITON_ATTN": "triton"}


def vllm_default_backend(vllm_config) -> str:
    """The name of the attention backend vLLM's own selector picks for this model, dtype, cache and
    device when no backend is named (what ``vllm serve MODEL`` runs)."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    model, cache = vllm_config.model_config, vllm_config.cache_config
    selector = AttentionSelectorConfig(
        head_size=model.get_head_size(), dtype=model.dtype, kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size if getattr(cache, "user_specified_block_size", False) else None,
        use_mla=bool(getattr(model, "use_mla", False)))
    path = current_platform.get_attn_backend_cls(
        None, attn_selector_config=selector,
        num_heads=model.get_num_attention_heads(vllm_config.parallel_config))
    return resolve_obj_by_qualname(path).get_name()


def resolve_dense_delegate(cfg: SpeedSfiConfig, vllm_config, *, on_cpu: bool, pick=None) -> str:
    """``speedsfi.dense_delegate`` as it runs: ``"auto"`` becomes the delegate of vLLM's own pick
    (``pick``: a callable returning that backend's name, default :func:`vllm_default_backend`).
    The CPU build's dense rows run ``CPU_ATTN`` whatever the field says: ``"auto"`` stays."""
    if cfg.dense_delegate != "auto":
        return cfg.dense_delegate
    if on_cpu:
        logger.info("vllm_ext: speedsfi.dense_delegate = 'auto': the CPU build's dense rows run CPU_ATTN")
        return "auto"
    name = (pick or vllm_default_backend)(vllm_config)
    delegate = DELEGATES.get(name)
    if delegate is None:
        from vllm_ext import metrics

        metrics.fallback("dense_delegate_auto", "vllm_ext: speedsfi.dense_delegate = 'auto': vLLM would "
                         "pick %s, which SPEEDSFI cannot hand dense rows to (it delegates to %s); "
                         "using TRITON_ATTN", name, " or ".join(sorted(DELEGATES)))
        return "triton"
    logger.info("vllm_ext: speedsfi.dense_delegate = 'auto': %s (vLLM's pick for head size %s, %s, "
                "KV cache %s) attends the dense rows", name, vllm_config.model_config.get_head_size(),
                vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype)
    return delegate


def check_engine(cfg: SpeedSfiConfig, vllm_config) -> None:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    num_layers = model_config.get_total_num_hidden_layers()
    cfg.validate_for_model(num_layers=num_layers, max_model_len=model_config.max_model_len)

    for f in dataclasses.fields(cfg):
        if getattr(getattr(cfg, f.name), "enabled", False) and f.name not in METHOD_NAMES:
            raise ConfigError(f"speedsfi.{f.name}.enabled: {f.name} is not available in vllm-speedsfi "
                              f"yet; remove it or set it to false")

    if cfg.dense_delegate == "flash_attn":
        from vllm.platforms import current_platform

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
        raise ConfigError(f"speedsfi: the methods ({', '.join(sorted(METHOD_NAMES))}) do not support "
                          "speculative decoding")
    for method in enabled_methods(cfg, vllm_config):
        method.check_engine()
