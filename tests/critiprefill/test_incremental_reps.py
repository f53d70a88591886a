"""The per-request key-block representatives the backend keeps under chunked prefill: updating only
the blocks each chunk wrote gives exactly the representatives of the whole prompt, and never touches
the blocks before the chunk (they are not recomputed)."""

import pytest
import torch

from helpers import make_batch
from vllm_ext.kernels.block_representatives import (
    block_representatives_torch,
    update_block_representatives_from_torch,
    update_block_representatives_from_triton,
    update_block_representatives_torch,
    update_block_representatives_triton,
)
from vllm_ext.kernels.triton_utils import HAS_TRITON

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # numpy, inside triton's interpreter


def _chunked(update, b, chunks, bk, nb, dtype, slot_of, scratch):
    """Feed request ``i``'s prompt in ``chunks[i]`` (lengths) through ``update``; rows of requests
    whose prompt is done in a step stay in the batch pointing at the scratch slot."""
    r = len(b.seq_list)
    hkv, d = b.kv_cache.shape[1], b.kv_cache.shape[-1] // 2
    reps = torch.full((scratch + 1, 2, nb, hkv, d), float("nan"), dtype=dtype, device=DEV)
    done = [0] * r
    for step in range(max(len(c) for c in chunks)):
        seq, first, slot = [], [], []
        for i in range(r):
            if step < len(chunks[i]):
                ctx = done[i]
                done[i] += chunks[i][step]
                seq.append(done[i])
                first.append(ctx // bk)
                slot.append(slot_of[i])
            else:                                   # a non-CritiPrefill row of the sub-batch
                seq.append(done[i])
                first.append(-(-done[i] // bk))
                slot.append(scratch)
        before = reps.clone()
        t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)   # noqa: E731
        blocks = max(-(-s // bk) - f for s, f in zip(seq, first))
        update(b.kv_cache, b.block_table, t(seq), t(first), bk, blocks, reps, t(slot))
        for i in range(r):                          # blocks before the chunk are left as they were
            lo = min(first[i], nb) if step < len(chunks[i]) else nb
            kept = before[slot_of[i], :, :lo]
            assert torch.equal(kept.nan_to_num(7.0), reps[slot_of[i], :, :lo].nan_to_num(7.0))
    return reps


def _from(update_from):
    """The unbounded form (``*_from``: blocks from ``first`` to the last live one, no host bound)
    under the bounded form's signature."""
    return lambda kv, bt, seq, first, bk, _blocks, reps, slot: update_from(kv, bt, seq, first, bk, reps, slot)


UPDATES = {"torch": update_block_representatives_torch, "triton": update_block_representatives_triton,
           "torch_from": _from(update_block_representatives_from_torch),
           "triton_from": _from(update_block_representatives_from_triton)}


@pytest.mark.parametrize("impl", list(UPDATES))
@pytest.mark.parametrize("page,bk,dtype", [(16, 32, torch.bfloat16), (32, 16, torch.float32), (16, 48, torch.float16)])
def test_chunk_updates_equal_the_whole_prompt(impl, page, bk, dtype):
    if impl.startswith("triton") and not HAS_TRITON:
        pytest.skip("triton is not installed")
    update = UPDATES[impl]
    seqs = [301, 130, 77]
    chunks = [[100, 37, 1, 130, 33], [64, 66], [77]]     # mid-block, one-token and block-aligned cuts
    b = make_batch(seqs, [1] * 3, hq=2, hkv=2, d=32, page=page, dtype=dtype, seed=bk, device=DEV)
    nb = -(-max(seqs) // bk) + 2
    slot_of = [2, 0, 1]
    reps = _chunked(update, b, chunks, bk, nb, dtype, slot_of, scratch=3)
    whole = block_representatives_torch(b.kv_cache.cpu(), b.block_table.cpu(), b.seq_lens.cpu(), bk, nb)
    for i, s in enumerate(seqs):
        n = -(-s // bk)
        assert torch.equal(reps[slot_of[i], :, :n].float().cpu(), whole[i, :, :n])   # exact: max / min
        assert torch.isnan(reps[slot_of[i], :, n:].float()).all()      # past the prompt: untouched
