#!/usr/bin/env python3
"""Unpack the payload of ``scripts/gpu_vllm_bundle.sh`` on the GPU machine (stdlib only).

    python3 scripts/gpu_vllm_unpack.py [--payload .gpu_payload/carry] [--target /tmp/vllm_site]
                                       [--so auto|full|sm90]
    python3 scripts/gpu_vllm_unpack.py --stash       # call A of the fallback: keep the whole _C
                                                     # library (.gpu_payload/carry_so_full) on the
                                                     # warm machine for the next call

Into ``--target`` (put it on ``PYTHONPATH`` with the repository root): vLLM's Python tree, the
dependency folder, ``vllm/_C_stable_libtorch.abi3.so`` and
``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``. No file of vLLM is changed. It also writes a
``vllm_speedsfi-<version>.dist-info`` with the package's ``vllm.general_plugins`` entry point (the
repository is on ``PYTHONPATH`` there, not pip-installed), so vLLM loads the plugin as it would
after ``pip install``.

``--so auto`` takes the whole library when it is stashed (or carried), else the sm_90-pruned one.
Every archive's SHA-256 is checked against ``MANIFEST.json``; a second run with the same payload
is a no-op (stamp ``<target>/.speedsfi_payload.json``). Exit status 1 with a message on any problem.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SO_REL = os.path.join("vllm", "_C_stable_libtorch.abi3.so")
FA3_REL = os.path.join("vllm", "vllm_flash_attn", "_vllm_fa3_C.abi3.so")
FULL_XZ = "_C_stable_libtorch.abi3.so.xz"
SM90_XZ = "_C_stable_libtorch.abi3.sm90.so.xz"
STAMP = ".speedsfi_payload.json"


def log(msg: str) -> None:
    print(f"[unpack] {msg}", flush=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_manifest(folder: str) -> dict:
    path = os.path.join(folder, "MANIFEST.json")
    if not os.path.isfile(path):
        raise SystemExit(f"[unpack] {path} missing: build it with scripts/gpu_vllm_bundle.sh and carry "
                         f"{os.path.relpath(folder, ROOT)}")
    with open(path) as f:
        return json.load(f)


def verified(folder: str, name: str, manifest: dict) -> str:
    path = os.path.join(folder, name)
    want = manifest.get("files", {}).get(name, {}).get("sha256")
    if not os.path.isfile(path):
        raise SystemExit(f"[unpack] {path} missing")
    got = sha256(path)
    if want and got != want:
        raise SystemExit(f"[unpack] {path}: SHA-256 {got} != MANIFEST {want} (a broken transfer?)")
    return got


def unxz(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = dst + ".part"
    with lzma.open(src) as fi, open(tmp, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 22)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dst)


def untar(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    with tarfile.open(src, "r:xz") as tf:
        try:
            tf.extractall(dst, filter="data")
        except TypeError:                      # Python < 3.12 without the filter argument
            tf.extractall(dst)


def project_version() -> str:
    try:
        text = open(os.path.join(ROOT, "pyproject.toml")).read()
        return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
    except Exception:
        return "0.0.0"


def write_plugin_dist_info(target: str) -> str:
    """The ``vllm.general_plugins`` entry point of pyproject.toml, for a repo on PYTHONPATH."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    m = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\s*\n([^\[]*)', text)
    body = (m.group(1).strip() if m else 'speedsfi = "vllm_ext:register"').replace('"', "")
    ver = project_version()
    for old in os.listdir(target):
        if old.startswith("vllm_speedsfi-") and old.endswith(".dist-info"):
            shutil.rmtree(os.path.join(target, old))
    d = os.path.join(target, f"vllm_speedsfi-{ver}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm-speedsfi\nVersion: {ver}\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write(f"[vllm.general_plugins]\n{body}\n")
    with open(os.path.join(d, "top_level.txt"), "w") as f:
        f.write("vllm_ext\n")
    with open(os.path.join(d, "RECORD"), "w") as f:
        f.write("")
    return d


def stash(full_dir: str, stash_dir: str) -> int:
    man = load_manifest(full_dir)
    digest = verified(full_dir, FULL_XZ, man)
    os.makedirs(stash_dir, exist_ok=True)
    so = os.path.join(stash_dir, "_C_stable_libtorch.abi3.so")
    stamp = so + ".sha256"
    if os.path.isfile(so) and os.path.isfile(stamp) and open(stamp).read().strip() == digest:
        log(f"whole _C library already stashed in {stash_dir}")
        return 0
    t = time.time()
    unxz(os.path.join(full_dir, FULL_XZ), so)
    with open(stamp, "w") as f:
        f.write(digest)
    log(f"stashed the whole _C library ({os.path.getsize(so) / 2**20:.1f} MiB) in {stash_dir} "
        f"({time.time() - t:.1f} s); the next call (within the warm window) uses it")
    return 0


def unpack(payload: str, target: str, so_choice: str, full_dir: str, stash_dir: str) -> dict:
    t0 = time.time()
    man = load_manifest(payload)
    digests = {n: verified(payload, n, man) for n in ("vllm_py_slim.tar.xz", "deps_site.tar.xz",
                                                       "_vllm_fa3_C.abi3.so.xz")}
    # which _C library
    stashed = os.path.join(stash_dir, "_C_stable_libtorch.abi3.so")
    full_carried = os.path.isfile(os.path.join(full_dir, FULL_XZ))
    if so_choice == "auto":
        so_choice = "full" if (os.path.isfile(stashed) or full_carried) else "sm90"
    if so_choice == "full":
        if os.path.isfile(stashed) and os.path.isfile(stashed + ".sha256"):
            so_src, so_digest = stashed, "full:" + open(stashed + ".sha256").read().strip()
        elif full_carried:
            so_src = os.path.join(full_dir, FULL_XZ)
            so_digest = "full:" + verified(full_dir, FULL_XZ, load_manifest(full_dir))
        else:
            raise SystemExit("[unpack] --so full: no stashed library and no carried "
                             f"{os.path.relpath(full_dir, ROOT)}/{FULL_XZ}")
    else:
        so_src = os.path.join(payload, SM90_XZ)
        so_digest = "sm90:" + verified(payload, SM90_XZ, man)
    want = dict(digests, so=so_digest, vllm=man.get("vllm"))
    stamp_path = os.path.join(target, STAMP)
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            have = json.load(f)
        if {k: have.get(k) for k in want} == want and os.path.isfile(os.path.join(target, SO_REL)):
            write_plugin_dist_info(target)
            log(f"{target} is up to date (vLLM {man.get('vllm')}, _C {so_digest.split(':')[0]})")
            return have
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.makedirs(target)
    untar(os.path.join(payload, "vllm_py_slim.tar.xz"), target)
    untar(os.path.join(payload, "deps_site.tar.xz"), target)
    if so_src.endswith(".xz"):
        unxz(so_src, os.path.join(target, SO_REL))
    else:
        shutil.copyfile(so_src, os.path.join(target, SO_REL))
        os.chmod(os.path.join(target, SO_REL), 0o755)
    unxz(os.path.join(payload, "_vllm_fa3_C.abi3.so.xz"), os.path.join(target, FA3_REL))
    dist = write_plugin_dist_info(target)
    info = dict(want, so_variant=so_digest.split(":")[0], target=target, unpacked_s=round(time.time() - t0, 1),
                plugin_dist_info=os.path.basename(dist))
    with open(stamp_path, "w") as f:
        json.dump(info, f, indent=1)
    log(f"unpacked vLLM {man.get('vllm')} into {target} in {info['unpacked_s']} s "
        f"(_C library: {info['so_variant']})")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload", default=os.path.join(ROOT, ".gpu_payload", "carry"))
    ap.add_argument("--full-so-dir", default=os.path.join(ROOT, ".gpu_payload", "carry_so_full"))
    ap.add_argument("--stash-dir", default=os.environ.get("VLLM_SO_STASH", "/tmp/vllm_so_stash"))
    ap.add_argument("--target", default=os.environ.get("VLLM_SITE", "/tmp/vllm_site"))
    ap.add_argument("--so", choices=("auto", "full", "sm90"), default=os.environ.get("VLLM_SO", "auto"))
    ap.add_argument("--stash", action="store_true", help="only keep the whole _C library for the next call")
    args = ap.parse_args(argv)
    try:
        if args.stash:
            return stash(args.full_so_dir, args.stash_dir)
        unpack(args.payload, args.target, args.so, args.full_so_dir, args.stash_dir)
        return 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
