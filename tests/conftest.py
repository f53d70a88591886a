"""Shared test setup. Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless a test
says otherwise; tiny checkpoints are built once per session (offline, about 2 s each)."""

import os

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Kernel tests run the Triton kernels in Triton's CPU interpreter where there is no GPU. It must be
# on before any vllm_ext.kernels module is imported (@triton.jit decides at decoration time), so it
# is set here, first, for the whole session. Engines in tests/e2e use the PyTorch twins unless a
# test asks for the kernels (tests/e2e/engine.py).
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> checkpoint dir; sharp fp32 weights, 2 layers, 4 query / 2 KV heads, head 32."""
    from vllm_ext.tools.tiny_models import make_model

    root = os.environ.get("SPEEDSFI_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return {arch: make_model(os.path.join(root, f"tiny-{arch}"), arch)
            for arch in ("llama", "qwen2", "qwen3")}
