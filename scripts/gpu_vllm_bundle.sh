#!/usr/bin/env bash
# Build, on a CPU machine with PyPI, everything a lent GPU machine (x86-64, Python 3.12, torch
# 2.11.0+cu130, Triton 3.6, transformers 5.17, no network, no vLLM) needs to run real vLLM 0.32.0
# with SPEEDSFI: scripts/gpu_e2e.sh unpacks it there. Idempotent (downloads and archives already
# made are kept; delete the folder to start over).
#
#   scripts/gpu_vllm_bundle.sh [PAYLOAD_DIR]      # default .gpu_payload (ignored by git)
#
# Output (only the carry folders travel; cache/ stays here). The device tool's 64 MiB per call counts
# the project's files too, so the payload is split into folders that can travel together or in turns:
#   PAYLOAD_DIR/carry/              the call that runs: the sm_90-pruned _C library + vLLM's Python tree
#       _C_stable_libtorch.abi3.sm90.so.xz   vllm/_C_stable_libtorch.abi3.so, non-sm_90 cubins zeroed
#       vllm_py_slim.tar.xz                  vLLM's Python tree + dist-info (no big binaries)
#   PAYLOAD_DIR/carry_deps/         carried with carry/ when both fit one call, else stashed by an
#                                   earlier call ('scripts/gpu_e2e.sh stash') on the warm machine
#       deps_site.tar.xz                     the missing Python dependencies, installed into one folder
#       _vllm_fa3_C.abi3.so.xz               FlashAttention-3 (vllm.vllm_flash_attn must import)
#   PAYLOAD_DIR/carry_so_full_<i>/  fallback only: part i of the whole (unpruned) _C library's archive,
#                                   each stashed by its own earlier call; joined once all are there
#   each folder's MANIFEST.json     sizes, SHA-256, versions (and how parts join)
#   PAYLOAD_DIR/cache/              downloads and scratch (never travels)
#
# Prints which folders fit one call with the working tree (git ls-files: tracked + untracked-not-
# ignored files); fails when a folder cannot travel at all (tree + folder > GPU_CARRY_LIMIT_MIB, 64).
# Needs: python3 with pip (any version: wheels are chosen for cp312), xz, unzip, readelf.
#
# Inputs other than PyPI's (tests/test_gpu_bundle.py packs a miniature vLLM this way, in seconds):
#   GPU_VLLM_WHEEL=FILE           this wheel instead of vLLM's from PyPI
#   GPU_VLLM_DEPS=FILE            this dependency list instead of scripts/gpu_vllm_deps.txt
#   GPU_BUNDLE_FIND_LINKS=DIR     the dependencies' wheels from DIR only (no index)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
P=$(realpath -m "${1:-${GPU_PAYLOAD:-$root/.gpu_payload}}")
C=${GPU_PAYLOAD_CACHE:-$P/cache}
ONE=$P/carry
DEPS_DIR=$P/carry_deps
FULL_PARTS=${GPU_FULL_SO_PARTS:-2}
LIMIT_MIB=${GPU_CARRY_LIMIT_MIB:-64}
PY=${PYTHON:-python3}
XZ_THREADS=${XZ_THREADS:-0}
VLLM_VERSION=0.32.0
WHEEL=vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
mkdir -p "$C/dl" "$C/whl" "$ONE" "$DEPS_DIR"
# a cache in the other layout (every archive in carry/, the whole _C in carry_so_full/): move, not rebuild
for f in deps_site.tar.xz _vllm_fa3_C.abi3.so.xz; do
  if [ -f "$ONE/$f" ]; then mv "$ONE/$f" "$DEPS_DIR/$f"; fi
done
if [ -f "$P/carry_so_full/_C_stable_libtorch.abi3.so.xz" ]; then
  mv "$P/carry_so_full/_C_stable_libtorch.abi3.so.xz" "$C/"
fi
rm -rf "$P/carry_so_full"
for tool in xz unzip readelf; do command -v $tool >/dev/null || { echo "[bundle] needs $tool" >&2; exit 1; }; done
t0=$SECONDS
say() { echo "[bundle $((SECONDS - t0))s] $*"; }

PIPDL=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
       --python-version 3.12 --implementation cp)
