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
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_repeated_language_patch

    skip_repeated_language_patch()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


# Modules that run Triton kernels in the CPU interpreter, train a model, start a process or smoke-run
# a benchmark: seconds each, minutes together on a 2-core machine. They count as `slow` (CI runs them;
# `scripts/run_tests.sh -m "not slow"` stays a quick loop of unit tests); on a GPU they are quick.
HEAVY_MODULES = (
    "kernels/",
    "sfi/test_sfi_selector_triton.py", "sfi/test_sfi_selector_parallel.py", "sfi/test_sfi_plan_kernel.py",
    "sfi/test_quest.py", "sfi/test_quest_rerank.py", "sfi/test_quest_paged.py",
    "critiprefill/test_block_sparse_prefill.py", "critiprefill/test_plan.py",
    "critiprefill/test_bench_smoke.py", "critiprefill/test_block_representatives.py",
    "critiprefill/test_incremental_reps.py", "critiprefill/test_backend_path.py",
    "quality/test_speed_model.py", "e2e/", "test_sfi_keep_prefill.py", "test_registration.py",
    "test_sfi_path.py", "test_sfi_layer.py", "test_vllm_patch_list.py",
)
_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        rel = os.path.relpath(str(item.fspath), _TESTS).replace(os.sep, "/")
        if not _has_cuda() and any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in HEAVY_MODULES):
            item.add_marker(slow)
    # Engines first (the longest files), then the other slow tests, then the quick unit tests: with
    # two xdist workers taking whole files as they free up, the quick ones fill the end, where a long
    # file started last would keep one worker busy alone (scripts/run_tests.sh keeps this order:
    # --no-loadscope-reorder).
    items[:] = sorted(items, key=lambda item: ("slow" not in item.keywords, "e2e" not in item.keywords))
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
