"""Start-up checks: the ``speedsfi`` configuration against the served model and the engine's features,
and the start-up line that says what the engine runs.

The section's own fields, and what it asks of the model, are checked in the front-end process
before any engine starts (:func:`front_end_config`, :func:`check_front_end_model`, called from
``vllm_ext.vllm_patches``). The rest runs in the worker while the model is built (the first SPEEDSFI
layer), before weights load and before KV-cache profiling, so a bad configuration stops start-up
with a message naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from vllm_ext.methods.registry import METHODS, enabled_methods
from vllm_ext.config import BACKEND_NAME, ConfigError, SpeedSfiConfig

# Methods whose implementation is present in this build. Enabling one that is not stops start-up:
# an enabled method never silently runs densely.
IMPLEMENTED_METHODS: frozenset[str] = frozenset(cls.name for cls in METHODS)

def is_speedsfi_selected(vllm_config) -> bool:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def names_speedsfi(attention_backend, attention_config) -> bool:
    """Whether engine arguments select SPEEDSFI before vLLM builds its config: ``--attention-backend``
    or the ``backend`` of ``--attention-config``, each a name, an enum member, a mapping or vLLM's
    ``AttentionConfig``."""
    backend = attention_backend
    if backend is None:
        backend = (attention_config.get("backend") if isinstance(attention_config, Mapping)
                   else getattr(attention_config, "backend", None))
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    return isinstance(name, str) and name.upper() == BACKEND_NAME


def front_end_config(additional_config) -> SpeedSfiConfig | None:
    """The ``speedsfi`` section parsed and validated where vLLM reads its arguments (the front-end
    process, before any engine or worker starts), so a mistake in it stops start-up there with
    ``ConfigError`` naming the field. None when ``additional_config`` is not a mapping (another
    plugin's object: the section cannot be read from it). What needs the served model is checked
    by :func:`check_front_end_model`, what needs the engine at engine start-up (:func:`check_engine`)."""
    if additional_config is not None and not isinstance(additional_config, Mapping):
        return None
    return SpeedSfiConfig.from_additional_config(additional_config)


def check_front_end_model(cfg: SpeedSfiConfig, vllm_config) -> None:
    """The checks of ``cfg`` against the served model that need no engine (``speed.l_cut``,
    ``critiprefill.dense_layers``), run in the front-end process once vLLM has read the model's
    config."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        cfg.validate_for_model(num_layers=model_config.get_total_num_hidden_layers(),
                               max_model_len=model_config.max_model_len)


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
        self._announced = False

    def methods(self) -> list:
        return self._methods

    def announce(self) -> None:
        """Log :func:`describe`'s line once, at INFO in vLLM's log, from the engine's first worker
        (rank 0; the other ranks and the scheduler's copy of the engine stay silent)."""
        if self._announced or getattr(getattr(self.vllm_config, "parallel_config", None), "rank", 0) != 0:
            return
        self._announced = True
        from vllm.logger import init_logger
        from vllm.platforms import current_platform

        model_config = getattr(self.vllm_config, "model_config", None)
        num_layers = model_config.get_total_num_hidden_layers() if model_config is not None else None
        init_logger(STARTUP_LOGGER).info("%s", describe(self.config, num_layers=num_layers,
                                                        on_cpu=current_platform.is_cpu()))

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


def engine_of(vllm_config, *, announce: bool = True) -> Engine:
    """The engine of ``vllm_config`` (made once: one engine per process at a time, so a new config
    replaces the last). ``announce``: log the start-up line if not yet logged (the worker's
    callers); the scheduler passes False."""
    global _engine
    if _engine is None or _engine.vllm_config is not vllm_config:
        _engine = Engine(vllm_config, _resolve(vllm_config))
    if announce:
        _engine.announce()
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
    return cfg


STARTUP_LOGGER = "vllm.speedsfi"     # a child of vLLM's logger: its handler, format and level
_DELEGATE_BACKENDS = {"triton": "TRITON_ATTN", "flash_attn": "FLASH_ATTN"}


def describe(cfg: SpeedSfiConfig, *, num_layers: int | None, on_cpu: bool) -> str:
    """The start-up line: what the engine runs, from its resolved configuration. ``num_layers``: the
    model's (SPEED's resolved ``l_cut``); ``on_cpu``: vLLM's CPU build (dense rows on ``CPU_ATTN``)."""
    on = [cls.name for cls in METHODS if cls.enabled(cfg)]
    parts = [f"preset {cfg.preset}" if cfg.preset else "no preset",
             f"methods on: {', '.join(on)}" if on else "methods on: none (every row dense)"]
    if cfg.sfi.enabled:
        s = cfg.sfi
        rows = "auto" if s.maintenance_rows is None else s.maintenance_rows
        parts.append(f"sfi k={s.k} n_sink={s.n_sink} n_recent={s.n_recent} min_len={s.min_len} "
                     f"refresh={s.refresh}{' (warm-up)' if s.refresh_warmup else ''} schedule={s.schedule} "
                     f"selector={s.selector}{f' page_size={s.page_size}' if s.selector == 'quest' else ''} "
                     f"keep_prefill={s.keep_prefill} copy_ngram={s.resolved_copy_ngram} "
                     f"maintenance_rows={rows}")
    if cfg.speed.enabled:
        l_cut = cfg.speed.resolved_l_cut(num_layers) if num_layers else cfg.speed.l_cut
        of = f" of {num_layers} layers" if num_layers else ""
        parts.append(f"speed l_cut={l_cut if l_cut is not None else '3/4'}{of} variant={cfg.speed.variant}")
    if cfg.critiprefill.enabled:
        c = cfg.critiprefill
        parts.append(f"critiprefill budget={c.budget} segment_size={c.segment_size} block_size={c.block_size} "
                     f"min_len={c.min_len} dense_layers={','.join(map(str, c.dense_layers)) or 'none'}")
    if on_cpu:
        parts.append("dense rows: CPU_ATTN (CPU build)")
    else:
        delegate = _DELEGATE_BACKENDS.get(cfg.dense_delegate, cfg.dense_delegate)
        decode = "paged_decode" if cfg.resolved_dense_decode == "paged_decode" else delegate
        parts.append(f"dense rows: {delegate} (dense_delegate {cfg.dense_delegate}), "
                     f"dense decode rows: {decode}")
    return "SPEEDSFI attention backend: " + "; ".join(parts)


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
