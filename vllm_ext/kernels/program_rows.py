"""Which batch row a Triton program works on, and whether it has work (the kernels' shared prologue)."""

from __future__ import annotations

from vllm_ext.kernels.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def program_row(e, ROWS, MASK, LENS, HAS_ROWS: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_LENS: tl.constexpr):
        """The row of program row ``e``: ``ROWS[e]`` with ``HAS_ROWS`` (a compacted list, ``-1`` an
        unused entry), else ``e``; and its length, ``LENS[row]`` with ``HAS_LENS`` (else 1), 0 for an
        unused entry or a row whose ``MASK`` is 0. A program whose length is not positive has no work."""
        if HAS_ROWS:
            row = tl.load(ROWS + e)
        else:
            row = e
        ok = row >= 0
        if HAS_MASK:
            ok = ok & (tl.load(MASK + row, mask=ok, other=0).to(tl.int32) != 0)
        if HAS_LENS:
            n = tl.load(LENS + row, mask=ok, other=0)
        else:
            n = ok.to(tl.int32)
        return row, n
