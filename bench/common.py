"""Shared helpers of the SFI decode benchmarks (torch + triton only; no vLLM, no FlashInfer).

Timing on CUDA: ``triton.testing.do_bench_cudagraph`` (the op captured in a CUDA graph, as vLLM runs
decode; Python launch overhead excluded) is the headline ``ms``; ``triton.testing.do_bench`` (eager,
launch overhead included) is reported beside it as ``ms_eager``. On the CPU (``--smoke``) a short
``perf_counter`` median of the PyTorch twins; those numbers only prove the script logic.

Achieved bandwidth is gpt-fast style: bytes the op must move (KV read, outputs written) / time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BASELINE_NOTE = ("dense baseline = our split-K Triton paged decode (vllm_ext.kernels.dense_decode_"
                 "evidence.paged_decode); FlashInfer and vLLM's kernels are not installed on the "
                 "GPU machine, so they are not compared here")


def parse_args(description: str, argv=None, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"),
                    help="output folder for JSON + PNG (default $OUT or bench/results)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU with the PyTorch twins (tests the script logic)")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        # the twins, whatever TRITON_INTERPRET says: the interpreter is far too slow for a bench
        os.environ["SPEEDSFI_FORCE_TORCH_KERNELS"] = "1"
    return args


def device_for(args) -> torch.device:
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU smoke mode")
    return torch.device("cuda")


def env_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke)",
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(cuda=torch.version.cuda, sms=p.multi_processor_count,
                    gpu_mem_gib=round(p.total_memory / 2 ** 30, 1))
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], device: torch.device, *, rep_ms: int = 200,
            graph: bool = True) -> dict[str, float]:
    """Median time of ``fn`` in ms: ``ms`` (CUDA graph replay when ``graph``) and ``ms_eager``."""
    fn()  # warm-up: compiles / autotunes outside any capture
    sync(device)
    if device.type != "cuda":
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        m = statistics.median(ts)
        return {"ms": m, "ms_eager": m}
    import triton.testing as tt
    eager = tt.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    res = {"ms_eager": float(eager)}
    if graph:
        try:
            res["ms"] = float(tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except Exception as exc:  # pragma: no cover - report, fall back to eager
            res["ms"] = float(eager)
            res["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        res["ms"] = float(eager)
    return res


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """``torch`` copy of a 1 GiB tensor: GB/s counting bytes read + written (and read only)."""
    if device.type != "cuda":
        nbytes = 1 << 24
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = time_op(lambda: y.copy_(x), device, graph=False)
    ms = t["ms"]
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes": nbytes, "copy_ms": ms, "copy_gbps_rw": 2 * nbytes / ms / 1e6,
            "copy_gbps_read": nbytes / ms / 1e6}


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / ms / 1e6 if ms > 0 else float("nan")


def write_json(out_dir: str | Path, name: str, payload: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    assert "gpu" in payload.get("env", {}), "every result JSON names the GPU"
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=float))
    print(f"[bench] wrote {path}", flush=True)
    return path


def plot(out_dir: str | Path, name: str, title: str, xlabel: str, ylabel: str,
         series: dict[str, tuple[list, list]], *, logx: bool = False, logy: bool = False,
         anchors: dict[str, tuple[list, list]] | None = None) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        print(f"[bench] no plot ({exc})")
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, (xs, ys) in (anchors or {}).items():
        ax.plot(xs, ys, linestyle="none", marker="x", markersize=9, label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[bench] wrote {path}", flush=True)
    return path


# ----------------------------------------------------------------------------------------------
# Synthetic decode problems
# ----------------------------------------------------------------------------------------------

class DecodeProblem:
    """One layer's paged KV (vLLM NHD layout, i.e. logical view of a ``[B, N, H, 2D]`` buffer, pages
    shuffled), a batch of decode queries and SFI compact segments of a given size."""

    def __init__(self, *, batch: int, ctx: int, hq: int, hkv: int, d: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.batch, self.ctx, self.hq, self.hkv, self.d = batch, ctx, hq, hkv, d
        self.block_size, self.dtype, self.device = block_size, dtype, device
        mb = -(-ctx // block_size)
        nb = batch * mb
        if device.type == "cuda":
            torch.manual_seed(seed)
            phys = torch.randn(nb, block_size, hkv, 2 * d, dtype=dtype, device=device)
        else:
            phys = torch.randn(nb, block_size, hkv, 2 * d, generator=g).to(dtype)
        self.kv_cache = phys.transpose(1, 2)                         # [nb, H, bs, 2D] strided view
        perm = torch.randperm(nb, generator=g).to(torch.int32)
        self.block_table = perm.reshape(batch, mb).to(device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.query = torch.randn(batch, hq, d, generator=g).to(dtype).to(device)
        self.scale = d ** -0.5
        self.out = torch.empty_like(self.query)

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K+V read for ``tokens`` positions per (row, KV head), whole batch."""
        return self.batch * self.hkv * tokens * 2 * self.d * self.query.element_size()

    def sfi_state(self, *, n_sink: int, n_sel: int, n_recent: int, seed: int = 1):
        """Compact segments built by ``gather_compact`` from random distinct selections of
        ``[n_sink, ctx - n_recent)``; recent window ``[ctx - n_recent, ctx)``."""
        from vllm_ext.kernels.gather_compact import gather_compact
        dev = self.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        cap = n_sink + n_sel
        lo, hi = n_sink, self.ctx - n_recent
        sel = torch.full((self.batch, self.hkv, max(n_sel, 1)), -1, dtype=torch.int32)
        if n_sel > 0:
            for r in range(self.batch):
                for h in range(self.hkv):
                    pick = torch.randperm(hi - lo, generator=g)[:n_sel] + lo
                    sel[r, h, :n_sel] = pick.sort().values.to(torch.int32)
        sel = sel.to(dev)
        compact = torch.empty(self.batch, self.hkv, max(cap, 1), 2 * self.d, dtype=self.dtype,
                              device=dev)
        clen = torch.zeros(self.batch, dtype=torch.int32, device=dev)
        slot = torch.arange(self.batch, dtype=torch.int32, device=dev)
        nsel_t = torch.full((self.batch,), n_sel, dtype=torch.int32, device=dev)
        gather_compact(self.kv_cache, self.block_table, slot, sel, nsel_t, n_sink, compact, clen,
                       seq_lens=self.seq_lens)
        rstart = (self.seq_lens - n_recent).clamp_min(0)
        return dict(compact_kv=compact, compact_len=clen, slot_idx=slot, recent_start=rstart,
                    selected=sel, n_sel=nsel_t, n_sink=n_sink, max_recent=n_recent)


