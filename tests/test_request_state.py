"""RequestStateTable: stable slots, per-step row views, resets on reuse, the methods' slot tables
driven through the MethodSlots protocol (no vLLM needed). The engine's table
(``EngineRequestTable``) is the generic one with the engine's methods registered."""

import numpy as np
import pytest
import torch

from vllm_ext.backend.request_table import EngineRequestTable
from vllm_ext.method_slots import MethodSlots
from vllm_ext.request_state import RequestStateTable


def _step(table, rows, tokens_per_row, last_tokens, decode, num_rows=None):
    """rows: req ids in row order; builds input_ids / query_start_loc like the runner does."""
    qsl = np.concatenate([[0], np.cumsum(tokens_per_row)]).astype(np.int32)
    input_ids = torch.zeros(int(qsl[-1]) + 3, dtype=torch.int32)
    for i, tok in enumerate(last_tokens):
        input_ids[qsl[i + 1] - 1] = tok
    return table.begin_step(list(rows), len(rows), num_rows or len(rows), input_ids,
                            torch.from_numpy(qsl), np.array(decode, dtype=bool))


def test_slots_are_stable_while_rows_move():
    t = EngineRequestTable(max_reqs=4, device="cpu")
    t.sync_membership([], {"a": (10, None), "b": (20, None)})
    sa, sb = t.slot_of["a"], t.slot_of["b"]
    assert sa != sb
    s1 = _step(t, ["a", "b"], [10, 20], [7, 8], [False, False])
    assert s1.row_slot.tolist() == [sa, sb] and s1.row_last_token.tolist() == [7, 8]
    s2 = _step(t, ["b", "a"], [1, 1], [5, 6], [True, True])           # rows swapped
    assert s2.row_slot.tolist() == [sb, sa]
    assert s2.row_prompt_len.tolist() == [20, 10]
    assert s2.row_last_token.tolist() == [5, 6]


def test_decode_steps_count_and_reset_on_reuse():
    t = EngineRequestTable(max_reqs=2, device="cpu")
    t.sync_membership([], {"a": (3, None)})
    _step(t, ["a"], [3], [1], [False])                     # prefill: not counted
    for _ in range(5):
        _step(t, ["a"], [1], [1], [True])
    slot = t.slot_of["a"]
    assert int(t.decode_steps[slot]) == 5
    gen = int(t.generation[slot])
    t.sync_membership(["a"], {})                            # finished
    assert "a" not in t.slot_of
    t.sync_membership([], {"c": (9, None)})                 # slot handed out again
    assert t.slot_of["c"] == slot
    s = _step(t, ["c"], [9], [2], [False])
    assert int(t.decode_steps[slot]) == 0 and int(t.generation[slot]) == gen + 1
    assert s.row_prompt_len.tolist() == [9]
    assert t.sfi is None                      # no method's tables without a method


def test_resumed_request_gets_fresh_state():
    t = EngineRequestTable(max_reqs=2, device="cpu")
    t.sync_membership([], {"a": (4, None)})
    for _ in range(3):
        _step(t, ["a"], [1], [1], [True])
    t.sync_membership(["a"], {"a": (4, None)})              # preempted and resumed in one step
    assert t.counters.reset_on_resume == 1
    _step(t, ["a"], [6], [1], [False])
    assert int(t.decode_steps[t.slot_of["a"]]) == 0


def test_leaving_the_batch_frees_the_slot_and_padding_uses_scratch():
    t = EngineRequestTable(max_reqs=4, device="cpu")
    t.sync_membership([], {"a": (4, None), "b": (4, None), "x": (1, None), "y": (1, None)})
    with pytest.raises(RuntimeError, match="no free request slot"):
        t.acquire("c", 1)
    t.sync_membership([], {"a": (4, None), "b": (4, None)})
    t.sync_membership([], {"b": (4, None)})                 # "a" preempted / unscheduled
    assert set(t.slot_of) == {"b"}
    s = _step(t, ["b"], [1], [3], [True], num_rows=4)        # padded to 4 rows
    assert s.row_slot.tolist()[1:] == [t.scratch_slot] * 3
    assert s.row_last_token.tolist()[1:] == [0, 0, 0]
    assert s.row_is_decode.tolist() == [1, 0, 0, 0]


def test_dummy_step_touches_no_request():
    t = EngineRequestTable(max_reqs=2, device="cpu")
    t.sync_membership([], {"a": (4, None)})
    before = t.decode_steps.clone()
    s = t.begin_step([], 0, 2, None, None, None)
    assert not s.is_real and s.row_slot.tolist() == [t.scratch_slot] * 2
    assert torch.equal(before, t.decode_steps)


def test_overrides_are_kept_per_slot():
    t = EngineRequestTable(max_reqs=2, device="cpu")
    t.sync_membership([], {"a": (4, {"sfi": {"k": 8}}), "b": (4, None)})
    assert t.overrides[t.slot_of["a"]] == {"sfi": {"k": 8}} and t.overrides[t.slot_of["b"]] is None


