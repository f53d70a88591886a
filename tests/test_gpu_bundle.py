"""The GPU end-to-end route on a CPU machine: the payload bundle (scripts/gpu_vllm_bundle.sh), its
unpacking (scripts/gpu_vllm_unpack.py), the fatbin pruning, and bench/vllm_e2e.py's plan and pure
helpers; the driver end to end through the CPU build of vLLM with tiny models.

The bundle's tests run twice: on a miniature vLLM wheel made here (the script end to end, offline,
in seconds: every run of the suite), and on vLLM 0.32.0's own bundle where one is built (the GPU
plan builds it: ``scripts/gpu_vllm_bundle.sh``, minutes, PyPI) in ``$SPEEDSFI_TEST_GPU_PAYLOAD`` or
the repository's ignored ``.gpu_payload/``. An existing build is checked at the level it was built
with (nothing rebuilt: seconds); ``SPEEDSFI_TEST_GPU_BUNDLE=1`` (or ``SPEEDSFI_TEST_GPU_PAYLOAD``
naming a folder without one) builds it in the test, at ``xz -3``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 1024 * 1024


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def e2e():
    return _load(ROOT / "bench" / "vllm_e2e.py", "speedsfi_vllm_e2e")


@pytest.fixture(scope="module")
def unpacker():
    return _load(ROOT / "scripts" / "gpu_vllm_unpack.py", "speedsfi_gpu_vllm_unpack")


@pytest.fixture(scope="module")
def prune():
    return _load(ROOT / "scripts" / "fatbin_prune.py", "speedsfi_fatbin_prune")


def _tree_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# the bundle: a miniature vLLM's (always) and vLLM 0.32.0's (where built)
# ---------------------------------------------------------------------------------------------

def _pypi_reachable() -> bool:
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=15).close()
        return True
    except Exception:
        return False


def _run_bundle_script(payload: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_vllm_bundle.sh"), str(payload)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3000, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _built_level(payload: Path) -> str | None:
    """The xz level every archive of a build has, if one (None: the script's own per-archive
    defaults, or a mix): asking for it rebuilds nothing."""
    levels = {p.read_text().strip() for p in (payload / "cache" / "levels").glob("*")}
    return levels.pop() if len(levels) == 1 else None


def _elf_with_section(name: bytes, data: bytes) -> bytes:
    """A minimal ELF64 (x86-64, shared object) whose one section ``name`` holds ``data``: what
    ``readelf -S`` (scripts/fatbin_prune.py) reads of a real library."""
    shstrtab = b"\0" + name + b"\0.shstrtab\0"
    data_off = 64
    str_off = data_off + len(data)
    sh_off = (str_off + len(shstrtab) + 7) // 8 * 8
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + bytes(9), 3, 62, 1, 0, 0, sh_off, 0,
                         64, 56, 0, 64, 3, 2)
    sections = bytes(64) + struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, data_off, len(data), 0, 0, 8, 0) + \
        struct.pack("<IIQQQQIIQQ", 2 + len(name), 3, 0, 0, str_off, len(shstrtab), 0, 0, 1, 0)
    body = header + data + shstrtab
    return body + bytes(sh_off - len(body)) + sections


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


# the miniature's fatbin: cubins for sm_80, sm_90 and sm_100, PTX for sm_80 and sm_90
MINI_FATBIN = [(2, 80, b"A" * 4096), (2, 90, b"B" * 4096), (1, 80, b"C" * 512), (2, 100, b"D" * 4096),
               (1, 90, b"E" * 512)]


def _mini_bundle(d: Path) -> tuple[Path, str]:
    """The bundle script end to end, offline, on a vLLM 0.32.0 wheel in miniature (the files the
    payload keeps, and some of each kind it drops) and a one-wheel dependency list."""
    dist = "vllm-0.32.0.dist-info"
    files = {
        "vllm/__init__.py": b"__version__ = '0.32.0'\n",
        "vllm/platforms/cuda.py": b"",
        "vllm/vllm_flash_attn/__init__.py": b"",
        "vllm/_C_stable_libtorch.abi3.so": _elf_with_section(b".nv_fatbin", b"\0" * 8 + _fatbin(MINI_FATBIN)),
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": _elf_with_section(b".text", b"fa3" * 1000),
        "vllm/cumem_allocator.abi3.so": b"kept",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"dropped",
        "vllm/third_party/deep_gemm/__init__.py": b"dropped",
        "vllm/csrc/kernel.cu": b"dropped",
        "vllm/include/kernel.h": b"dropped",
        "vllm/model_executor/layers/fused_moe/configs/E=8.json": b"{}",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp38-abi3-manylinux_2_28_x86_64\n",
        f"{dist}/RECORD": b"",
    }
    wheel = _wheel(d / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", files)
    links = d / "links"
    links.mkdir()
    dep = "speedsfi_mini_dep-1.0.dist-info"
    _wheel(links / "speedsfi_mini_dep-1.0-py3-none-any.whl", {
        "speedsfi_mini_dep/__init__.py": b"",
        f"{dep}/METADATA": b"Metadata-Version: 2.1\nName: speedsfi-mini-dep\nVersion: 1.0\n",
        f"{dep}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dep}/RECORD": b""})
    deps = d / "deps.txt"
    deps.write_text("# the miniature's missing dependency\nspeedsfi-mini-dep==1.0\n")
    env = dict(os.environ, GPU_VLLM_WHEEL=str(wheel), GPU_VLLM_DEPS=str(deps), GPU_BUNDLE_FIND_LINKS=str(links))
    payload = d / "payload"
    return payload, _run_bundle_script(payload, env)


def _vllm_bundle() -> tuple[Path, str]:
    explicit = os.environ.get("SPEEDSFI_TEST_GPU_PAYLOAD")
    payload = Path(explicit or ROOT / ".gpu_payload")
    built = (payload / "carry" / "MANIFEST.json").is_file()
    if not built and not explicit and os.environ.get("SPEEDSFI_TEST_GPU_BUNDLE") != "1":
        pytest.skip("vLLM 0.32.0's GPU payload is not built here (the GPU plan builds it: "
                    "scripts/gpu_vllm_bundle.sh, minutes, PyPI; SPEEDSFI_TEST_GPU_BUNDLE=1 builds it in "
                    "this test); the miniature's bundle is checked")
    # the project's machines and CI reach PyPI (setup_env.sh needs it too): an unreachable index is
    # a failure to report, not a reason to skip a build that was asked for
    assert built or _pypi_reachable(), \
        "no built payload and PyPI is unreachable: scripts/gpu_vllm_bundle.sh needs PyPI"
    env = dict(os.environ)
    # an existing build at the level it has (the script rebuilds an archive of another level); a
    # fresh one at xz -3 instead of -9e (2-core VM: the archives in 44 s, against about 3.5 min at
    # -6): larger (the largest call 58 of 64 MiB when measured), so they fit the transfer limit a
    # fortiori at the default level
    level = _built_level(payload) if built else "-3"
    if level:
        env.setdefault("GPU_BUNDLE_XZ_LEVEL", level)
    return payload, _run_bundle_script(payload, env)


@pytest.fixture(scope="module", params=["miniature", "vllm-0.32.0"])
def bundle(request, tmp_path_factory):
    """(payload folder, the script's output, which wheel)."""
    if request.param == "miniature":
        return (*_mini_bundle(tmp_path_factory.mktemp("mini_bundle")), request.param)
    return (*_vllm_bundle(), request.param)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_bundle_builds_and_each_call_fits_the_transfer_limit(bundle):
    payload, stdout, _ = bundle
    one, deps = payload / "carry", payload / "carry_deps"
    parts = sorted(payload.glob("carry_so_full_*"))
    assert {p.name for p in one.iterdir()} == {"_C_stable_libtorch.abi3.sm90.so.xz", "vllm_py_slim.tar.xz",
                                               "MANIFEST.json"}
    assert {p.name for p in deps.iterdir()} == {"_vllm_fa3_C.abi3.so.xz", "deps_site.tar.xz", "MANIFEST.json"}
    assert len(parts) >= 2
    tree = _tree_bytes()
    # every folder travels in some call: alone (stash calls, the run) within the limit
    for d in (one, deps, *parts):
        assert tree + _dir_bytes(d) <= LIMIT, f"{d.name}: project files + folder over 64 MiB"
    assert "two calls, B (the run)" in stdout and "OVER THE" not in stdout
    one_call = tree + _dir_bytes(one) + _dir_bytes(deps) <= LIMIT
    assert ("one call: " in stdout) and (("(ok)" in stdout.split("one call: ")[1].splitlines()[0]) == one_call)
    # the parts join to the whole library's archive
    join = json.loads((parts[0] / "MANIFEST.json").read_text())["joins"]["_C_stable_libtorch.abi3.so.xz"]
    whole = b"".join((payload / f"carry_so_full_{i + 1}" / n).read_bytes() for i, n in enumerate(join["parts"]))
    assert hashlib.sha256(whole).hexdigest() == join["sha256"] and len(whole) == join["bytes"]
    assert lzma.LZMADecompressor().decompress(whole[:1 << 16])[:4] == b"\x7fELF"
    man = json.loads((one / "MANIFEST.json").read_text())
    assert man["vllm"] == "0.32.0"
    for name, meta in man["files"].items():
        assert hashlib.sha256((one / name).read_bytes()).hexdigest() == meta["sha256"], name
    # the carried folders are ignored by git (they travel only through the device tool's carry)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(one)], cwd=ROOT)
    if payload.resolve().is_relative_to(ROOT):
        assert ignored.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_pruned_library_keeps_every_sm90_cubin_and_all_ptx(bundle, prune):
    payload, _, _ = bundle
    cache = payload / "cache"
    src = cache / "x" / "vllm" / "_C_stable_libtorch.abi3.so"
    dst = cache / "_C_stable_libtorch.abi3.sm90.so"
    if not (src.is_file() and dst.is_file()):
        pytest.skip("bundle cache not here (SPEEDSFI_TEST_GPU_PAYLOAD without its cache)")
    a, b = src.read_bytes(), dst.read_bytes()
    assert len(a) == len(b)
    off, size = prune.fatbin_section(str(src))

    def entries(data):
        out, o = [], off
        while o + 16 <= off + size:
            magic, _v, hsz, fsz = struct.unpack_from("<IHHQ", data, o)
            if magic != prune.FATBIN_MAGIC:
                o += 8
                continue
            p, end = o + hsz, o + hsz + fsz
            while p < end:
                kind, _e, ehsz = struct.unpack_from("<HHI", data, p)
                n = struct.unpack_from("<Q", data, p + 8)[0]
                sm = struct.unpack_from("<I", data, p + 28)[0]
                out.append((kind, sm, data[p + ehsz:p + ehsz + n]))
                p += ehsz + n
            o = end
        return out

    ea, eb = entries(a), entries(b)
    assert len(ea) == len(eb) and any(k == 2 and sm == 90 for k, sm, _ in ea)
    for (k, sm, pa), (_, _, pb) in zip(ea, eb):
        if k == 1 or sm == 90:
            assert pa == pb                       # PTX and sm_90 cubins untouched
        else:
            assert not any(pb)                    # other cubins zeroed


# what each wheel's payload holds besides vLLM's own files (its carried dependencies), and what the
# slimming drops
CARRIED = {"miniature": ("speedsfi_mini_dep/__init__.py", "vllm/cumem_allocator.abi3.so"),
           "vllm-0.32.0": ("pydantic/__init__.py", "zmq", "msgspec", "openai")}
DROPPED = {"miniature": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm",
                         "vllm/include/kernel.h", "vllm/model_executor/layers/fused_moe/configs/E=8.json"),
           "vllm-0.32.0": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm")}


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_built_payload_unpacks_to_vllms_layout(bundle, unpacker, tmp_path):
    payload, _, wheel = bundle
    target = tmp_path / "site"
    info = unpacker.unpack(unpacker.payload_folders(str(payload)), str(target), "sm90",
                           str(tmp_path / "no_stash"))
    assert info["so_variant"] == "sm90"
    for rel in ("vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                "vllm/platforms/cuda.py", "vllm-0.32.0.dist-info/METADATA", *CARRIED[wheel]):
        assert (target / rel).exists(), rel
    for rel in DROPPED[wheel]:
        assert not (target / rel).exists(), rel
    assert not list(target.glob("vllm/**/*.cu")), "CUDA sources are slimmed away"
    pruned = payload / "cache" / "_C_stable_libtorch.abi3.sm90.so"
    if pruned.is_file():
        assert (target / "vllm/_C_stable_libtorch.abi3.so").read_bytes() == pruned.read_bytes()
    ep = (target / "vllm_speedsfi-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in ep and "speedsfi = vllm_ext:register" in ep


# ---------------------------------------------------------------------------------------------
# scripts: syntax, pruning and unpacking on synthetic inputs (fast)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["gpu_vllm_bundle.sh", "gpu_e2e.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)


def test_payload_folder_is_ignored_by_git():
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu_payload/carry/x.xz"], cwd=ROOT).returncode == 0


def _fatbin(entries):
    """A fatbin container: header (magic, version, header size 16, payload size) + 64-byte entries."""
    body = b""
    for kind, sm, payload in entries:
        hdr = bytearray(64)
        struct.pack_into("<HHIQ", hdr, 0, kind, 0x0101, 64, len(payload))
        struct.pack_into("<I", hdr, 28, sm)
        body += bytes(hdr) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_prune_zeroes_other_cubins_keeps_sm90_and_ptx(prune):
    blob = bytearray(b"\0" * 8 + _fatbin([(2, 80, b"A" * 32), (2, 90, b"B" * 32), (1, 80, b"C" * 16),
                                           (2, 100, b"D" * 48), (1, 90, b"E" * 16)]))
    before = bytes(blob)
    stats = prune.prune(blob, 0, len(blob), 90)
    assert stats["kept_cubins"] == 1 and stats["zeroed_bytes"] == 80
    assert len(blob) == len(before)
    assert b"B" * 32 in blob and b"C" * 16 in blob and b"E" * 16 in blob
    assert b"A" not in blob and b"D" not in blob
    # --stats counts without changing anything
    blob2 = bytearray(before)
    s = prune.prune(blob2, 0, len(blob2), None)
    assert bytes(blob2) == before and s["cubin_sm90"] == 1 and s["ptx_sm80"] == 1


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=0)


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _manifest(folder: Path, **extra) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in folder.iterdir() if p.name != "MANIFEST.json"}
    (folder / "MANIFEST.json").write_text(json.dumps({"vllm": "0.32.0", "files": files, **extra}))


def _fake_payload(d: Path, so_tag: bytes = b"sm90-so") -> Path:
    """The bundle's layout: carry/, carry_deps/ and the whole library's archive in two parts."""
    one, deps = d / "carry", d / "carry_deps"
    one.mkdir(parents=True)
    deps.mkdir()
    (one / "vllm_py_slim.tar.xz").write_bytes(_tar_xz({"vllm/__init__.py": b"__version__ = '0.32.0'\n",
                                                       "vllm/vllm_flash_attn/__init__.py": b"",
                                                       "vllm-0.32.0.dist-info/METADATA": b"Name: vllm\n"}))
    (one / "_C_stable_libtorch.abi3.sm90.so.xz").write_bytes(_xz(so_tag))
    _manifest(one, so="sm90")
    (deps / "deps_site.tar.xz").write_bytes(_tar_xz({"pydantic/__init__.py": b""}))
    (deps / "_vllm_fa3_C.abi3.so.xz").write_bytes(_xz(b"fa3"))
    _manifest(deps)
    whole = _xz(b"whole-so" * 50)
    name = "_C_stable_libtorch.abi3.so.xz"
    parts = [f"{name}.part1of2", f"{name}.part2of2"]
    join = {name: {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest(), "parts": parts}}
    for i, chunk in enumerate((whole[:len(whole) // 2], whole[len(whole) // 2:])):
        part_dir = d / f"carry_so_full_{i + 1}"
        part_dir.mkdir()
        (part_dir / parts[i]).write_bytes(chunk)
        _manifest(part_dir, so="full", joins=join)
    return d


def _carried(d: Path, *names: str) -> list[str]:
    """The folders a device call carries (the others are absent there)."""
    return [str(d / n) for n in names]


def test_unpack_layout_stamp_and_plugin_entry_point(unpacker, tmp_path, capsys):
    d = _fake_payload(tmp_path / "p")
    target = tmp_path / "site"
    carried = _carried(d, "carry", "carry_deps")
    info = unpacker.unpack(carried, str(target), "auto", str(tmp_path / "stash"))
    assert info["so_variant"] == "sm90"
    assert (target / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == b"sm90-so"
    assert (target / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").read_bytes() == b"fa3"
    assert (target / "pydantic" / "__init__.py").is_file()
    dist = next(target.glob("vllm_speedsfi-*.dist-info"))
    assert "speedsfi = vllm_ext:register" in (dist / "entry_points.txt").read_text()
    # the entry point is what vLLM's plugin loader sees with the target on sys.path
    import importlib.metadata as md
    dists = {x.metadata["Name"] for x in md.distributions(path=[str(target)])}
    assert {"vllm-speedsfi", "vllm"} <= dists
    eps = [e for x in md.distributions(path=[str(target)]) for e in x.entry_points
           if e.group == "vllm.general_plugins"]
    assert [(e.name, e.value) for e in eps] == [("speedsfi", "vllm_ext:register")]
    # a second run is a no-op
    capsys.readouterr()
    unpacker.unpack(carried, str(target), "auto", str(tmp_path / "stash"))
    assert "up to date" in capsys.readouterr().out


def test_payload_folders_lists_the_carried_ones(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    (d / "cache").mkdir()
    assert [Path(f).name for f in unpacker.payload_folders(str(d))] == [
        "carry", "carry_deps", "carry_so_full_1", "carry_so_full_2"]
    assert unpacker.payload_folders(str(tmp_path / "absent")) == []


def test_unpack_refuses_a_corrupt_archive(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    (d / "carry_deps" / "deps_site.tar.xz").write_bytes(_tar_xz({"other/x.py": b""}))
    with pytest.raises(SystemExit, match="SHA-256"):
        unpacker.unpack(_carried(d, "carry", "carry_deps"), str(tmp_path / "site"), "auto",
                        str(tmp_path / "stash"))


def test_unpack_names_what_is_neither_carried_nor_stashed(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    with pytest.raises(SystemExit, match="deps_site.tar.xz is neither carried"):
        unpacker.unpack(_carried(d, "carry"), str(tmp_path / "site"), "auto", str(tmp_path / "stash"))


def test_two_calls_stash_the_dependencies_then_run(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    stash = tmp_path / "stash"
    assert unpacker.stash(_carried(d, "carry_deps"), str(stash)) == 0
    info = unpacker.unpack(_carried(d, "carry"), str(tmp_path / "site"), "auto", str(stash))
    assert info["so_variant"] == "sm90"
    assert (tmp_path / "site" / "pydantic" / "__init__.py").is_file()
    assert (tmp_path / "site" / "vllm" / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").read_bytes() == b"fa3"


def test_stash_refuses_a_corrupt_archive(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    (d / "carry_deps" / "_vllm_fa3_C.abi3.so.xz").write_bytes(_xz(b"other"))
    with pytest.raises(SystemExit, match="SHA-256"):
        unpacker.stash(_carried(d, "carry_deps"), str(tmp_path / "stash"))
    assert not (tmp_path / "stash" / "_vllm_fa3_C.abi3.so.xz").exists()


def test_stashed_parts_join_to_the_whole_library(unpacker, tmp_path, capsys):
    d = _fake_payload(tmp_path / "p")
    stash = tmp_path / "stash"
    carried = _carried(d, "carry", "carry_deps")
    unpacker.stash(_carried(d, "carry_so_full_1"), str(stash))
    assert "1 of 2 parts stashed" in capsys.readouterr().out
    # one part alone is not the library: auto keeps the pruned one
    info = unpacker.unpack(carried, str(tmp_path / "site"), "auto", str(stash))
    assert info["so_variant"] == "sm90"
    unpacker.stash(_carried(d, "carry_so_full_2"), str(stash))
    assert "joined _C_stable_libtorch.abi3.so.xz from 2 stashed parts" in capsys.readouterr().out
    assert not list(stash.glob("*.part?of2"))
    info = unpacker.unpack(carried, str(tmp_path / "site"), "auto", str(stash))
    assert info["so_variant"] == "full"
    assert (tmp_path / "site" / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == b"whole-so" * 50
    # forcing the pruned one replaces it
    unpacker.unpack(carried, str(tmp_path / "site"), "sm90", str(stash))
    assert (tmp_path / "site" / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == b"sm90-so"


def test_parts_that_do_not_join_are_refused(unpacker, tmp_path):
    d = _fake_payload(tmp_path / "p")
    part = next((d / "carry_so_full_2").glob("*.part2of2"))
    part.write_bytes(part.read_bytes()[::-1])
    man = json.loads((d / "carry_so_full_2" / "MANIFEST.json").read_text())
    _manifest(d / "carry_so_full_2", so="full", joins=man["joins"])     # the part itself checks out
    stash = tmp_path / "stash"
    unpacker.stash(_carried(d, "carry_so_full_1"), str(stash))
    with pytest.raises(SystemExit, match="joined _C_stable_libtorch.abi3.so.xz: SHA-256"):
        unpacker.stash(_carried(d, "carry_so_full_2"), str(stash))
    assert not (stash / "_C_stable_libtorch.abi3.so.xz").exists()


# ---------------------------------------------------------------------------------------------
# bench/vllm_e2e.py: plan without vLLM, pure helpers
# ---------------------------------------------------------------------------------------------

def _driver(*args, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_e2e.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_and_dry_run_need_neither_vllm_nor_a_gpu():
    assert _driver("--help").returncode == 0
    p = _driver("all", "--dry-run")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "heavy modules imported by the plan: none" in out
    for name in ("c_ops", "graphs/tiny-llama/speedsfi_sfi_small/graph", "kernels/qwen3-4b/paged_decode_vs_delegate",
                 "correct/llama-3.1-8b/speedsfi_sfi_full/eager", "correct/qwen3-4b/speedsfi_dense_pd/eager",
                 "quality/retrieval-llama", "perf/qwen3-4b/triton/graph", "perf/qwen3-4b/vllm_default/graph",
                 "sfi_perf/qwen3-4b/speedsfi_sfi/graph", "critiprefill/qwen3-4b/speedsfi_critiprefill/graph",
                 "serving/qwen3-4b/speedsfi_sfi"):
        assert name in out, name
    for n in (8192, 32768, 65536, 131072):
        assert f"in {n} x" in out
    assert "max_model_len 131344" in out


def test_default_perf_plan_measures_sfi_before_its_baselines_under_cuda_graphs(e2e):
    args, _ = e2e.parse(["sfi_perf,perf", "--deadline-s", "520"])
    jobs = e2e.build_plan(args)
    engines = [j for j in jobs if j["kind"] == "engine"]
    assert [j["config"] for j in engines] == ["speedsfi_sfi", "speedsfi_sfi_speed", "vllm_default", "triton",
                                              "speedsfi_dense"]
    assert not any(j["eager"] for j in engines)
    graph = engines[0]
    assert [g["input_len"] for g in graph["groups"]] == [8192, 32768, 65536, 131072]
    assert graph["max_model_len"] >= 131072 + 256
    assert all(g["output_len"] >= 256 for j in engines for g in j["groups"])


def test_unknown_stage_or_model_is_refused(e2e):
    with pytest.raises(SystemExit):
        e2e.parse(["perff"])
    with pytest.raises(SystemExit):
        e2e.parse(["perf", "--perf-models", "gpt-5"])


def test_tokenizer_trigger_rate_is_one_in_24(e2e, tmp_path):
    from vllm_ext.methods.sfi.triggers import trigger_token_ids

    vocab = 4803
    tok = e2e.build_tokenizer(tmp_path, vocab)
    assert len(tok) == vocab
    ids = trigger_token_ids(tok, (".", "?", "!", ";", "\n"))
    assert set(ids) == e2e.trigger_ids(vocab)
    rate = len(ids) / (vocab - e2e.N_SPECIAL)
    assert abs(rate - 1 / 24) < 1e-3
    assert not set(ids) & {0, 1, 2}
    # ids round-trip through the saved tokenizer (the engine reloads it from the folder)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.decode([5, 6]) == tok.decode([5, 6])
    assert again.convert_tokens_to_ids(e2e.token_strings(vocab)[100]) == 100


def test_model_folder_config_is_the_requested_shape(e2e, tmp_path):
    d = e2e.make_model_dir(tmp_path, "cpu-tiny-qwen3", max_position=4096)
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 1024 and cfg["head_dim"] == 32
    # reused when made with the same inputs
    stamp = (Path(d) / ".vllm_e2e_stamp").stat().st_mtime_ns
    assert e2e.make_model_dir(tmp_path, "cpu-tiny-qwen3", max_position=4096) == d
    assert (Path(d) / ".vllm_e2e_stamp").stat().st_mtime_ns == stamp


def test_big_shapes(e2e):
    assert abs(e2e.param_count("llama-3.1-8b") / 1e9 - 8.03) < 0.02
    assert abs(e2e.param_count("qwen3-4b") / 1e9 - 4.02) < 0.02
    assert e2e.kv_bytes_per_token("qwen3-4b") == 36 * 8 * 128 * 2 * 2 == 147456
    assert e2e.kv_bytes_per_token("llama-3.1-8b") == 131072


def test_kv_bandwidth_arithmetic(e2e):
    r = e2e.kv_gbps("qwen3-4b", batch=2, input_len=131072, output_len=256, tpot_ms=10.0, read_fraction=0.25)
    nbytes = 2 * (131072 + 128) * 147456
    assert r["kv_bytes_per_step"] == nbytes
    assert r["kv_gbps"] == pytest.approx(nbytes / 0.010 / 1e9)
    assert r["kv_gbps_read"] == pytest.approx(0.25 * nbytes / 0.010 / 1e9)
    assert e2e.kv_gbps("qwen3-4b", 1, 8192, 256, None)["kv_gbps"] is None


def test_decode_timing_uses_pure_decode_steps(e2e):
    # 3 requests: steps 0-2 give first tokens (prefill), then 40 steps of 10 ms with all 3 decoding,
    # one 50 ms slow step among them, then the requests finish one by one
    t, c, now = [], [], 0.0
    for i in range(3):
        now += 0.1
        t.append(now)
        c.append(i)                        # i requests already had a token
    for k in range(40):
        now += 0.050 if k == 20 else 0.010
        t.append(now)
        c.append(3)
    for left in (2, 1):
        now += 0.010
        t.append(now)
        c.append(left)
    r = e2e.decode_timing(t, c, batch=3, skip=8)
    assert r["decode_steps"] == 32
    assert r["tpot_ms"] == pytest.approx((31 * 10 + 40) / 31, rel=1e-6)   # the slow step counts
    assert r["tpot_ms_median"] == pytest.approx(10.0)
    assert r["max_step_ms"] == pytest.approx(50.0) and r["steps_over_5x_median"] == 0
    assert e2e.decode_timing([1.0], [1], batch=1)["tpot_ms"] is None


def test_sfi_summary_read_fraction(e2e):
    # batch 1, input 1000, 5 output tokens -> 4 decode steps over contexts 1001..1004
    c = {"sfi.fast_steps": 3, "sfi.slow_steps": 1, "sfi.fast_context_tokens": 3006,
         "sfi.fast_retained_tokens": 300, "fallback.sfi_capacity": 2}
    s = e2e.sfi_summary(c, batch=1, input_len=1000, n_out=5)
    total = 1001 + 1002 + 1003 + 1004
    assert s["kv_read_fraction"] == pytest.approx((total - 3006 + 300) / total)
    assert s["sfi_fast_retained_fraction"] == pytest.approx(0.1, rel=1e-2)
    assert s["fallbacks"] == {"fallback.sfi_capacity": 2}
    assert e2e.sfi_summary({}, 2, 10, 3)["kv_read_fraction"] == 1.0


def test_compare_tokens_and_error_classification(e2e):
    same = e2e.compare_tokens([[1, 2, 3], [4]], [[1, 2, 3], [4]])
    assert same["identical"] and same["rows"][0]["first_diff"] is None
    diff = e2e.compare_tokens([[1, 2, 3]], [[1, 9, 3]])
    assert not diff["identical"] and diff["rows"][0]["first_diff"] == 1
    tb = ('Traceback (most recent call last):\n  File "x.py", line 3, in forward\n    ops.rms_norm(out, x)\n'
          "RuntimeError: CUDA error: no kernel image is available for execution on the device\n")
    assert e2e.looks_like_c_op_failure(tb)
    other = ('Traceback (most recent call last):\n  File "layernorm.py", line 3, in forward\n'
             '    ops.rms_norm(out, x)\nValueError: speedsfi.sfi.k must be > 0\n')
    assert not e2e.looks_like_c_op_failure(other)
    assert e2e.short_error(other) == "ValueError: speedsfi.sfi.k must be > 0"


def _fake_result(e2e):
    rows = []
    for cfg, base in (("triton", 20.0), ("speedsfi_sfi", 5.0)):
        for mode in ("graph", "eager"):
            for n in (8192, 131072):
                tp = base * (n / 8192) ** 0.5 * (1.5 if mode == "eager" else 1.0)
                kv = e2e.kv_gbps("qwen3-4b", 1, n, 256, tp, 0.1 if "sfi" in cfg else 1.0)
                rows.append(e2e.make_perf_row(backend="SPEEDSFI" if "sfi" in cfg else "TRITON_ATTN", config=cfg,
                                              model="qwen3-4b", mode=mode, cuda_graphs=mode == "graph", input_len=n,
                                              output_len=256, batch=1, tpot_ms=tp, ttft_ms=100.0, output_tok_s=50.0,
                                              max_concurrency=3, **{k: v for k, v in kv.items()
                                                                    if k != "kv_read_fraction"}))
    rows.append(e2e.make_perf_row(config="speedsfi_dense", model="qwen3-4b", mode="graph", input_len=8192,
                                  output_len=256, batch=16, error="not measured: killed at the timeout"))
    return {"schema": 1, "env": {"gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.32.0", "torch": "2.11.0+cu130",
                                 "copy_gbps_rw": 3000.0}, "rows": rows, "checks": [], "correctness": [],
            "failures": [], "workarounds": [], "skipped": [], "plan": [], "stages": {}, "command": "x"}


def test_rows_schema_plot_and_report_merge(e2e, tmp_path):
    res = _fake_result(e2e)
    for r in res["rows"]:
        for k in e2e.PERF_ROW_KEYS + ("max_concurrency", "kv_gbps", "error"):
            assert k in r
    json.dumps(res)
    assert e2e.plot_perf(res, tmp_path / "p.png").stat().st_size > 10_000
    part2 = json.loads(json.dumps(res))
    part2["env"] = {"gpu": None, "vllm": "0.32.0", "extra": 1}
    part2["checks"] = [{"stage": "correct", "name": "x", "ok": True}]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(res))
    b.write_text(json.dumps(part2))
    p = _driver("report", "--merge", str(a), str(b), "--out", str(tmp_path / "merged"))
    assert p.returncode == 0, p.stderr
    merged = json.loads((tmp_path / "merged" / "vllm_e2e.json").read_text())
    # the same configurations twice: one row each (the later measured one), the checks of both
    assert len(merged["rows"]) == len(res["rows"]) and merged["checks"]
    assert merged["env"]["gpu"] == "NVIDIA H100 80GB HBM3" and merged["env"]["extra"] == 1
    assert (tmp_path / "merged" / "vllm_e2e.png").is_file()
    assert "| qwen3-4b | speedsfi_sfi | graph | 131072 | 1 |" in p.stdout


# ---------------------------------------------------------------------------------------------
# the driver end to end on the CPU build (same worker code path as on the GPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_driver_end_to_end_on_the_cpu_build(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    # the correct stage with the config families of the session's calls (a reference, all off, the SFI
    # preset); the paged_decode pair is the GPU's (on the CPU build dense rows run CPU_ATTN either way)
    p = _driver("smoke,graphs,sfi_perf,correct,perf", "--cpu", "--out", str(out), "--models-dir",
                str(tmp_path / "models"), "--correct-models", "cpu-tiny-llama",
                "--correct-configs", "triton,speedsfi_dense,speedsfi_sfi", "--perf-configs", "speedsfi_dense",
                "--sfi-perf-configs", "speedsfi_sfi", "--lengths", "96", "--batches", "96:2", "--deadline-s", "840",
                "--profile", "1", "--profile-steps", "4", timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads((out / "vllm_e2e.json").read_text())
    assert set(os.listdir(out)) <= {"vllm_e2e.json", "vllm_e2e.png", "vllm_e2e_logs.tar.gz"}
    assert res["env"]["vllm"] == "0.32.0" and res["env"]["gpu"]
    checks = {c["name"]: c["ok"] for c in res["checks"]}
    assert checks["cpu-tiny-llama: SPEEDSFI all off == TRITON_ATTN"] is True
    assert checks["cpu-tiny-llama: speedsfi_sfi runs fast and slow steps"] is True
    assert checks["cpu-tiny-llama: fast and slow steps under CUDA graphs"] is True
    # the CPU build runs the graphs job once (eager): graph == eager is checked on the GPU only
    assert "cpu-tiny-llama: SFI tokens under CUDA graphs == eager" not in checks
    assert checks["cpu-tiny-llama (graph): every row computed once (rows per path == rows of the layer calls)"] is True
    assert not res["failures"] and not res["skipped"]
    rows = res["rows"]
    assert {(r["config"], r["mode"]) for r in rows} == {("speedsfi_dense", "eager"), ("speedsfi_sfi", "eager")}
    for r in rows:
        assert r["error"] is None and r["batch"] == 2 and r["tpot_ms"] > 0 and r["ttft_ms"] > 0
        assert r["output_tok_s"] > 0 and r["kv_gbps"] > 0 and r["max_concurrency"] >= 2
        assert r["tpot_ms_vllm"] and r["decode_steps_measured"] >= 10
        assert r["prefill_tok_s"] == pytest.approx(r["batch"] * r["input_len"] / (r["ttft_ms_last"] / 1e3))
    # the kernel tables' path (vLLM's torch profiler, the trace parsed; the CPU trace has no GPU kernels)
    tables = res["kernel_tables"]
    assert {(t["config"], t["profiled_steps"], t["batch"]) for t in tables} == {
        ("speedsfi_dense", 4, 2), ("speedsfi_sfi", 4, 2)}
    sfi = next(r for r in rows if r["config"] == "speedsfi_sfi")
    assert sfi["sfi_fast_steps"] > 0 and sfi["kv_read_fraction"] < 1.0
    with tarfile.open(out / "vllm_e2e_logs.tar.gz") as tf:
        assert any(n.endswith(".log") for n in tf.getnames())


@pytest.mark.slow
@pytest.mark.e2e
def test_import_check_catches_what_the_h100_caught():
    """scripts/gpu_vllm_import_check.py hides what the GPU image lacks and runs SPEEDSFI offline on
    the CPU build: with the carried dependencies nothing is missing; without compressed-tensors it
    fails the way the H100 did (model loading imports it)."""
    script = [sys.executable, str(ROOT / "scripts" / "gpu_vllm_import_check.py")]
    ok = subprocess.run(script, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    bad = subprocess.run(script + ["--drop", "compressed-tensors"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert bad.returncode == 1 and "No module named 'compressed_tensors'" in bad.stdout