def paged_compact(compact: torch.Tensor, block_size: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous compact segments ``[S, Hkv, C, 2D]`` laid out as SFI's KV-cache group holds
    them inside vLLM (``vllm_ext.methods.sfi.kv_spec``): ``(pages [B, Hkv, block_size, 2D], table [S, n_c])``,
    each slot's blocks scattered over a pool with as many spare blocks again (shuffled, as vLLM's
    free list hands them out)."""
    s, hkv, cap, c2 = compact.shape
    n_c = -(-cap // block_size)
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = 2 * s * n_c + 1
    ids = (torch.randperm(num_blocks - 1, generator=g)[:s * n_c] + 1).to(torch.int32)
    table = ids.view(s, n_c).to(compact.device)
    pages = torch.zeros(num_blocks, hkv, block_size, c2, dtype=compact.dtype, device=compact.device)
    padded = torch.zeros(s, hkv, n_c * block_size, c2, dtype=compact.dtype, device=compact.device)
    padded[:, :, :cap] = compact
    pages[table.long()] = padded.view(s, hkv, n_c, block_size, c2).transpose(1, 2)
    return pages, table


def split_budget(ctx: int, retained: int, n_sink: int = 4, n_recent: int = 256) -> tuple[int, int, int]:
    """Retained tokens -> (sink, selected, recent) with the SFI defaults: the recent window first
    (at most ``n_recent``), then the sink, the rest selected."""
    retained = max(1, min(retained, ctx))
    recent = min(n_recent, retained)
    sink = min(n_sink, retained - recent)
    sel = max(0, retained - recent - sink)
    sel = min(sel, ctx - recent - sink)
    return sink, sel, recent


def bar_plot(out_dir: str | Path, name: str, title: str, labels: list[str], values: list[float],
             xlabel: str, ref: float | None = None) -> Path | None:
    """Horizontal bars (one per kernel), optional reference line (e.g. 1.0 = the copy floor)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        print(f"[bench] no plot ({exc})")
        return None
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(labels) + 1.4))
    ax.barh(range(len(labels)), values)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    if ref is not None:
        ax.axvline(ref, color="k", linestyle="--", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[bench] wrote {path}", flush=True)
    return path
