#!/usr/bin/env python3
"""``sfi.copy_ngram``'s per-step work: ``record_tokens`` (one input token per decode row) plus
``copy_match`` over a context of ``--ctx`` tokens, for 1 and 8 decode rows, m 2 and 3; the history
contiguous (a trivial block table) or, with ``--paged``, in KV-cache pages of Qwen3-4B's format (8 KV
heads, head 128, bf16, block 16: 16,384 positions per page) at scattered block ids, as vLLM's history
group holds it (``vllm_ext.kernels.token_history``).

    OMP_NUM_THREADS=1 python bench/bench_copy_match.py            # CPU: the PyTorch twins (the CPU build's path)
    python bench/bench_copy_match.py --ctx 131072 [--paged]        # CUDA: the Triton kernels

Prints milliseconds per step (median of ``--iters``); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_ext.kernels.copy_match import copy_match, record_tokens
from vllm_ext.kernels.token_history import TokenHistory, history_pages


def _history(rows: int, max_len: int, paged: bool, dev) -> TokenHistory:
    tokens = torch.randint(0, 49000, (rows + 1, max_len), dtype=torch.int32, device=dev)
    if not paged:
        return TokenHistory.of_tensor(tokens)
    e = 8 * 16 * 128 * 2 // 4
    width = history_pages(max_len, e)
    blocks = torch.randperm((rows + 1) * width * 3, device=dev)[:(rows + 1) * width]
    pages = torch.zeros(int(blocks.max()) + 1, 16, 8, 256, dtype=torch.bfloat16, device=dev).transpose(1, 2)
    hist = TokenHistory(pages, blocks.view(rows + 1, width).to(torch.int32), max_len)
    s = torch.arange(rows + 1, device=dev)[:, None].expand(-1, max_len)
    p = torch.arange(max_len, device=dev)[None, :].expand(rows + 1, -1)
    hist.pages[hist.locate(s, p)] = tokens
    return hist


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=8000)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--paged", action="store_true", help="the history in KV-cache pages (vLLM's layout)")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1) if dev.type == "cpu" else None
    max_len = args.ctx + 192
    for rows in (1, 8):
        hist = _history(rows, max_len, args.paged, dev)
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
            print(f"{dev.type} {'paged' if args.paged else 'contiguous'} ctx {args.ctx} rows {rows} m {m}: "
                  f"{statistics.median(times) * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
