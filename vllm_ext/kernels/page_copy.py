"""Runs of tokens copied between pages in ``CPU_ATTN``'s packing (:class:`PackedPages`): the page-list
copies that let ``CPU_ATTN``'s own kernel attend to chosen blocks (a scratch copy of them, same packing
and dtype). The vec packings copy contiguous rows (the compiled row copy of the CPU build's library,
:func:`vllm_ext.kernels.cpu_native.copy_rows`, or its ``index_select`` twin); the amx packing goes
through the strided views."""

from __future__ import annotations

import torch

from vllm_ext.kernels import cpu_native
from vllm_ext.kernels.packed_pages import PackedPages


def copy_runs(src: PackedPages, dst: PackedPages, pages: torch.Tensor, runs: torch.Tensor,
              slots: torch.Tensor, run: int) -> None:
    """Runs of ``run`` consecutive tokens from ``src``'s pages into ``dst``'s (the same packing and
    dtype; ``run`` divides both block sizes): for each ``i`` and KV head ``h``, run ``runs[i, h]`` of
    source page ``pages[i, h]`` (its tokens ``runs * run ..``), head ``h``, into run slot
    ``slots[i]`` of ``dst`` (page ``slots // (dst block size / run)``, the slot's place in it).
    ``pages``/``runs``: int64 ``[N, Hkv]``, ``slots`` int64 ``[N]``; other slots are left as they are.
    Each head may take a different source run: the destination's slots are shared by the heads, their
    content is not."""
    nb, hkv, bs, _ = src.shape
    db = dst.shape[2]
    if src.isa != dst.isa or src.dtype != dst.dtype or bs % run or db % run or dst.shape[1] != hkv:
        raise ValueError(f"copy_runs needs the same packing and dtype and a run length ({run}) that divides "
                         f"both block sizes: {src} -> {dst}")
    if not pages.shape[0]:
        return
    if src.isa != "amx":
        _copy_runs_vec(src, dst, pages, runs, slots, run)
        return
    heads = torch.arange(hkv, device=pages.device)[None, :]
    d_page, d_run = (slots // (db // run))[:, None], (slots % (db // run))[:, None]
    for s_view, d_view in ((src.k, dst.k), (src.v, dst.v)):
        got = s_view.t6.unflatten(2, (bs // run, -1))[pages, heads, runs]
        d_view.t6.unflatten(2, (db // run, -1))[d_page, heads, d_run] = got


def _copy_runs_vec(src: PackedPages, dst: PackedPages, pages: torch.Tensor, runs: torch.Tensor,
                   slots: torch.Tensor, run: int) -> None:
    """:func:`copy_runs` for the vec packings as copies of contiguous rows (the compiled row copy, or
    ``index_select`` and ``index_copy_``: several times faster than indexing the strided views): a
    page's K ``[D, block]`` is ``D * block / run`` rows of ``run`` tokens, its V ``[block, D]``
    ``block / run`` rows of ``run * D`` elements."""
    hkv, d = src.shape[1], src.shape[3] // 2
    heads = torch.arange(hkv, device=pages.device)
    dims = torch.arange(d, device=pages.device)

    def rows(page, r, per_page):
        part = (page * hkv + heads) * 2                                # [N, Hkv]: the page part's K half
        return ((part + 1) * per_page + r).reshape(-1), ((part[..., None] * d + dims) * per_page
                                                          + r[..., None]).reshape(-1)

    src_v, src_k = rows(pages, runs, src.shape[2] // run)
    per_dst = dst.shape[2] // run
    dst_v, dst_k = rows((slots // per_dst)[:, None], (slots % per_dst)[:, None].expand(-1, hkv), per_dst)
    item = src.raw.element_size()
    dst_bytes, src_bytes = dst.raw.view(torch.uint8), src.raw.view(torch.uint8)     # fp8 has no index_copy_
    for (dst_rows, src_rows, width) in ((dst_v, src_v, run * d * item), (dst_k, src_k, run * item)):
        if not compiled_copy_rows(dst_bytes, dst_rows, src_bytes, src_rows, width):
            dst_bytes.view(-1, width).index_copy_(0, dst_rows, src_bytes.view(-1, width).index_select(0, src_rows))


def compiled_copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor,
                       row_bytes: int) -> bool:
    """The CPU build's compiled row copy (``cpu_native.copy_rows``) where it is built; False otherwise."""
    return cpu_native.copy_rows(dst, dst_rows, src, src_rows, row_bytes)
