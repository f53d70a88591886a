"""What every section of the configuration shares: the error a bad field raises (its message names
the field and says why), the field checks, and how a request's overrides are read and compared.
Imports neither vLLM nor torch."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

CONFIG_KEY = "speedsfi"


class ConfigError(ValueError):
    """A bad ``speedsfi`` configuration. The message names the field and says why."""


def positive(name: str, v: float) -> None:
    if not v > 0:
        raise ConfigError(f"speedsfi.{name} must be > 0, got {v!r}")


def non_negative(name: str, v: float) -> None:
    if not v >= 0:
        raise ConfigError(f"speedsfi.{name} must be >= 0, got {v!r}")


def in_unit(name: str, v: float, *, closed_low: bool = True) -> None:
    ok = (0 <= v <= 1) if closed_low else (0 < v <= 1)
    if not ok:
        raise ConfigError(f"speedsfi.{name} must be in {'[' if closed_low else '('}0, 1], got {v!r}")


def request_overrides(extra_args: Any) -> Mapping[str, Any] | None:
    """A request's ``speedsfi`` overrides: ``extra_args["speedsfi"]`` as a mapping (offline ``LLM``)
    or as its JSON text (the OpenAI server's ``vllm_xargs`` carries strings and numbers only:
    ``"vllm_xargs": {"speedsfi": "{\"sfi\": {\"k\": 256}}"}``). Raises ``ConfigError``."""
    raw = extra_args.get(CONFIG_KEY) if isinstance(extra_args, Mapping) else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"speedsfi: the per-request overrides are not valid JSON ({e})") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"speedsfi: the per-request overrides must be a mapping such as "
                          f"{{\"sfi\": {{\"k\": 256}}}}, got {type(raw).__name__}")
    return raw


def changed_fields(base, other) -> set[str]:
    """``section.field`` names whose values differ (the method sections; top-level scalars such as
    ``preset``, ``dense_decode`` and ``dense_delegate`` are not sections)."""
    changed = set()
    for section in (f.name for f in dataclasses.fields(base)):
        a, b = getattr(base, section), getattr(other, section)
        if dataclasses.is_dataclass(a):
            changed.update(f"{section}.{f.name}" for f in dataclasses.fields(a)
                           if getattr(a, f.name) != getattr(b, f.name))
    return changed
