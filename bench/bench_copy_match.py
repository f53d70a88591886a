#!/usr/bin/env python3
"""``sfi.copy_ngram``'s per-step work: ``record_tokens`` (one input token per decode row) plus
``copy_match`` over a context of ``--ctx`` tokens, for 1 and 8 decode rows, m 2 and 3.

    OMP_NUM_THREADS=1 python bench/bench_copy_match.py            # CPU: the PyTorch twins (the CPU build's path)
    python bench/bench_copy_match.py --ctx 131072                  # CUDA: the Triton kernels

Prints milliseconds per step (median of ``--iters``); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_ext.kernels.copy_match import copy_match, record_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=8000)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1) if dev.type == "cpu" else None
    max_len = args.ctx + 192
    for rows in (1, 8):
        hist = torch.randint(0, 49000, (rows + 1, max_len), dtype=torch.int32, device=dev)
        seq = torch.full((rows,), args.ctx, dtype=torch.int32, device=dev)
        slot = torch.arange(rows, dtype=torch.int32, device=dev)
        active = torch.ones(rows, dtype=torch.int32, device=dev)
        out = torch.zeros(rows, dtype=torch.int32, device=dev)
        ids = torch.randint(0, 49000, (rows,), dtype=torch.int32, device=dev)
        qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        for m in (2, 3):
            times = []
            for i in range(args.iters + 3):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                record_tokens(hist, ids, qsl, seq, slot, 1)
                copy_match(hist, seq, slot, active, out, n_sink=4, n_recent=128, ngram=m, max_matches=1)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            print(f"{dev.type} ctx {args.ctx} rows {rows} m {m}: {statistics.median(times) * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
