"""The host plan of CritiPrefill's rows (``vllm_ext.methods.critiprefill.slots``): which rows, the sub-batch,
the state pages each row must hold (vLLM's count) and the dense fallback without them, what each
chunk recomputes, when the query carry is valid."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import cfg as make_cfg
from vllm_ext import metrics
from vllm_ext.methods.critiprefill.slots import CritiPrefillSlots, first_sparse_segment, sparse_range
from vllm_ext.methods.critiprefill.state_layout import STATE_SUFFIX, state_pages

GID, CARRY, PAGE = 3, 2, 16


def _cfg(**kw):
    base = dict(segment_size=64, block_size=16, budget=32, min_len=0, dense_layers=(0,))
    base.update(kw)
    return make_cfg(**base)


class Driver:
    """Rows: (request slot, is_decode, tokens computed, q_len); prompt lengths per request slot. The
    state group binds like vLLM's (``runner_hooks.method_kv_groups``); each row holds the pages its
    chunk needs unless ``pages`` says otherwise."""

    def __init__(self, **kw):
        self.cfg = _cfg(**kw)
        self.slots = CritiPrefillSlots(9, max_rows=8, cfg=self.cfg, device=torch.device("cpu"))
        spec = SimpleNamespace(carry_entries=CARRY, block_size=PAGE)
        self.slots.bind_kv_groups({GID: (99, ["model.layers.1.attn" + STATE_SUFFIX], spec)})
        self.prompt_len = np.zeros(8, dtype=np.int32)
        self.step_id = 0

    def step(self, rows, pages=None):
        qsl = np.cumsum([0] + [r[3] for r in rows])
        self.step_id += 1
        held = np.array(pages if pages is not None else
                        [state_pages(min(r[2] + r[3], int(self.prompt_len[r[0]])), CARRY,
                                     self.cfg.block_size, PAGE) for r in rows])
        tables = {GID: (torch.arange(len(rows) * 4, dtype=torch.int32).view(len(rows), 4), held > 0, held)}
        return self.slots.plan(num_reqs=len(rows), row_slots=np.array([r[0] for r in rows]),
                               row_is_decode=np.array([r[1] for r in rows]), prompt_len=self.prompt_len,
                               host_geometry=(qsl, np.array([r[2] for r in rows])), step_id=self.step_id,
                               group_tables=tables)


def test_sparse_range_rules():
    c = _cfg()                                   # 4 blocks per segment, 2 selected
    assert first_sparse_segment(c) == 1          # segment 1: 4 candidates > 2
    assert sparse_range(c, 333) == (64, 320)     # final segment 5 is dense
    assert sparse_range(c, 64) == (64, 0)        # one segment: nothing sparse
    lo, hi = sparse_range(_cfg(min_len=400), 333)
    assert lo >= hi                              # no segment starts at or after min_len before the final one
    assert sparse_range(_cfg(min_len=100), 333) == (128, 320)   # sparse from the first segment past min_len
    assert sparse_range(_cfg(min_len=128), 333) == (128, 320)
    assert first_sparse_segment(_cfg(budget=64)) == 2     # segment 1's 4 candidates all fit 4
    assert first_sparse_segment(_cfg(budget=48, sink_block=True)) == 2   # sink + 3 read all 4
    assert first_sparse_segment(_cfg(budget=32, sink_block=True)) == 1


def test_sub_batch_rows_and_dense_rows():
    d = Driver()
    d.prompt_len[:4] = [500, 30, 333, 200]
    # decode row, one-token chunk of a long prompt, a long chunk, a short prompt's chunk
    st = d.step([(3, 1, 200, 1), (0, 0, 150, 1), (2, 0, 0, 200), (1, 0, 0, 30)])
    assert st.first_row == 2 and st.rows == 2 and st.token_start == 2 and st.token_end == 232
    assert st.query_start_loc.tolist() == [0, 200, 230]
    assert st.row_dense.tolist() == [False, True]
    assert st.holds_state.tolist() == [1, 0]       # the dense row writes no state
    assert st.update_first.tolist() == [0, 2]      # new request: every block; dense row: nothing
    assert st.state_table("model.layers.1.attn").tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert st.last_segment.tolist() == [3, 0]
    assert st.sparse_tokens == 200 - 64 and st.sparse_segments == 3


def test_chunks_update_their_blocks_and_carry_cut_segments():
    d = Driver()
    d.prompt_len[0] = 333
    st = d.step([(0, 0, 0, 100)])
    assert st.update_first.tolist() == [0] and st.max_update_blocks == 7 and not st.carry_valid[0]
    st = d.step([(0, 0, 100, 37)])                 # continues block 6 and segment 1
    assert st.update_first.tolist() == [6] and st.max_update_blocks == 3 and bool(st.carry_valid[0])
    st = d.step([(0, 0, 137, 1)])                  # a one-token chunk: dense, no CritiPrefill row
    assert st is None
    st = d.step([(0, 0, 138, 62)])                 # catches up from block 8; carry is stale
    assert st.update_first.tolist() == [8] and not st.carry_valid[0]
    st = d.step([(0, 0, 200, 133)])                # ends the prompt
    assert st.update_first.tolist() == [12] and st.rep_seq.tolist() == [333]
    assert d.step([(0, 1, 333, 1)]) is None


def test_prefix_cache_hit_computes_the_cached_blocks_once():
    d = Driver()
    d.prompt_len[0] = 333
    st = d.step([(0, 0, 192, 100)])                # 192 tokens came from the prefix cache
    assert st.update_first.tolist() == [0] and st.max_update_blocks == 19
    st = d.step([(0, 0, 292, 41)])
    assert st.update_first.tolist() == [18]


def test_a_row_without_its_pages_is_dense_and_catches_up_later():
    metrics.reset()
    d = Driver()
    d.prompt_len[:2] = [333, 333]
    need = state_pages(100, CARRY, 16, PAGE)
    st = d.step([(0, 0, 0, 100), (1, 0, 0, 100)], pages=[need, need - 1])
    assert st.first_row == 0 and st.row_dense.tolist() == [False, True]
    assert st.holds_state.tolist() == [1, 0] and st.update_first.tolist() == [0, 7]
    assert st.sparse_tokens == 100 - 64                      # the dense row's tokens are not sparse
    assert metrics.snapshot()["fallback.critiprefill_no_state_blocks"] == 1
    st = d.step([(1, 0, 100, 100)])                # with its pages: every block from 0, no carry
    assert st.holds_state.tolist() == [1] and st.update_first.tolist() == [0]
    assert not st.carry_valid[0]


def test_a_new_request_in_a_slot_starts_clean():
    d = Driver()
    d.prompt_len[0] = 333
    d.step([(0, 0, 0, 100)])
    d.slots.slot_released(0)                        # finished, aborted or preempted
    d.slots.slot_assigned(0, None, resumed=True)    # the resume recomputes into fresh pages
    st = d.step([(0, 0, 0, 100)])
    assert st.update_first.tolist() == [0] and not st.carry_valid[0]


def test_pages_needed_follow_the_layout():
    d = Driver()
    assert d.slots.pages_needed(GID, 0) == 0
    assert d.slots.pages_needed(GID, 16 * 14) == 1          # 2 carry + 14 key blocks = one page
    assert d.slots.pages_needed(GID, 16 * 14 + 1) == 2


@pytest.mark.parametrize("decode", [0, 1])
def test_rows_of_prompts_without_a_sparse_range_plan_nothing(decode):
    d = Driver()
    d.prompt_len[0] = 64                           # one segment: nothing sparse
    assert d.step([(0, decode, 0 if not decode else 64, 64 if not decode else 1)]) is None


def test_every_chunk_of_a_prompt_with_a_sparse_range_is_a_critiprefill_row():
    """Its dense head and its final segment too: the kernel of a position never depends on how the
    prompt was chunked."""
    d = Driver()
    d.prompt_len[0] = 333
    st = d.step([(0, 0, 0, 64)])                   # the dense head only
    assert st.rows == 1 and st.row_dense.tolist() == [False] and st.sparse_tokens == 0
    st = d.step([(0, 0, 320, 13)])                 # the final segment only
    assert st.rows == 1 and st.row_dense.tolist() == [False] and st.sparse_tokens == 0