def test_engine_wide_fields_in_a_request_override_are_counted_not_silently_dropped():
    from vllm_ext import metrics
    from vllm_ext.config import SpeedSfiConfig

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 64}})
    t = EngineRequestTable(max_reqs=4, device="cpu", config=cfg, sfi_capacity=4, max_model_len=1024)
    metrics.reset()
    t.sync_membership([], {"a": (4, {"sfi": {"k": 32}}),                          # per request: fine
                           "b": (4, {"sfi": {"enabled": False}}),
                           "c": (4, {"sfi": {"k": 32, "select_span": 4, "mu": 0.0}})})
    counts = metrics.snapshot()
    assert counts.get("fallback.request_override_engine_wide", 0) == 1
    assert "fallback.request_override_invalid" not in counts
    # the per-request part of "c" still applies
    assert t.sfi.k_host[t.slot_of["c"]] == 32 and t.sfi.k_host[t.slot_of["a"]] == 32


class _Recording(MethodSlots):
    name = "probe"

    def __init__(self):
        self.calls = []

    def slot_assigned(self, slot, overrides, *, resumed):
        self.calls.append(("assigned", slot, overrides, resumed))

    def slot_released(self, slot):
        self.calls.append(("released", slot))

    def reset_slots(self, idx, slots):
        self.calls.append(("reset", idx.tolist(), list(slots)))

    def plan_step(self, step):
        self.calls.append(("plan", step.row_slot.tolist()))
        return f"plan {step.step_id}"

    def snapshot_fields(self, plan, row, slot):
        return {"probe": plan}


def test_the_generic_table_drives_registered_method_tables():
    t = RequestStateTable(max_reqs=2, device="cpu")
    probe = t.register(_Recording())
    t.recorder = []
    t.sync_membership([], {"a": (4, {"x": 1}), "b": (3, None)})
    assert probe.calls == [("assigned", 0, {"x": 1}, False), ("assigned", 1, None, False)]
    probe.calls.clear()
    t.sync_membership(["b"], {"a": (4, {"x": 1})})          # "b" finished before its first step
    s = _step(t, ["a"], [4], [9], [False])
    assert probe.calls == [("released", 1), ("reset", [0], [0]), ("plan", [0])]
    assert s.plans == {"probe": "plan 0"} and t.recorder[-1]["a"]["probe"] == "plan 0"
    probe.calls.clear()
    t.sync_membership(["a"], {"a": (4, None)}, resumed_req_ids=["a"])
    assert probe.calls == [("released", 0), ("assigned", 0, None, True)]
    with pytest.raises(RuntimeError, match="before any request"):
        t.register(_Recording())


def test_without_sfi_a_request_asking_for_it_is_counted():
    from vllm_ext import metrics

    t = EngineRequestTable(max_reqs=2, device="cpu")
    metrics.reset()
    t.sync_membership([], {"a": (4, {"sfi": {"enabled": True}}), "b": (4, None)})
    assert metrics.snapshot().get("fallback.sfi_not_configured", 0) == 1
    assert t.sfi is None and t.critiprefill is None and t.methods == []


def test_sfi_reads_its_kv_cache_group_rows_and_a_request_without_blocks_decodes_densely():
    """Inside vLLM the compact segments are blocks of SFI's own KV-cache group: each step the rows'
    block-table rows land in the per-compact-slot table the kernels read, and a request that does
    not hold its blocks yet (vLLM's flag per row) decodes densely until it does."""
    from vllm_ext.config import SpeedSfiConfig

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4,
                                            "n_recent": 16}})
    t = EngineRequestTable(max_reqs=4, device="cpu", config=cfg, sfi_capacity=4, max_model_len=1024)
    # the one interface: the generic table hands each method the KV-cache groups its spec declares
    t.bind_kv_groups({"sfi": {1: (2, ["model.layers.0.attn.sfi_compact"])}, "other": {2: (1, ["x"])}})
    assert t.sfi.compact_table_of_layer["model.layers.0.attn"] is t.sfi.compact_tables[1]
    t.sync_membership([], {"a": (100, None), "b": (100, None)})

    def step(has_blocks_b):
        qsl = np.array([0, 1, 2], dtype=np.int32)
        ids = torch.tensor([7, 9], dtype=torch.int32)
        rows = torch.tensor([[11, 12, 0], [13, 14, 0] if has_blocks_b else [0, 0, 0]], dtype=torch.int32)
        t.stage(["a", "b"], 2, 2, real=True, input_ids=ids, query_start_loc=torch.from_numpy(qsl),
                row_is_decode=np.array([True, True]),
                host_geometry=(qsl, np.array([100, 100], dtype=np.int32)),
                group_tables={1: (rows, np.array([True, has_blocks_b]))})
        return t.build_step(torch.tensor([101, 101], dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32))

    s = step(has_blocks_b=False)
    slot_a = t.sfi.slot_host[t.slot_of["a"]]
    assert t.sfi.compact_tables[1][slot_a].tolist() == [11, 12]
    assert s.sfi.row_sparse.tolist() == [True, False]          # "b" holds no compact blocks yet
    s = step(has_blocks_b=True)
    slot_b = t.sfi.slot_host[t.slot_of["b"]]
    assert t.sfi.compact_tables[1][slot_b].tolist() == [13, 14]
    assert s.sfi.row_sparse.tolist() == [True, True]
    # a request resumed after preemption starts without blocks (vLLM freed them)
    t.sync_membership(["b"], {"a": (100, None), "b": (100, None)}, resumed_req_ids=["b"])
    s = step(has_blocks_b=False)
    assert s.sfi.row_sparse.tolist() == [True, False]
