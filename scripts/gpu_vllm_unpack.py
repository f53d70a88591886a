#!/usr/bin/env python3
"""Unpack the payload of ``scripts/gpu_vllm_bundle.sh`` on the GPU machine (stdlib only).

    python3 scripts/gpu_vllm_unpack.py [--target /tmp/vllm_site] [--so auto|full|sm90]
    python3 scripts/gpu_vllm_unpack.py --stash       # keep the carried archives on the warm machine

The payload is split into folders under ``.gpu_payload/`` so that each device call fits the tool's
64 MiB (project files included): ``carry`` (the sm_90-pruned ``_C`` library and vLLM's Python tree),
``carry_deps`` (the dependency folder and FlashAttention-3) and, for the fallback only,
``carry_so_full_<i>`` (parts of the whole ``_C`` library). Each archive is taken from whichever carried
folder holds it, else from the stash (``--stash-dir``) that an earlier ``--stash`` call on the same warm
machine filled; a split archive is joined once all its parts are stashed.

Into ``--target`` (put it on ``PYTHONPATH`` with the repository root): vLLM's Python tree, the
dependency folder, ``vllm/_C_stable_libtorch.abi3.so`` and
``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``. No file of vLLM is changed. It also writes a
``vllm_speedsfi-<version>.dist-info`` with the package's ``vllm.general_plugins`` entry point (the
repository is on ``PYTHONPATH`` there, not pip-installed), so vLLM loads the plugin as it would
after ``pip install``.

``--so auto`` takes the whole library when it is available (stashed), else the sm_90-pruned one.
Every archive's SHA-256 is checked against its folder's ``MANIFEST.json``; a second run with the same
payload is a no-op (stamp ``<target>/.speedsfi_payload.json``). Exit status 1 with a message on any
problem.
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


def payload_folders(payload_root: str) -> list[str]:
    """The carried folders of one payload (``carry``, ``carry_deps``, ``carry_so_full_<i>``) present here."""
    if not os.path.isdir(payload_root):
        return []
    return [os.path.join(payload_root, n) for n in sorted(os.listdir(payload_root))
            if n.startswith("carry") and os.path.isfile(os.path.join(payload_root, n, "MANIFEST.json"))]


def _stashed(stash_dir: str, name: str) -> str | None:
    """SHA-256 of ``name`` kept in the stash (checked when it was stashed), or None."""
    path, stamp = os.path.join(stash_dir, name), os.path.join(stash_dir, name + ".sha256")
    if os.path.isfile(path) and os.path.isfile(stamp):
        return open(stamp).read().strip()
    return None


def locate(name: str, folders: list[str], stash_dir: str) -> tuple[str, str]:
    """(path, SHA-256) of archive ``name``: from a carried folder (checked now) or the stash."""
    for folder in folders:
        man = load_manifest(folder)
        if name in man.get("files", {}) and os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name), verified(folder, name, man)
    digest = _stashed(stash_dir, name)
    if digest:
        return os.path.join(stash_dir, name), digest
    where = ", ".join(os.path.relpath(f, ROOT) for f in folders) or "no carried payload folder"
    raise SystemExit(f"[unpack] {name} is neither carried ({where}) nor stashed in {stash_dir}: carry the "
                     "folder that holds it (scripts/gpu_vllm_bundle.sh prints which), or stash it in an "
                     "earlier call (scripts/gpu_e2e.sh stash)")


def stash(folders: list[str], stash_dir: str) -> int:
    """Keep every archive of the carried ``folders`` (checked) in ``stash_dir`` for later calls on the
    warm machine, and join an archive split over several calls once all its parts are stashed."""
    os.makedirs(stash_dir, exist_ok=True)
    if not folders:
        raise SystemExit("[unpack] --stash: no payload folder is carried")
    joins = {}
    for folder in folders:
        man = load_manifest(folder)
        joins.update(man.get("joins", {}))
        for name in man.get("files", {}):
            digest = verified(folder, name, man)
            if _stashed(stash_dir, name) == digest:
                log(f"{name} already stashed")
                continue
            shutil.copyfile(os.path.join(folder, name), os.path.join(stash_dir, name + ".part"))
            os.replace(os.path.join(stash_dir, name + ".part"), os.path.join(stash_dir, name))
            with open(os.path.join(stash_dir, name + ".sha256"), "w") as f:
                f.write(digest)
            log(f"stashed {name} ({os.path.getsize(os.path.join(stash_dir, name)) / 2**20:.1f} MiB) "
                f"from {os.path.relpath(folder, ROOT)}")
    for whole, spec in joins.items():
        if _stashed(stash_dir, whole) == spec["sha256"]:
            continue
        missing = [p for p in spec["parts"] if not _stashed(stash_dir, p)]
        if missing:
            log(f"{whole}: {len(spec['parts']) - len(missing)} of {len(spec['parts'])} parts stashed; "
                f"the next stash call carries {', '.join(missing)}")
            continue
        out = os.path.join(stash_dir, whole)
        with open(out + ".part", "wb") as fo:
            for p in spec["parts"]:
                with open(os.path.join(stash_dir, p), "rb") as fi:
                    shutil.copyfileobj(fi, fo, 1 << 22)
        got = sha256(out + ".part")
        if got != spec["sha256"]:
            os.remove(out + ".part")
            raise SystemExit(f"[unpack] joined {whole}: SHA-256 {got} != MANIFEST {spec['sha256']}")
        os.replace(out + ".part", out)
        with open(out + ".sha256", "w") as f:
            f.write(got)
        for p in spec["parts"]:
            os.remove(os.path.join(stash_dir, p))
            os.remove(os.path.join(stash_dir, p + ".sha256"))
        log(f"joined {whole} from {len(spec['parts'])} stashed parts; later calls (within the warm window) "
            "use it")
    return 0


def _full_available(folders: list[str], stash_dir: str) -> bool:
    try:
        locate(FULL_XZ, folders, stash_dir)
        return True
    except SystemExit:
        return False


def unpack(folders: list[str], target: str, so_choice: str, stash_dir: str) -> dict:
    t0 = time.time()
    found = {n: locate(n, folders, stash_dir) for n in ("vllm_py_slim.tar.xz", "deps_site.tar.xz",
                                                         "_vllm_fa3_C.abi3.so.xz")}
    vllm_version = None
    for folder in folders:
        vllm_version = vllm_version or load_manifest(folder).get("vllm")
    if so_choice == "auto":
        so_choice = "full" if _full_available(folders, stash_dir) else "sm90"
    so_src, so_digest = locate(FULL_XZ if so_choice == "full" else SM90_XZ, folders, stash_dir)
    so_digest = f"{so_choice}:{so_digest}"
    want = dict({n: d for n, (_, d) in found.items()}, so=so_digest, vllm=vllm_version)
    stamp_path = os.path.join(target, STAMP)
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            have = json.load(f)
        if {k: have.get(k) for k in want} == want and os.path.isfile(os.path.join(target, SO_REL)):
            write_plugin_dist_info(target)
            log(f"{target} is up to date (vLLM {vllm_version}, _C {so_choice})")
            return have
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.makedirs(target)
    untar(found["vllm_py_slim.tar.xz"][0], target)
    untar(found["deps_site.tar.xz"][0], target)
    unxz(so_src, os.path.join(target, SO_REL))
    unxz(found["_vllm_fa3_C.abi3.so.xz"][0], os.path.join(target, FA3_REL))
    dist = write_plugin_dist_info(target)
    info = dict(want, so_variant=so_choice, target=target, unpacked_s=round(time.time() - t0, 1),
                plugin_dist_info=os.path.basename(dist))
    with open(stamp_path, "w") as f:
        json.dump(info, f, indent=1)
    log(f"unpacked vLLM {vllm_version} into {target} in {info['unpacked_s']} s (_C library: {so_choice})")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload-root", default=os.path.join(ROOT, ".gpu_payload"),
                    help="the folder whose carried carry* subfolders are used")
    ap.add_argument("--stash-dir", default=os.environ.get("VLLM_PAYLOAD_STASH", "/tmp/vllm_payload_stash"))
    ap.add_argument("--target", default=os.environ.get("VLLM_SITE", "/tmp/vllm_site"))
    ap.add_argument("--so", choices=("auto", "full", "sm90"), default=os.environ.get("VLLM_SO", "auto"))
    ap.add_argument("--stash", action="store_true",
                    help="only keep the carried archives on the warm machine for the next call")
    args = ap.parse_args(argv)
    folders = payload_folders(args.payload_root)
    try:
        if args.stash:
            return stash(folders, args.stash_dir)
        unpack(folders, args.target, args.so, args.stash_dir)
        return 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