if [ -n "${GPU_BUNDLE_FIND_LINKS:-}" ]; then PIPDL+=(--no-index --find-links "$GPU_BUNDLE_FIND_LINKS"); fi
PLAT=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17; do PLAT+=(--platform "manylinux_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

# Compression: xz -9e (-9 for FlashAttention-3) by default; GPU_BUNDLE_XZ_LEVEL (e.g. -6) trades
# size for build time (tests/test_gpu_bundle.py uses -3 on a fresh CI build: every folder still fits).
# Each archive remembers its level (cache/levels/) and is rebuilt when another is asked for.
level_of() { echo "${GPU_BUNDLE_XZ_LEVEL:-$1}"; }
mkdir -p "$C/levels"
fresh() {  # archive, newer-than source, level: is the archive there, newer and at that level?
  [ -s "$1" ] && [ "$1" -nt "$2" ] && [ "$(cat "$C/levels/$(basename "$1")" 2>/dev/null)" = "$3" ]
}
# xz into $2 unless it exists, is newer than $1 and has the level (atomic: .part then mv)
xz_to() {
  local src=$1 dst=$2 level; level=$(level_of "${3:--9e}")
  if fresh "$dst" "$src" "$level"; then say "have $(basename "$dst")"; return; fi
  say "xz $level $(basename "$src") -> $(basename "$dst")"
  xz "$level" -T"$XZ_THREADS" -c "$src" > "$dst.part" && mv "$dst.part" "$dst"
  echo "$level" > "$C/levels/$(basename "$dst")"
}

# 1. the vLLM wheel, unpacked
if [ -n "${GPU_VLLM_WHEEL:-}" ]; then
  cmp -s "$GPU_VLLM_WHEEL" "$C/dl/$WHEEL" || cp "$GPU_VLLM_WHEEL" "$C/dl/$WHEEL"
elif ! unzip -tqq "$C/dl/$WHEEL" >/dev/null 2>&1; then
  say "download vllm==$VLLM_VERSION ($WHEEL, ~330 MB)"
  rm -f "$C/dl/$WHEEL"
  "${PIPDL[@]}" --platform manylinux_2_28_x86_64 -d "$C/dl" "vllm==$VLLM_VERSION"
fi
X=$C/x
if [ ! -f "$X/.unpacked" ] || [ "$C/dl/$WHEEL" -nt "$X/.unpacked" ]; then
  say "unpack the wheel"
  rm -rf "$X" && mkdir -p "$X"
  (cd "$X" && unzip -q "$C/dl/$WHEEL")
  touch "$X/.unpacked"
fi
SO=$X/vllm/_C_stable_libtorch.abi3.so
FA3=$X/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
[ -f "$SO" ] && [ -f "$FA3" ] || { echo "[bundle] $SO or $FA3 missing in the wheel" >&2; exit 1; }

# 2. the stable-ABI kernel library: sm_90-pruned (one call) and whole (fallback call)
if [ ! -s "$C/_C_stable_libtorch.abi3.sm90.so" ] || [ "$SO" -nt "$C/_C_stable_libtorch.abi3.sm90.so" ] \
   || [ "$root/scripts/fatbin_prune.py" -nt "$C/_C_stable_libtorch.abi3.sm90.so" ]; then
  say "prune non-sm_90 cubins"
  "$PY" "$root/scripts/fatbin_prune.py" "$SO" "$C/_C_stable_libtorch.abi3.sm90.so.part" --keep-sm 90
  mv "$C/_C_stable_libtorch.abi3.sm90.so.part" "$C/_C_stable_libtorch.abi3.sm90.so"
fi
xz_to "$C/_C_stable_libtorch.abi3.sm90.so" "$ONE/_C_stable_libtorch.abi3.sm90.so.xz"
xz_to "$SO" "$C/_C_stable_libtorch.abi3.so.xz"
xz_to "$FA3" "$DEPS_DIR/_vllm_fa3_C.abi3.so.xz" -9

# 3. the Python tree without big binaries, CUDA headers, MoE tuning tables
if ! fresh "$ONE/vllm_py_slim.tar.xz" "$X/.unpacked" "$(level_of -9e)"; then
  say "slim Python tree"
  S=$C/slim
  rm -rf "$S" && mkdir -p "$S"
  cp -a "$X/vllm" "$X/vllm-$VLLM_VERSION.dist-info" "$S/"
  (cd "$S"
   rm -rf vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 "vllm-$VLLM_VERSION.dist-info/RECORD"
   find vllm -name '*.so' ! -name cumem_allocator.abi3.so ! -name spinloop.abi3.so ! -name fs_io_C.abi3.so -delete
   find vllm \( -name '*.hpp' -o -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.inl' \) -delete
   find vllm -name __pycache__ -prune -exec rm -rf {} +
   rm -f vllm/model_executor/layers/fused_moe/configs/*.json
   tar cf - --sort=name --owner=0 --group=0 vllm "vllm-$VLLM_VERSION.dist-info" \
     | xz "$(level_of -9e)" -T"$XZ_THREADS" > "$ONE/vllm_py_slim.tar.xz.part")
  mv "$ONE/vllm_py_slim.tar.xz.part" "$ONE/vllm_py_slim.tar.xz"
  level_of -9e > "$C/levels/vllm_py_slim.tar.xz"
  rm -rf "$S"
fi

# 4. the Python dependencies the GPU image lacks (docs/gpu_vllm_e2e.md, found by
#    hiding packages), installed for cp312 into one folder
DEPS=${GPU_VLLM_DEPS:-$root/scripts/gpu_vllm_deps.txt}
if ! fresh "$DEPS_DIR/deps_site.tar.xz" "$DEPS" "$(level_of -9e)"; then
  say "dependencies ($(grep -c '==' "$DEPS") wheels for cp312)"
  "${PIPDL[@]}" "${PLAT[@]}" -d "$C/whl" -r "$DEPS"
  rm -rf "$C/site" && mkdir -p "$C/site"
  wheels=()
  while read -r req; do
    name=${req%%==*}; ver=${req##*==}
    norm=$(echo "$name" | tr 'A-Z-.' 'a-z__')
    w=$(ls "$C/whl" | awk -v n="$norm" -v v="$ver" 'BEGIN{IGNORECASE=1} {f=$0; split(f, a, "-"); g=a[1]; gsub(/[-.]/, "_", g); if (tolower(g)==n && a[2]==v) print f}' | head -n1)
    [ -n "$w" ] || { echo "[bundle] no wheel for $req in $C/whl" >&2; exit 1; }
    wheels+=("$C/whl/$w")
  done < <(grep -E '^[A-Za-z0-9]' "$DEPS" | sed 's/[[:space:]]*#.*//')
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
      --target "$C/site" "${wheels[@]}"
  rm -rf "$C/site/bin"
  (cd "$C/site" && tar cf - --sort=name --owner=0 --group=0 . | xz "$(level_of -9e)" -T"$XZ_THREADS" > "$DEPS_DIR/deps_site.tar.xz.part")
  mv "$DEPS_DIR/deps_site.tar.xz.part" "$DEPS_DIR/deps_site.tar.xz"
  level_of -9e > "$C/levels/deps_site.tar.xz"
fi

# 5. the whole _C archive in parts, and the manifests (scripts/gpu_vllm_unpack.py checks the SHA-256
#    of every file it unpacks and of a joined archive)
"$PY" - "$P" "$C/_C_stable_libtorch.abi3.so.xz" "$FULL_PARTS" "$VLLM_VERSION" "$DEPS" <<'EOF'
import glob, hashlib, json, os, shutil, sys, time
P, whole, nparts, ver, deps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()
base = {"vllm": ver, "python": "3.12", "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "deps": [l.split("#")[0].strip() for l in open(deps) if l.strip() and l[0].isalnum()]}
def manifest(d, role, **extra):
    files = {n: {"bytes": os.path.getsize(os.path.join(d, n)), "sha256": sha(os.path.join(d, n))}
             for n in sorted(os.listdir(d)) if n.endswith(".xz") or ".xz.part" in n}
    with open(os.path.join(d, "MANIFEST.json"), "w") as f:
        json.dump({**base, "role": role, "files": files, **extra}, f, indent=1)
manifest(os.path.join(P, "carry"), "main", so="sm90")
manifest(os.path.join(P, "carry_deps"), "deps")
name, size = os.path.basename(whole), os.path.getsize(whole)
step = -(-size // nparts)
parts = [f"{name}.part{i + 1}of{nparts}" for i in range(nparts)]
for old in glob.glob(os.path.join(P, "carry_so_full_*")):
    shutil.rmtree(old)
join = {name: {"bytes": size, "sha256": sha(whole), "parts": parts}}
with open(whole, "rb") as f:
    for i, part in enumerate(parts):
        d = os.path.join(P, f"carry_so_full_{i + 1}")
        os.makedirs(d)
        with open(os.path.join(d, part), "wb") as o:
            o.write(f.read(step))
        manifest(d, "so_full_part", so="full", joins=join)
EOF

# 6. sizes: the working tree + the folders a call carries must fit the device tool's limit
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
             | awk '{s+=$1} END {print s+0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
dir_bytes() { find "$@" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}'; }
limit=$((LIMIT_MIB * 1048576))
rel() { realpath --relative-to="$root" "$1"; }
echo
echo "[bundle] working tree that travels (git ls-files -co --exclude-standard): $(mib "$tree_bytes") MiB"
for f in "$P"/carry*/*; do printf '[bundle]   %-66s %7s MiB\n' "$(rel "$f")" "$(mib "$(stat -c %s "$f")")"; done
status=0
fits() { [ $(( tree_bytes + $(dir_bytes "$@") )) -le "$limit" ]; }
line() {  # verdict, label, folders...
  local v=$1 label=$2; shift 2
  local names="" d b
  for d in "$@"; do names+="${names:+, }\"$(rel "$d")\""; done
  b=$(dir_bytes "$@")
  echo "[bundle] $label: carry [$names] $(mib "$b") MiB + tree $(mib "$tree_bytes") MiB = $(mib $(( tree_bytes + b ))) MiB ($v)"
}
if fits "$ONE" "$DEPS_DIR"; then
  line ok "one call" "$ONE" "$DEPS_DIR"
else
  line "over the ${LIMIT_MIB} MiB limit: use two calls" "one call" "$ONE" "$DEPS_DIR"
fi
for d in "$DEPS_DIR" "$ONE" "$P"/carry_so_full_*; do
  case $d in
    "$DEPS_DIR") label="two calls, A ('scripts/gpu_e2e.sh stash')" ;;
    "$ONE") label="two calls, B (the run)" ;;
    *) label="fallback, whole _C: stash call for part ${d##*_}" ;;
  esac
  if fits "$d"; then line ok "$label" "$d"; else line "OVER THE ${LIMIT_MIB} MiB LIMIT" "$label" "$d"; status=1; fi
done
say "done"
exit $status
