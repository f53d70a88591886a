"""Quest's page bounds in vLLM's block manager (``vllm_ext.methods.sfi.quest_kv_spec``) and as the worker
sees them (``vllm_ext.methods.sfi.quest_tables``): the spec's page format and block counts, what "Maximum
concurrency" counts, the manager's growth / free / no prefix caching, and the per-step check that
keeps a row without its blocks off its stale table entries."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

BLOCK = 16


def _cfg(**kw):
    from vllm_ext.methods.sfi.config import SfiConfig

    return SfiConfig(enabled=True, selector="quest", page_size=8, k=32, k_min=8, n_sink=4, n_recent=16, **kw)


def _spec(max_len=1000, block=BLOCK):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ext.methods.sfi.quest_kv_spec import quest_spec_for

    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return full, quest_spec_for(full, _cfg(), max_len=max_len)


def test_quest_blocks_is_one_entry_per_page():
    from vllm_ext.methods.sfi.quest_tables import quest_blocks

    for t in (1, 7, 8, 9, 127, 128, 129, 1000, 4096, 131072):
        pages = -(-t // 8)
        assert quest_blocks(t, 8, BLOCK) == -(-pages // BLOCK)
        # one block per block_size x page_size tokens (nested ceilings are one ceiling)
        assert quest_blocks(t, 8, BLOCK) == -(-t // (8 * BLOCK))
    t = torch.tensor([0, 1, 128, 129], dtype=torch.int32)
    assert quest_blocks(t, 8, BLOCK).tolist() == [0, 1, 1, 2]
    assert quest_blocks(np.array([0, 129]), 8, BLOCK).tolist() == [0, 2]


def test_spec_shares_the_layer_page_format_and_counts_a_max_len_request():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    import vllm_ext
    from vllm_ext.methods.sfi.kv_spec import compact_spec_for
    from vllm_ext.methods.sfi.quest_kv_spec import SfiQuestPagesManager
    from vllm_ext.methods.sfi.state_pages import first_compact_len

    vllm_ext.register()
    full, spec = _spec()
    assert KVCacheSpecRegistry.get_manager_class(spec) is SfiQuestPagesManager
    assert not isinstance(spec, FullAttentionSpec)
    assert spec.page_size_bytes == full.page_size_bytes
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    assert spec.speedsfi_method == "sfi"
    assert spec.first_len == first_compact_len(_cfg()) == 4 + 16 + 8 + 1
    # 1000 tokens: 125 pages of 8, 8 blocks of 16 entries
    assert spec.pages_for(1000) == 8 and spec.blocks_per_request == 8
    assert spec.max_num_blocks_per_req(None, 1000) == 8
    assert spec.max_memory_usage_bytes(None) == 8 * spec.page_size_bytes
    # its own group beside the compact one (another spec type, same page size)
    compact = compact_spec_for(full, _cfg())
    assert type(compact) is not type(spec) and compact.page_size_bytes == spec.page_size_bytes


def test_max_concurrency_counts_the_bound_pages():
    """vLLM's start-up "Maximum concurrency" over one attention group, one compact group and one
    bound-page group: the blocks divided by what a ``max_model_len`` request holds in all three."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from vllm_ext.methods.sfi.kv_spec import compact_spec_for

    full, spec = _spec(max_len=1000)
    compact = compact_spec_for(full, _cfg())
    groups = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["a.sfi_compact"], compact),
              KVCacheGroupSpec(["a.sfi_quest"], spec)]
    n = 400
    cfg = KVCacheConfig(num_blocks=n, kv_cache_tensors=[], kv_cache_groups=groups)

    class _V:                    # the fields get_max_concurrency_for_kv_cache_config reads
        model_config = type("M", (), {"max_model_len": 1000})()
        scheduler_config = type("S", (), {"max_num_batched_tokens": 1000})()
        parallel_config = type("P", (), {"decode_context_parallel_size": 1,
                                         "prefill_context_parallel_size": 1})()
    try:
        got = get_max_concurrency_for_kv_cache_config(_V(), cfg)
    except AttributeError as e:          # vLLM reads another field: say which
        pytest.fail(f"vLLM's concurrency reads a field this test does not fake: {e}")
    per_request = -(-1000 // BLOCK) + compact.compact_blocks + spec.blocks_per_request
    assert got == pytest.approx(n / per_request)
    assert spec.blocks_per_request == 8 and -(-1000 // BLOCK) == 63


def _manager(num_blocks=64):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_ext.methods.sfi.quest_kv_spec import SfiQuestPagesManager

    _, spec = _spec()
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=BLOCK)
    return spec, pool, SfiQuestPagesManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=2,
                                            scheduler_block_size=BLOCK)


