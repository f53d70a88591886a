"""The methods this build has, in the order the backend consults them (a method that takes a layer
whole comes first). Adding a method is a package under ``vllm_ext/methods/`` and one line here."""

from __future__ import annotations

from vllm_ext.methods.critiprefill.method import CritiPrefillMethod
from vllm_ext.methods.sfi.method import SfiMethod
from vllm_ext.methods.speed.method import SpeedMethod

METHODS = (SpeedMethod, SfiMethod, CritiPrefillMethod)


def enabled_methods(config, vllm_config, *, row_counters=None) -> list:
    """One object per method ``config`` enables."""
    return [cls(config, vllm_config, row_counters=row_counters) for cls in METHODS if cls.enabled(config)]


def register_kv_specs() -> None:
    for cls in METHODS:
        cls.register_kv_specs()


def install_patches() -> None:
    for cls in METHODS:
        cls.install_patches()
