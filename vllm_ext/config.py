"""The one typed, validated configuration object of the plugin.

Read from ``--additional-config '{"speedsfi": {...}}'`` (or ``LLM(additional_config=...)``), optionally
starting from a named YAML preset (``{"speedsfi": {"preset": "sfi"}}``, a file in ``configs/``) or a
preset path; explicit fields override the preset. Field names and defaults are those of
``ALGORITHMS.md``. Every method is off unless enabled.

This module imports neither vLLM nor torch: the kernels' machines and the config tests use it as is.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from vllm_ext.config_fields import (CONFIG_KEY, ConfigError, changed_fields,  # noqa: F401 (re-exported)
                                    request_overrides)
from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.speed.config import SpeedConfig

BACKEND_NAME = "SPEEDSFI"            # the registered attention backend (--attention-backend speedsfi)
PRESET_DIRS = (
    Path(__file__).resolve().parent / "presets",      # installed package (symlink to configs/ in the repo)
    Path(__file__).resolve().parent.parent / "configs",
)


@dataclass(frozen=True)
class SpeedSfiConfig:
    sfi: SfiConfig = field(default_factory=SfiConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    critiprefill: CritiPrefillConfig = field(default_factory=CritiPrefillConfig)
    preset: str | None = None
    # CUDA: the kernel that attends the decode rows left dense (engine-wide). "paged_decode": ours
    # (split-K, the same launches whatever the rows decide, so a pure-decode step is one FULL CUDA
    # graph); "delegate": vLLM's Triton attention (TritonAttentionImpl, == TRITON_ATTN bit for bit).
    # "auto": paged_decode with SFI on (its dense rows are chosen on the device; the delegate cannot
    # attend a device-chosen subset), the delegate otherwise. With every method off, "paged_decode"
    # is the like-for-like dense reference of SFI (bench/vllm_e2e: SFI with a covering budget ==
    # all off through paged_decode). The CPU build's dense path is paged_reference either way.
    dense_decode: Literal["auto", "delegate", "paged_decode"] = "auto"
    # CUDA: the vLLM backend the dense rows our kernels leave go to (prefill chunks; with every
    # method off, decode too), engine-wide. "triton": TRITON_ATTN (TritonAttentionImpl). "flash_attn":
    # FLASH_ATTN (FA3 on Hopper), what `vllm serve` picks by default there: on an H200 a SPEEDSFI
    # prefill step through TRITON_ATTN looked ~4x slower than FA3's (bench/README.md, 2026-11-26).
    # Both read and write vLLM 0.32's one KV layout. The CPU build's dense path is CPU_ATTN either
    # way. "auto": the backend vLLM's own selector picks for this model, dtype and GPU (FLASH_ATTN on
    # Hopper and Ampere, TRITON_ATTN where FA cannot take it; logged at start-up; a pick SPEEDSFI
    # cannot delegate to, such as FLASHINFER, runs TRITON_ATTN, logged and counted). "flash_attn" and
    # "auto" have not yet run on a GPU: opt-in until a GPU run has checked them token for token.
    dense_delegate: Literal["auto", "triton", "flash_attn"] = "triton"

    @property
    def any_enabled(self) -> bool:
        return self.sfi.enabled or self.speed.enabled or self.critiprefill.enabled

    @property
    def resolved_dense_decode(self) -> str:
        if self.dense_decode == "auto":
            return "paged_decode" if self.sfi.enabled else "delegate"
        return self.dense_decode

    def validate(self) -> None:
        self.sfi.validate()
        self.speed.validate()
        self.critiprefill.validate()
        if self.sfi.enabled and self.dense_decode == "delegate":
            raise ConfigError("speedsfi.dense_decode = 'delegate' is not possible with SFI on: SFI's "
                              "dense rows are chosen on the device each step, and vLLM's Triton "
                              "attention cannot attend a device-chosen subset of the rows; use 'auto' "
                              "or 'paged_decode'")

    def validate_for_model(self, *, num_layers: int, max_model_len: int | None = None) -> None:
        """Checks that need the served model; called at engine start-up."""
        if self.speed.enabled:
            l_cut = self.speed.resolved_l_cut(num_layers)
            if l_cut > num_layers:
                raise ConfigError(f"speedsfi.speed.l_cut ({l_cut}) must be <= the model's number of "
                                  f"layers ({num_layers})")
        for layer in self.critiprefill.dense_layers:
            if self.critiprefill.enabled and layer >= num_layers:
                raise ConfigError(f"speedsfi.critiprefill.dense_layers: layer {layer} does not exist "
                                  f"(the model has {num_layers} layers)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        """Build from the ``speedsfi`` mapping (preset first, then explicit fields); validates."""
        raw = dict(raw or {})
        if not isinstance(raw, dict):
            raise ConfigError(f"speedsfi: expected a mapping, got {type(raw).__name__}")
        preset = raw.pop("preset", None)
        merged: dict[str, Any] = {}
        if preset is not None:
            if not isinstance(preset, str):
                raise ConfigError(f"speedsfi.preset must be a preset name or a path, got {preset!r}")
            merged = load_preset(preset)
        elif _enables_only(raw.get("sfi")):
            # `sfi: {enabled: true}` and nothing else: the default selection, the `sfi` preset's
            # (chosen on a real model: bench/QUALITY.md, "A real model"). Any other sfi field starts
            # from the dataclass's constants (the published method's, ALGORITHMS.md, with the copy
            # trigger on: copy_ngram unset resolves to 2 where a step can be fast).
            merged = {"sfi": dict(load_preset("sfi").get("sfi") or {})}
        _deep_update(merged, raw)
        _copy_trigger_gives_way(merged, raw)
        cfg = _build(cls, merged, "speedsfi")
        cfg = dataclasses.replace(cfg, preset=preset)
        cfg.validate()
        return cfg

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        section = (additional_config or {}).get(CONFIG_KEY)
        return cls.from_dict(section)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        """Per-request overrides (``SamplingParams.extra_args["speedsfi"]``), validated like the global config."""
        if not overrides:
            return self
        if "preset" in overrides:
            raise ConfigError("speedsfi.preset cannot be overridden per request")
        for name in ("dense_decode", "dense_delegate"):
            if name in overrides:
                raise ConfigError(f"speedsfi.{name} is engine-wide: it cannot be overridden per request")
        base = self.to_dict()
        base.pop("preset", None)
        _deep_update(base, dict(overrides))
        _copy_trigger_gives_way(base, overrides)
        cfg = _build(SpeedSfiConfig, base, "speedsfi")
        cfg = dataclasses.replace(cfg, preset=self.preset)
        cfg.validate()
        return cfg


# the fields a request may set for itself (SamplingParams.extra_args["speedsfi"]); every other field
# sizes buffers or plans the batch, so it is the engine's


def check_request_overrides(engine: "SpeedSfiConfig", overrides: Mapping[str, Any] | None) -> "SpeedSfiConfig":
    """The configuration a request runs with, or ``ConfigError`` naming the field it cannot set:
    unknown fields, wrong types and impossible values as at start-up; engine-wide fields; SFI on a
    server started without it; a ``k`` above the engine's (which sizes the compact buffers). A ``k``
    larger than a request's context is allowed: the request decodes densely until its context
    outgrows ``n_sink + n_recent + k``."""
    if not overrides:
        return engine
    cfg = engine.with_overrides(overrides)
    # the fields the request wrote first (an engine default that gave way to one, such as the copy
    # trigger's to schedule always_slow, is not what the request asked to change)
    own = {f"{s}.{k}" for s, sec in overrides.items() if isinstance(sec, Mapping) for k in sec}
    engine_wide = sorted(changed_fields(engine, cfg) - PER_REQUEST_FIELDS, key=lambda f: (f not in own, f))
    if engine_wide:
        raise ConfigError(f"speedsfi.{engine_wide[0]} is engine-wide (set it when the server starts); a "
                          f"request can set {', '.join(sorted(PER_REQUEST_FIELDS))}")
    if cfg.sfi.enabled and not engine.sfi.enabled:
        raise ConfigError("speedsfi.sfi.enabled: this server was started without SFI (no compact "
                          "buffers); start it with speedsfi.sfi.enabled to let requests use SFI")
    if cfg.sfi.enabled and cfg.sfi.k > engine.sfi.k:
        raise ConfigError(f"speedsfi.sfi.k ({cfg.sfi.k}) must be <= the server's sfi.k ({engine.sfi.k}), "
                          f"which sizes the compact buffers")
    return cfg


def _copy_trigger_gives_way(merged: dict[str, Any], own: Mapping[str, Any]) -> None:
    """A ``copy_ngram`` the caller did not write in ``own`` (a preset's, such as the ``sfi`` preset's
    2, or the engine's under a request's overrides) is a default like ``SfiConfig``'s: where the
    trigger cannot apply (schedule ``always_slow``, ``refresh`` 1) it is dropped (unset: resolved to
    0) instead of refused or run for nothing. Only a ``copy_ngram`` the caller wrote is refused with
    ``always_slow``."""
    sfi = merged.get("sfi")
    own_sfi = own.get("sfi") if isinstance(own, Mapping) else None
    if not isinstance(sfi, dict) or (isinstance(own_sfi, Mapping) and "copy_ngram" in own_sfi):
        return
    defaults = SfiConfig()
    if sfi.get("copy_ngram") and (sfi.get("schedule", defaults.schedule) == "always_slow"
                                  or sfi.get("refresh", defaults.refresh) == 1):
        sfi["copy_ngram"] = None


def _enables_only(section: Any) -> bool:
    return isinstance(section, Mapping) and set(section) == {"enabled"} and section["enabled"] is True


def preset_names() -> list[str]:
    names = set()
    for d in PRESET_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_preset(name_or_path: str) -> dict[str, Any]:
    import yaml

    path = Path(os.path.expanduser(name_or_path))
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = next((d / f"{name_or_path}.yaml" for d in PRESET_DIRS if (d / f"{name_or_path}.yaml").is_file()),
                    None)
        if path is None:
            raise ConfigError(f"speedsfi.preset: no preset named {name_or_path!r} and no such YAML file; "
                              f"known presets: {', '.join(preset_names()) or '(none)'}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"speedsfi.preset {path}: expected a mapping at the top level")
    data = data.get(CONFIG_KEY, data)
    if "preset" in data:
        raise ConfigError(f"speedsfi.preset {path}: presets cannot name other presets")
    return data


def _deep_update(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _deep_update(dst[key], value)
        else:
            dst[key] = value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Strict conversion of a JSON/YAML value to an annotated field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:
            return tuple(value)        # "?!." -> ("?", "!", ".")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise TypeError(f"unhandled config type {tp} at {where}")  # a bug in this module, not user input


def _build(cls: type, raw: Any, where: str):
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(fields))})"
            raise ConfigError(f"{where}.{key}: unknown field{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


# ``section.field`` names a request may set (each section's ``PER_REQUEST``); every other field is
# engine-wide
PER_REQUEST_FIELDS = frozenset(f"{f.name}.{name}" for f in dataclasses.fields(SpeedSfiConfig)
                               if isinstance(f.default_factory, type)
                               for name in getattr(f.default_factory, "PER_REQUEST", ()))
SpeedSfiConfig.per_request_fields = PER_REQUEST_FIELDS