def test_manager_grows_from_the_first_length_and_frees():
    from vllm_ext import metrics

    metrics.reset()
    spec, pool, mgr = _manager()
    free = pool.get_num_free_blocks()
    first = spec.first_len
    # a short request (a chat question) never holds any
    assert mgr.get_num_blocks_to_allocate("short", first - 1, [], 0, 0, first - 1, prefill_end=10) == 0
    assert mgr.allocate_new_blocks("short", first - 1, first - 1) == []
    # crossing: what its length needs; then one more block per 128 tokens, as KV grows
    assert mgr.get_num_blocks_to_allocate("r", first, [], 0, 0, first) == 1
    assert len(mgr.allocate_new_blocks("r", first, first)) == 1
    assert mgr.allocate_new_blocks("r", 128, 128) == []
    assert mgr.get_num_blocks_to_allocate("r", 129, [], 0, 0, 129) == 1
    assert len(mgr.allocate_new_blocks("r", 129, 129)) == 1
    # a long prompt's chunk past the first length: every block its chunk needs at once
    assert len(mgr.allocate_new_blocks("p", 700, 700)) == 6
    assert pool.get_num_free_blocks() == free - 8
    assert metrics.snapshot()["sfi.quest_page_allocations"] == 2
    # never a prefix hit, never cached
    blocks, hit = type(mgr).find_longest_cache_hit([], 1000, [2], pool, spec, False, BLOCK)
    assert blocks == ([],) and hit == 0
    mgr.cache_blocks(None, 700)
    # finish / abort / preemption: vLLM's free gives every block back; a resume starts over
    mgr.free("p")
    mgr.free("r")
    assert pool.get_num_free_blocks() == free and not mgr.req_to_blocks.get("r")
    assert mgr.get_num_blocks_to_allocate("r", first - 1, [], 0, 0, first - 1) == 0
    assert mgr.get_num_blocks_to_allocate("r", 300, [], 0, 0, 300) == 3


# ------------------------------------------------------------------------ the worker's tables
def _tables(cfg=None, groups=True):
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

    full = SpeedSfiConfig(sfi=cfg or _cfg())
    t = SfiSlotTables(4, 4, 4, full, None, torch.device("cpu"), max_model_len=1000)
    if groups:
        _, spec = _spec()
        t.bind_kv_groups({1: (3, ["l0.attn.sfi_compact", "l1.attn.sfi_compact"], None),
                          2: (spec.blocks_per_request, ["l0.attn.sfi_quest", "l1.attn.sfi_quest"], spec)})
    return t


def test_groups_are_told_apart_by_their_layer_names():
    t = _tables()
    assert set(t.compact_tables) == {1} and set(t.quest.tables) == {2}
    assert t.quest.tables[2].shape == (5, 8) and t.quest.block_size == BLOCK
    assert set(t.quest.table_of_layer) == {"l0.attn", "l1.attn"}
    assert t.quest.table_of_layer["l1.attn"] is t.quest.tables[2]


def _step(t, lens, held, *, decode, computed=None, compact_ok=True):
    """A real step of rows 0..n-1 in request slots 0..n-1 with these lengths (after the step) and
    bound-page blocks held."""
    from vllm_ext.request_state import StepState

    n = len(lens)
    rows = torch.arange(n, dtype=torch.int32)
    qsl = np.arange(n + 1) if decode else None
    computed = np.array([x - 1 for x in lens]) if computed is None else np.asarray(computed)
    if not decode:
        q = np.array(lens) - computed
        qsl = np.concatenate([[0], np.cumsum(q)])
    tables = {1: (torch.arange(n * 3, dtype=torch.int32).view(n, 3), np.full(n, compact_ok), np.full(n, 3)),
              2: (torch.arange(100, 100 + n * 8, dtype=torch.int32).view(n, 8), np.zeros(n, bool),
                  np.asarray(held))}
    dec = np.full(n, int(decode), dtype=np.int32)
    return StepState(num_reqs=n, num_rows=n, is_real=True, row_slot=rows, row_prompt_len=torch.zeros(n, dtype=torch.int32),
                     row_last_token=torch.zeros(n, dtype=torch.int32), row_is_decode=torch.tensor(dec),
                     row_slot_np=rows.numpy(), row_prompt_len_np=np.zeros(n, np.int32), row_is_decode_np=dec,
                     table=None, step_id=0, seq_lens=torch.tensor(lens, dtype=torch.int32),
                     query_start_loc=torch.tensor(qsl, dtype=torch.int32), host_geometry=(qsl, computed),
                     group_tables=tables)


