#!/usr/bin/env python3
"""Zero the payloads of the cubins for other GPUs in an ELF's ``.nv_fatbin`` section; keep all PTX.

    python scripts/fatbin_prune.py SRC.so DST.so [--keep-sm 90] [--stats]

The layout is kept byte for byte (offsets and sizes unchanged): only the payload bytes of cubin
entries (kind 2) whose architecture is not ``--keep-sm`` become zeros, so the library compresses to
a third (vLLM 0.32's ``_C_stable_libtorch.abi3.so``: 51.9 MiB -> 16.4 MiB as xz). An sm_90 GPU
(H100, H200) can only run sm_90 cubins or JIT-compile PTX, so the zeroed entries are never loaded
there. Refuses (exit 1) when no cubin of ``--keep-sm`` is found (the result would be useless).

The architecture is the u32 at byte 28 of the entry header. Byte 32 (which the team's
``shared/tools/gpu_vllm/fatbin_prune.py`` reads) is always 0 in this library: reading it would zero
*every* cubin, sm_90 included, leaving only the 28 PTX entries (most kernels would then have no code
for an H100).
"""

from __future__ import annotations

import argparse
import collections
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int]:
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            parts = line.split("]", 1)[1].split()
            # Name Type Address Off Size ...
            return int(parts[3], 16), int(parts[4], 16)
    raise SystemExit(f"{path}: no .nv_fatbin section")


def prune(data: bytearray, off: int, size: int, keep: int | None) -> dict:
    """Walk every fatbin container in [off, off+size); zero non-``keep`` cubins when ``keep`` is set."""
    stats = collections.Counter()
    end_all = off + size
    while off + 16 <= end_all:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, off)
        if magic != FATBIN_MAGIC:
            off += 8
            continue
        p = off + hsz
        end = p + fsz
        while p < end:
            # entry header: u16 kind (1 PTX, 2 cubin), u16, u32 header size, u64 payload size,
            # u32 compressed size, u32, u16 minor, u16 major, u32 arch (75, 80, ..., 90, 100, 120)
            kind, _ever, ehsz = struct.unpack_from("<HHI", data, p)
            padded = struct.unpack_from("<Q", data, p + 8)[0]
            sm = struct.unpack_from("<I", data, p + 28)[0]
            name = {1: "ptx", 2: "cubin"}.get(kind, f"kind{kind}")
            stats[f"{name}_sm{sm}"] += 1
            if kind == 2 and keep is not None and sm != keep:
                data[p + ehsz:p + ehsz + padded] = bytes(padded)
                stats["zeroed_bytes"] += padded
            elif kind == 2 and sm == keep:
                stats["kept_cubins"] += 1
            p += ehsz + padded
        off = end
    return dict(stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst", nargs="?")
    ap.add_argument("--keep-sm", type=int, default=90)
    ap.add_argument("--stats", action="store_true", help="only count the entries per kind and arch")
    args = ap.parse_args(argv)
    data = bytearray(open(args.src, "rb").read())
    off, size = fatbin_section(args.src)
    stats = prune(data, off, size, None if args.stats else args.keep_sm)
    if args.stats:
        for k, v in sorted(stats.items()):
            print(f"{k}: {v}")
        return 0
    if not args.dst:
        ap.error("dst is required unless --stats")
    if not stats.get("kept_cubins"):
        print(f"no sm_{args.keep_sm} cubin in {args.src}: refusing to prune", file=sys.stderr)
        return 1
    with open(args.dst, "wb") as f:
        f.write(data)
    print(f"kept {stats['kept_cubins']} sm_{args.keep_sm} cubins; zeroed "
          f"{stats.get('zeroed_bytes', 0) / 1048576:.2f} MiB of other cubins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
