"""What every section of the configuration shares: the error a bad field raises (its message names
the field and says why) and the field checks. Imports neither vLLM nor torch."""

from __future__ import annotations


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