def _assign(t, n):
    slots = torch.tensor([t.assign(s, None)[0] for s in range(n)], dtype=torch.int32)
    t.apply_resets(torch.arange(n), slots, torch.full((n,), 32, dtype=torch.int32), torch.ones(n, dtype=torch.bool))
    return slots


def test_a_decode_row_without_its_bound_pages_decodes_densely_and_restarts_its_pages():
    from vllm_ext import metrics

    metrics.reset()
    t = _tables()
    sfi_slot = _assign(t, 3)
    t.page_upto[sfi_slot] = torch.tensor([200, 200, 200], dtype=torch.int32)
    # rows 0, 2 hold what 300 tokens need (3 blocks); row 1 holds 2 (its stale entries must not be read)
    step = _step(t, [300, 300, 300], [3, 2, 3], decode=True)
    on = t.quest.gate(step, t.sfi_slot_of, t.sfi_on, t.page_upto)
    assert on[:3].tolist() == [True, False, True]
    assert t.page_upto[sfi_slot].tolist() == [200, 0, 200]   # row 1 writes every page once it holds them
    # the per-slot table holds each row's block-table row of the group
    assert torch.equal(t.quest.tables[2][sfi_slot[2]], step.group_tables[2][0][2])
    assert metrics.snapshot()["fallback.sfi_no_quest_pages"] == 1
    # the plan: row 1 dense, no page writes for it; rows 0 and 2 sparse
    plan = t.plan_step(step)
    assert plan.row_dense[:3].tolist() == [False, True, False]
    assert plan.row_page_slot[:3].tolist() == [int(sfi_slot[0]), -1, int(sfi_slot[2])]
    # once it holds them: its decode row writes from page 0, the others their newest page
    plan = t.plan_step(_step(t, [301, 301, 301], [3, 3, 3], decode=True))
    assert plan.row_page_first[:3].tolist() == [300 // 8, 0, 300 // 8]
    # below the first length a row without blocks is normal: not counted
    metrics.reset()
    t2 = _tables()
    _assign(t2, 3)
    on = t2.quest.gate(_step(t2, [20, 20, 20], [0, 0, 0], decode=True), t2.sfi_slot_of, t2.sfi_on, t2.page_upto)
    assert not on[:3].any() and "fallback.sfi_no_quest_pages" not in metrics.snapshot()


def test_prefill_chunks_without_their_bound_pages_write_nothing_then_everything():
    from vllm_ext import metrics

    metrics.reset()
    t = _tables()
    _assign(t, 1)
    first = t.cfg.n_sink + t.cfg.n_recent + t.cfg.k_min + 1            # the manager's first length
    # chunk 1: [0, 20), below the first length, no blocks: nothing written, nothing counted
    step = _step(t, [20], [0], decode=False, computed=[0])
    assert t.plan_quest_pages(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                              host_geometry=step.host_geometry, held=np.array([0])) is None
    assert "fallback.sfi_no_quest_pages" not in metrics.snapshot()
    # chunk 2: [20, 150) holds 2 blocks: rewrites from page 0
    plan = t.plan_quest_pages(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                              host_geometry=(np.array([0, 130]), np.array([20])), held=np.array([2]))
    assert plan.first_page.tolist() == [0] and plan.seq_lens.tolist() == [150] and plan.max_pages == 19
    # chunk 3: [150, 300) continues where chunk 2 ended
    plan = t.plan_quest_pages(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                              host_geometry=(np.array([0, 150]), np.array([150])), held=np.array([3]))
    assert plan.first_page.tolist() == [150 // 8]
    # a chunk past the first length without its blocks: counted, and the next one starts over
    assert t.plan_quest_pages(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                              host_geometry=(np.array([0, 100]), np.array([300])), held=np.array([3])) is None
    assert metrics.snapshot()["fallback.sfi_no_quest_pages"] == 1 and 400 >= first
    plan = t.plan_quest_pages(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                              host_geometry=(np.array([0, 100]), np.array([400])), held=np.array([4]))
    assert plan.first_page.tolist() == [0]


def test_without_groups_nothing_is_gated():
    t = _tables(groups=False)
    assert t.quest is not None and not t.quest.tables
    _assign(t, 2)
    step = _step(t, [300, 300], [0, 0], decode=True)
    step = dataclasses.replace(step, group_tables=None)
    assert t.quest.gate(step, t.sfi_slot_of, t.sfi_on, t.page_upto) is t.sfi_on
