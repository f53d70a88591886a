#!/usr/bin/env bash
# Build, on a CPU machine with PyPI, everything a lent GPU machine (x86-64, Python 3.12, torch
# 2.11.0+cu130, Triton 3.6, transformers 5.17, no network, no vLLM) needs to run real vLLM 0.32.0
# with SPEEDSFI: scripts/gpu_e2e.sh unpacks it there. Idempotent (downloads and archives already
# made are kept; delete the folder to start over).
#
#   scripts/gpu_vllm_bundle.sh [PAYLOAD_DIR]      # default .gpu_payload (ignored by git)
#
# Output (only the carry folders travel; cache/ stays here):
#   PAYLOAD_DIR/carry/           ONE device call: everything, with the sm_90-pruned _C library
#       _C_stable_libtorch.abi3.sm90.so.xz   vllm/_C_stable_libtorch.abi3.so, non-sm_90 cubins zeroed
#       _vllm_fa3_C.abi3.so.xz               FlashAttention-3 (vllm.vllm_flash_attn must import)
#       vllm_py_slim.tar.xz                  vLLM's Python tree + dist-info (no big binaries)
#       deps_site.tar.xz                     the missing Python dependencies, installed into one folder
#       MANIFEST.json                        sizes, SHA-256, versions
#   PAYLOAD_DIR/carry_so_full/   fallback, a SEPARATE earlier call: the unpruned _C library
#       _C_stable_libtorch.abi3.so.xz  (scripts/gpu_e2e.sh stash keeps it on the warm machine)
#   PAYLOAD_DIR/cache/           downloads and scratch (never travels)
#
# Fails when the working tree that travels (git ls-files: tracked + untracked-not-ignored files)
# plus one call's carry folder exceeds the device tool's 64 MiB (GPU_CARRY_LIMIT_MIB).
# Needs: python3 with pip (any version: wheels are chosen for cp312), xz, unzip, readelf.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
P=$(realpath -m "${1:-${GPU_PAYLOAD:-$root/.gpu_payload}}")
C=${GPU_PAYLOAD_CACHE:-$P/cache}
ONE=$P/carry
FULL=$P/carry_so_full
LIMIT_MIB=${GPU_CARRY_LIMIT_MIB:-64}
PY=${PYTHON:-python3}
XZ_THREADS=${XZ_THREADS:-0}
VLLM_VERSION=0.32.0
WHEEL=vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
mkdir -p "$C/dl" "$C/whl" "$ONE" "$FULL"
for tool in xz unzip readelf; do command -v $tool >/dev/null || { echo "[bundle] needs $tool" >&2; exit 1; }; done
t0=$SECONDS
say() { echo "[bundle $((SECONDS - t0))s] $*"; }

PIPDL=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
       --python-version 3.12 --implementation cp)
PLAT=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17; do PLAT+=(--platform "manylinux_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

# xz into $2 unless it exists and is newer than $1 (atomic: .part then mv)
xz_to() {
  local src=$1 dst=$2 level=${3:--9e}
  if [ -s "$dst" ] && [ "$dst" -nt "$src" ]; then say "have $(basename "$dst")"; return; fi
  say "xz $level $(basename "$src") -> $(basename "$dst")"
  xz "$level" -T"$XZ_THREADS" -c "$src" > "$dst.part" && mv "$dst.part" "$dst"
}

# 1. the vLLM wheel, unpacked
if ! unzip -tqq "$C/dl/$WHEEL" >/dev/null 2>&1; then
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
xz_to "$SO" "$FULL/_C_stable_libtorch.abi3.so.xz"
xz_to "$FA3" "$ONE/_vllm_fa3_C.abi3.so.xz" -9

# 3. the Python tree without big binaries, CUDA headers, MoE tuning tables
if [ ! -s "$ONE/vllm_py_slim.tar.xz" ] || [ "$X/.unpacked" -nt "$ONE/vllm_py_slim.tar.xz" ]; then
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
     | xz -9e -T"$XZ_THREADS" > "$ONE/vllm_py_slim.tar.xz.part")
  mv "$ONE/vllm_py_slim.tar.xz.part" "$ONE/vllm_py_slim.tar.xz"
  rm -rf "$S"
fi

# 4. the Python dependencies the GPU image lacks (../shared/research/gpu_vllm_e2e.md, found by
#    hiding packages), installed for cp312 into one folder
DEPS=$root/scripts/gpu_vllm_deps.txt
if [ ! -s "$ONE/deps_site.tar.xz" ] || [ "$DEPS" -nt "$ONE/deps_site.tar.xz" ]; then
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
  (cd "$C/site" && tar cf - --sort=name --owner=0 --group=0 . | xz -9e -T"$XZ_THREADS" > "$ONE/deps_site.tar.xz.part")
  mv "$ONE/deps_site.tar.xz.part" "$ONE/deps_site.tar.xz"
fi

# 5. manifest (scripts/gpu_vllm_unpack.py checks the SHA-256 of every file it unpacks)
"$PY" - "$ONE" "$FULL" "$VLLM_VERSION" "$DEPS" <<'EOF'
import hashlib, json, os, sys, time
one, full, ver, deps = sys.argv[1:5]
def entry(d, n):
    p = os.path.join(d, n)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return {"bytes": os.path.getsize(p), "sha256": h.hexdigest()}
for d, extra in ((one, {"so": "sm90"}), (full, {"so": "full"})):
    files = {n: entry(d, n) for n in sorted(os.listdir(d)) if n.endswith(".xz")}
    man = {"vllm": ver, "python": "3.12", "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "deps": [l.split("#")[0].strip() for l in open(deps) if l.strip() and l[0].isalnum()],
           "files": files, **extra}
    with open(os.path.join(d, "MANIFEST.json"), "w") as f:
        json.dump(man, f, indent=1)
EOF

# 6. sizes: the working tree + each call's carry folder must fit the device tool's limit
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
             | awk '{s+=$1} END {print s+0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
dir_bytes() { find "$1" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}'; }
one_bytes=$(dir_bytes "$ONE"); full_bytes=$(dir_bytes "$FULL")
limit=$((LIMIT_MIB * 1048576))
rel() { realpath --relative-to="$root" "$1"; }
echo
echo "[bundle] working tree that travels (git ls-files -co --exclude-standard): $(mib "$tree_bytes") MiB"
for f in "$ONE"/* "$FULL"/*; do printf '[bundle]   %-58s %7s MiB\n' "$(rel "$f")" "$(mib "$(stat -c %s "$f")")"; done
status=0
check() {  # label, carry bytes, carry dir
  local total=$(( tree_bytes + $2 ))
  local verdict=ok; [ "$total" -le "$limit" ] || { verdict="OVER THE ${LIMIT_MIB} MiB LIMIT"; status=1; }
  echo "[bundle] $1: carry [\"$(rel "$3")\"] $(mib "$2") MiB + tree $(mib "$tree_bytes") MiB = $(mib "$total") MiB ($verdict)"
}
check "one call (sm_90-pruned _C)" "$one_bytes" "$ONE"
check "fallback call A (whole _C, then 'scripts/gpu_e2e.sh stash')" "$full_bytes" "$FULL"
say "done"
exit $status
