"""The start-up warm-up reaches every compile key a real step launches, and a
pure-decode step launches a fixed, budgeted number of kernels per layer.

Both read the launches our kernels make (``vllm_ext.kernels.launch_log``: a pre-run hook on every
Triton kernel of the package, with the compile key Triton 3.6 computes). Under the interpreter the
launchers are the CUDA build's, so the launches and keys are those of the GPU."""

from __future__ import annotations

import collections
import dataclasses
import random
import re

import pytest
import torch

from vllm_ext.methods.sfi.warmup import synthetic_decode_plan, warm_up_sfi_layer
from vllm_ext.methods.warmup import DECODE_BATCHES, WarmupShape, warm_up_paged_decode
from vllm_ext.methods.sfi.path import sfi_decode, sfi_prefill_end
from vllm_ext.backend.dense_path import paged_decode_workspace
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import launch_log
from vllm_ext.kernels.dense_decode_evidence import paged_decode
from vllm_ext.kernels.triton_utils import use_triton
from vllm_ext.methods.sfi.prompt_tail import TailRow, plan_prompt_tail
from vllm_ext.methods.sfi.quest_tables import quest_blocks
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

pytestmark = pytest.mark.skipif(not use_triton(torch.device("cpu")) and not torch.cuda.is_available(),
                                reason="no Triton (neither CUDA nor the interpreter)")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HKV, G, D, BS = 2, 2, 32, 16
HQ = HKV * G
CAP, MAX_ROWS, MAX_LEN = 4, 40, 512
SHAPE = WarmupShape(max_rows=MAX_ROWS, block_table_width=MAX_LEN // BS)
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, w_prefill=8, dual_stream=False)
# the shipped preset's shape (configs/sfi.yaml: kept prefill tokens, spans around selected tokens)
PRESET_LIKE = dataclasses.replace(CFG, keep_prefill=8, select_span=3, select_span_back=1)
QUEST = dataclasses.replace(CFG, selector="quest", page_size=16, quest_rerank=2)
# maintenance chunks smaller than the capacity (sfi.maintenance_rows): B 1 gives the slow list's four
# chunks (every entry-pointer alignment), B 3 a chunk 1 at an odd offset; with kept prefill tokens
CHUNKED = dataclasses.replace(PRESET_LIKE, maintenance_rows=1)
CHUNKED_3 = dataclasses.replace(CFG, maintenance_rows=3)
QUEST_CHUNKED = dataclasses.replace(QUEST, maintenance_rows=3)
SCALE = D ** -0.5
NUM_BLOCKS = 80

# Kernels a pure-decode step launches per layer with SFI on (CUDA, FULL graphs: the same launches
# whatever the rows decide). The budget is the structure of the step, phase by phase:
#   dense rows: paged_decode, split-K with the merge in the same persistent kernel        1
#   fast rows: the two-segment kernel (compact segment + recent window, merged in-kernel)  1
#   slow rows: the dense pass with evidence + ||k|| (split-K over the compacted slow list,
#     the merge of its splits into the rows' output, the evidence reduction)             3
#   slow rows' maintenance: the selector's phases (stats, merge, score, histogram,
#     compaction, threshold, write; each a grid-wide step) and the gather                  8
# The last two phases are empty launches when no row is slow (their kernels exit on the device
# count). Removing them from the fast step needs the host to know which steps have slow rows, or
# conditional graph nodes; neither is done.
# The copy trigger (sfi.copy_ngram, on by default) is not in this count: its record and match kernels
# run once per step in the step plan (SfiSlotTables.copy_rows), not in a layer's forward.
FAST_STEP_BUDGET = 13
# The slow list runs in ceil(min(R, S) / B) chunks of B = sfi.maintenance_rows entries (S: SFI's
# request capacity); each chunk past the first repeats the last two phases (3 + 8 launches). With
# R <= B the budget above holds; docs/sfi.md gives the count at R 256 and the default B.
PER_CHUNK_LAUNCHES = 11


def fast_step_launches(rows: int, capacity: int, chunk: int) -> int:
    chunks = -(-min(rows, capacity) // chunk)
    return FAST_STEP_BUDGET + (chunks - 1) * PER_CHUNK_LAUNCHES


def _layer(cfg=CFG, paged=False):
    """``paged``: as inside vLLM, the per-request state in the compact group's pages (bound by the
    caller: the warm-up binds its own table, a real step the runner's)."""
    layer = SfiLayerBuffers(CAP, HKV, cfg, D, torch.float32, DEV, num_heads=HQ, max_len=MAX_LEN, paged=paged)
    rt = SfiRuntime(cfg, capacity=CAP, max_rows=MAX_ROWS, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                    max_len=MAX_LEN, device=DEV)
    return layer, rt


def _kv(gen):
    return torch.randn(NUM_BLOCKS, BS, HKV, 2 * D, generator=gen).transpose(1, 2).to(DEV)


def _block_table(gen):
    bt = torch.randint(1, NUM_BLOCKS, (MAX_ROWS, SHAPE.block_table_width), generator=gen,
                       dtype=torch.int32)
    return bt.to(DEV)


def _warm_up(kv, cfg=CFG, compact=None, run_programs=False):
    """The warm-up's launches (without its programs: it decides them on the host, checked below)."""
    layer, rt = _layer(cfg, paged=compact is not None)
    with launch_log.record(run_programs=run_programs) as log:
        warm_up_sfi_layer(cfg=cfg, layer_buffers=layer, runtime=rt, kv_cache=kv, num_heads=HQ,
                          head_size=D, scale=SCALE, dtype=torch.float32, shape=SHAPE, compact_cache=compact,
                          quest_cache=compact if cfg.selector == "quest" else None)
    if compact is not None:
        assert layer.compact_table is None and layer.kept_pos is None, "the forward binds the real table"
    return log, layer


def _warmup_keys(kv, cfg=CFG, compact=None):
    return launch_log.keys(_warm_up(kv, cfg, compact)[0])


def _bind_runner_table(layer, compact, gen):
    """The per-slot table the runner hooks fill (``[CAP + 1, blocks per request]``, scattered blocks)."""
    width = layer.state_pages(compact).total
    ids = torch.randint(1, compact.shape[0], ((CAP + 1) * width,), generator=gen, dtype=torch.int32)
    layer.bind_pages(compact, ids.view(CAP + 1, width).to(DEV))
    if layer.cfg.selector == "quest":
        # the Quest group's per-slot table (vllm_ext.methods.sfi.quest_tables): as wide as a max_len request's
        # bound pages; the pages share the KV tensor with the compact layer, as inside vLLM
        width = quest_blocks(MAX_LEN, layer.cfg.page_size, compact.shape[2])
        ids = torch.randint(1, compact.shape[0], ((CAP + 1) * width,), generator=gen, dtype=torch.int32)
        layer.bind_quest_pages(compact, ids.view(CAP + 1, width).to(DEV))


GRID_ROWS = (1, 2, 3, 5, 16, 17, 32, 40)


def _real_steps(kv, bt, gen, CFG=CFG, compact=None, run_programs=False, grid_rows=GRID_ROWS):
    """A grid of steps as the engine makes them: decode batches of many sizes with random modes
    and lengths, as pure-decode steps and as a mixed step's decode rows, and prefill ends of one
    to three requests with prompt lengths of either class (Quest: the prefill chunks' page bounds
    of one to three rows). The host decides every launch here (fixed launches, as in the forward),
    so the interpreter need not run the programs to record them (checked below)."""
    rng = random.Random(5)
    layer, rt = _layer(CFG, paged=compact is not None)
    if compact is not None:
        _bind_runner_table(layer, compact, gen)
    buffers = SfiPlanBuffers(MAX_ROWS, CAP, DEV, chunk_rows=rt.maintenance_rows)
    long_len = CFG.n_sink + CFG.n_recent + CFG.k + 1
    with launch_log.record(run_programs=run_programs) as log:
        for rows in grid_rows:
            modes = [rng.choice(["dense", "slow", "fast"]) for _ in range(rows)]
            lens = [rng.randrange(long_len, MAX_LEN) if m != "dense" else rng.randrange(1, MAX_LEN)
                    for m in modes]
            step = synthetic_decode_plan(buffers, CFG, modes, lens, bt[:rows])
            q = torch.randn(rows, HQ, D, generator=gen).to(DEV)
            seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
            for dense_done in (False, True):
                sfi_decode(q, kv, bt[:rows], seq, step, CFG, layer, rt, 0, SCALE, torch.empty_like(q),
                           dense_done=dense_done, fixed_launches=True)
        if CFG.selector == "quest":
            from types import SimpleNamespace

            from vllm_ext.methods.sfi.path import quest_prefill_pages

            for n in (1, 2, 3):
                lens = [rng.randrange(1, MAX_LEN) for _ in range(n)]
                i32 = dict(dtype=torch.int32, device=DEV)
                plan = SimpleNamespace(rows=torch.tensor(rng.sample(range(MAX_ROWS), n), device=DEV),
                                       seq_lens=torch.tensor(lens, **i32),
                                       first_page=torch.tensor([rng.randrange(0, 3) for _ in lens], **i32),
                                       sfi_slot=torch.arange(n, **i32) % CAP,
                                       max_pages=-(-max(lens) // CFG.page_size))
                quest_prefill_pages(kv, bt, plan, CFG, layer)
            return log
        for n_end in (1, 2, 3):
            rows, start = [], 0
            for i in range(n_end):
                p = rng.choice([long_len + 3, 96, 160, 257, 300, MAX_LEN - 1])
                q_len = rng.randrange(CFG.w_prefill, 40)
                rows.append(TailRow(row=i, token_start=start, computed=p - q_len, q_len=q_len,
                                    prompt_len=p, k=CFG.k, sfi_slot=i, first_computed=0))
                start += q_len
            plan, _ = plan_prompt_tail(CFG, rows, DEV)
            q = torch.randn(start, HQ, D, generator=gen).to(DEV)
            sfi_prefill_end(q, kv, bt[:n_end], plan, CFG, layer, rt, 0, SCALE)
    return log


@pytest.mark.parametrize("cfg, paged", [(CFG, False), (CFG, True), (PRESET_LIKE, True), (QUEST, True),
                                        (CHUNKED, True), (CHUNKED_3, True), (QUEST_CHUNKED, True)],
                         ids=["sfi_contiguous", "sfi", "preset_like", "quest_rerank", "chunks_of_1",
                              "chunks_of_3", "quest_chunks_of_3"])
def test_warmup_reaches_every_compile_key_of_real_sfi_steps(cfg, paged):
    """``paged``: the layer as inside vLLM (compact segment, kept positions and prompt-tail queries
    in the compact group's pages); contiguous: the layout the GPU benchmarks drive."""
    gen = torch.Generator().manual_seed(0)
    kv, bt = _kv(gen), _block_table(gen)
    compact = _kv(gen) if paged else None
    warm = _warmup_keys(kv, cfg, compact)
    real = launch_log.keys(_real_steps(kv, bt, gen, cfg, compact))
    assert real, "the grid launched none of our kernels"
    assert real <= warm, "compiled after start-up:\n" + launch_log.describe_missing(real, warm)


def test_the_warm_up_and_the_grid_launch_the_same_whether_their_programs_run_or_not():
    """What makes the recording without programs exact: no launch of the warm-up or of the grid
    depends on what an earlier program wrote (Quest with chunked maintenance: the most phases and
    the prefill pages). And the warm-up, run for real, leaves no per-request state behind. The grid's
    batches (the programs run in the interpreter, so not every size of the grid): one row, one row
    more than a chunk of maintenance rows (3), and more rows than two chunks hold."""
    def launches(run_programs):
        gen = torch.Generator().manual_seed(0)
        kv, bt, compact = _kv(gen), _block_table(gen), _kv(gen)
        warm, layer = _warm_up(kv, QUEST_CHUNKED, compact, run_programs=run_programs)
        if run_programs:
            assert not bool(layer.compact_len.any()), "the warm-up leaves no per-request state behind"
        return warm, _real_steps(kv, bt, gen, QUEST_CHUNKED, compact, run_programs=run_programs,
                                 grid_rows=(1, 4, 7))

    assert launches(run_programs=True) == launches(run_programs=False)


def test_warmup_reaches_paged_decode_keys_with_every_method_off():
    gen = torch.Generator().manual_seed(1)
    kv, bt = _kv(gen), _block_table(gen)
    ws = paged_decode_workspace(max_rows=MAX_ROWS, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                                max_len=MAX_LEN, device=DEV)
    with launch_log.record(run_programs=False) as log:
        warm_up_paged_decode(kv_cache=kv, workspace=ws, num_heads=HQ, head_size=D, scale=SCALE,
                             dtype=torch.float32, shape=SHAPE)
    warm = launch_log.keys(log)
    with launch_log.record(run_programs=False) as log:
        for rows in (1, 3, 16, 33):
            q = torch.randn(rows, HQ, D, generator=gen).to(DEV)
            seq = torch.randint(1, MAX_LEN, (rows,), generator=gen, dtype=torch.int32).to(DEV)
            paged_decode(q, kv, bt[:rows], seq, SCALE, torch.empty_like(q), workspace=ws)
    real = launch_log.keys(log)
    assert real and real <= warm, launch_log.describe_missing(real, warm)


def test_a_path_the_warm_up_misses_is_caught():
    """The check can fail: a warm-up of a layer without SFI's prefill-end buffers never launches the
    prefill-end kernels, and a real prefill end needs them."""
    gen = torch.Generator().manual_seed(2)
    kv, bt = _kv(gen), _block_table(gen)
    bare = SfiLayerBuffers(CAP, HKV, CFG, D, torch.float32, DEV)          # no prompt-tail buffers
    _, rt = _layer()
    with launch_log.record(run_programs=False) as log:
        warm_up_sfi_layer(cfg=CFG, layer_buffers=bare, runtime=rt, kv_cache=kv, num_heads=HQ,
                          head_size=D, scale=SCALE, dtype=torch.float32, shape=SHAPE)
    warm = launch_log.keys(log)
    layer, rt = _layer()
    p = CFG.n_sink + CFG.n_recent + CFG.k + 40
    plan, _ = plan_prompt_tail(CFG, [TailRow(row=0, token_start=0, computed=p - 12, q_len=12, prompt_len=p,
                                             k=CFG.k, sfi_slot=0, first_computed=0)], DEV)
    with launch_log.record(run_programs=False) as log:
        sfi_prefill_end(torch.randn(12, HQ, D, generator=gen).to(DEV), kv, bt[:1], plan, CFG, layer, rt, 0,
                        SCALE)
    missing = launch_log.keys(log) - warm
    assert {name for name, _ in missing} >= {"prefill_evidence._prefill_lse_kernel",
                                             "prefill_evidence._prefill_evidence_kernel"}


def _decode_launches(modes, gen, kv, bt, cfg=CFG):
    layer, rt = _layer(cfg)
    buffers = SfiPlanBuffers(MAX_ROWS, CAP, DEV, chunk_rows=rt.maintenance_rows)
    long_len = cfg.n_sink + cfg.n_recent + cfg.k + 50
    lens = [long_len + 7 * i for i in range(len(modes))]
    step = synthetic_decode_plan(buffers, cfg, modes, lens, bt[:len(modes)])
    q = torch.randn(len(modes), HQ, D, generator=gen).to(DEV)
    with launch_log.record() as log:
        sfi_decode(q, kv, bt[:len(modes)], torch.tensor(lens, dtype=torch.int32, device=DEV), step, cfg,
                   layer, rt, 0, SCALE, torch.empty_like(q), dense_done=False, fixed_launches=True)
        rt.ring.join()
    return [launch.kernel for launch in log]


def test_a_fast_only_step_launches_within_its_budget_and_the_same_kernels_as_any_step():
    gen = torch.Generator().manual_seed(3)
    kv, bt = _kv(gen), _block_table(gen)
    fast_only = _decode_launches(["fast"] * 8, gen, kv, bt)
    mixed = _decode_launches(["fast", "slow", "dense", "fast", "slow", "dense", "fast", "fast"], gen, kv, bt)
    counts = collections.Counter(fast_only)
    assert len(fast_only) <= FAST_STEP_BUDGET, f"{len(fast_only)} launches per layer: {dict(counts)}"
    # a CUDA graph captured on one step replays on any other: the launches never depend on the modes
    assert fast_only == mixed


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_step_with_more_rows_than_a_chunk_launches_the_chunk_rule(chunk):
    """R > B: the slow list runs in ceil(min(R, S) / B) chunks, each past the first adding the slow
    pass and maintenance again (PER_CHUNK_LAUNCHES); the count depends on R alone (fast-only and
    mixed steps launch the same kernels), never on how many rows are slow."""
    cfg = dataclasses.replace(CFG, maintenance_rows=chunk)
    gen = torch.Generator().manual_seed(6)
    kv, bt = _kv(gen), _block_table(gen)
    for rows in (1, 2, 3, 4, 7):
        fast_only = _decode_launches(["fast"] * rows, gen, kv, bt, cfg)
        mixed = _decode_launches([["slow", "fast", "dense"][i % 3] for i in range(rows)], gen, kv, bt, cfg)
        one_chunk = _decode_launches(["fast"] * rows, gen, kv, bt)          # B = S: one chunk
        chunks = -(-min(rows, CAP) // chunk)
        assert len(fast_only) == len(one_chunk) + (chunks - 1) * PER_CHUNK_LAUNCHES, (rows, fast_only)
        if rows >= 4:           # (below, this geometry's dense pass splits a few rows: its merge is +1)
            assert len(fast_only) <= fast_step_launches(rows, CAP, chunk), (rows, len(fast_only))
        assert fast_only == mixed, rows
    # the fast step at R <= B is the budget
    assert fast_step_launches(chunk, CAP, chunk) == FAST_STEP_BUDGET


def test_warmup_reaches_speed_upper_layer_keys():
    from vllm_ext.methods.speed.warmup import warm_up_speed_layer
    from vllm_ext.kernels.speed_attention import speed_attention

    gen = torch.Generator().manual_seed(4)
    kv, bt = _kv(gen), _block_table(gen)
    with launch_log.record() as log:
        warm_up_speed_layer(kv_cache=kv, num_heads=HQ, head_size=D, scale=SCALE, dtype=torch.float32,
                            shape=SHAPE, anchor_end=1, self_only=False)
    warm = launch_log.keys(log)
    from vllm_ext.methods.speed.visibility import SpeedPlanBuffers, plan_upper_step

    buffers = SpeedPlanBuffers(MAX_ROWS, 256, DEV)
    with launch_log.record() as log:
        # steps as the builder plans them: (query lengths per row, tokens before each row's chunk)
        for q_lens, done in (([1], [90]), ([1, 1, 30], [120, 77, 0]), ([17, 1], [0, 300])):
            rows, n = len(q_lens), sum(q_lens)
            qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
            seq = torch.tensor([d + q for d, q in zip(done, q_lens)], dtype=torch.int32, device=DEV)
            plan = plan_upper_step(slot_mapping=torch.arange(n, device=DEV), query_start_loc=qsl, seq_lens=seq,
                                   row_prompt_len=torch.tensor([60] * rows, dtype=torch.int32, device=DEV),
                                   num_reqs=rows, anchor_end=1, self_only=False, buffers=buffers)
            q = torch.randn(n, HQ, D, generator=gen).to(DEV)
            out = torch.empty_like(q)
            speed_attention(q, kv, bt[:rows], plan.token_row, plan.positions, plan.tail_start, 1, False,
                            SCALE, out)
            keep = torch.arange(0, n, 2, device=DEV)          # the upper stack on the kept tokens only
            speed_attention(q, kv, bt[:rows], plan.token_row[keep], plan.positions[keep], plan.tail_start, 1,
                            False, SCALE, out)
    real = launch_log.keys(log)
    assert real and real <= warm, launch_log.describe_missing(real, warm)


def test_the_launch_log_hooks_every_kernel_module():
    """A new module of Triton kernels must be in ``launch_log.KERNEL_MODULES`` (or its launches
    escape both the warm-up check and the launch budget)."""
    from pathlib import Path

    kernels_dir = Path(launch_log.__file__).parent
    defining = {p.stem for p in kernels_dir.glob("*.py")
                if re.search(r"^\s*@triton\.jit", p.read_text(), flags=re.M)}
    assert defining == set(launch_log.KERNEL_MODULES)
    assert launch_log.our_kernels(), "no kernel was found behind the listed modules"


# ---------------------------------------------------------------- the copy trigger (sfi.copy_ngram)
# on by default: its record and match kernels run once per step (the step plan, not a layer), over
# the token history in a history cache layer's pages (vllm_ext.methods.sfi.history_slots)
HIST_E, HIST_BLOCKS, HIST_MAX_LEN = 2 * 16 * 8, 40, 1000         # pages [H 2, block 16, C 8] fp32


def _copy_table(copy_once: bool = True, cap: int = CAP, max_reqs: int = 6):
    from types import SimpleNamespace

    from vllm_ext.backend.request_table import EngineRequestTable
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 24, "k_min": 4, "n_sink": 4, "n_recent": 16,
                                            "w_prefill": 8, "dual_stream": False, "copy_once": copy_once}})
    assert cfg.sfi.resolved_copy_ngram == 2              # the default, not set here
    t = EngineRequestTable(max_reqs=max_reqs, device=DEV, config=cfg, sfi_capacity=cap,
                           max_model_len=HIST_MAX_LEN, paged_history=True)
    names = [f"model.layers.{i}.self_attn.attn{HISTORY_SUFFIX}" for i in range(2)]
    g = torch.Generator().manual_seed(7)
    # a layer's page memory as vLLM binds it: [blocks, H, block_size, C], strided like a KV cache view
    pages = {n: torch.randn(HIST_BLOCKS, 16, 2, 8, generator=g).transpose(1, 2).to(DEV) for n in names}
    width = -(-HIST_MAX_LEN // HIST_E)
    t.bind_kv_groups({"sfi": {5: (width, names, SimpleNamespace(page_elems=HIST_E), pages)}})
    return t, pages[names[0]], width


def _real_copy_steps(t, width, rng):
    """Steps as the runner stages them (its fixed input-id and query-start buffers): prompts in
    chunks of many lengths (1 to 300 tokens), mixed steps, decode batches of 1 to 6 rows, requests
    finishing and new ones taking their slots."""
    from vllm_ext.kernels.copy_match import RECORD_BLOCK

    import numpy as np

    input_ids = torch.zeros(512, dtype=torch.int32, device=DEV)        # runner.input_ids.gpu
    qsl_dev = torch.zeros(7, dtype=torch.int32, device=DEV)            # runner.query_start_loc.gpu
    free = list(range(1, HIST_BLOCKS))
    rng.shuffle(free)
    state = {}                          # rid -> [prompt tokens, tokens so far, blocks]
    n_req = 0
    with launch_log.record() as log:
        for step_no in range(24):
            while len(state) < 5:
                n_req += 1
                prompt = [rng.randrange(50, 60) for _ in range(rng.choice([30, 60, 100, RECORD_BLOCK + 40]))]
                state[f"r{n_req}"] = [prompt, [], []]
            t.sync_membership([], {rid: (len(p), None) for rid, (p, _, _) in state.items()})
            rids = list(state)[:rng.choice([1, 2, 3, 5])]
            chunks = []
            for rid in rids:
                prompt, done, _ = state[rid]
                if len(done) < len(prompt):
                    chunks.append(prompt[len(done):len(done) + rng.choice([1, 7, 17, 40, 300])])
                else:
                    chunks.append([rng.randrange(50, 60)])
            qsl = np.zeros(7, dtype=np.int32)
            qsl[1:len(rids) + 1] = np.cumsum([len(c) for c in chunks])
            flat = [tok for c in chunks for tok in c]
            input_ids[:len(flat)] = torch.tensor(flat, dtype=torch.int32)
            qsl_dev.copy_(torch.from_numpy(qsl))
            computed = np.array([len(state[r][1]) for r in rids], dtype=np.int32)
            rows = torch.zeros(len(rids), width, dtype=torch.int32)
            counts = np.zeros(len(rids), dtype=np.int32)
            for i, (rid, c) in enumerate(zip(rids, chunks)):
                held = state[rid][2]
                while len(held) * HIST_E < len(state[rid][1]) + len(c):
                    held.append(free.pop())
                rows[i, :len(held)] = torch.tensor(held, dtype=torch.int32)
                counts[i] = len(held)
            is_decode = np.array([len(state[r][1]) >= len(state[r][0]) for r in rids])
            t.stage(rids, len(rids), len(rids), real=True, input_ids=input_ids, query_start_loc=qsl_dev,
                    row_is_decode=is_decode, host_geometry=(qsl, computed),
                    group_tables={5: (rows.to(DEV), counts >= width, counts)})
            seq = torch.tensor([len(state[r][1]) + len(c) for r, c in zip(rids, chunks)], dtype=torch.int32,
                               device=DEV)
            t.build_step(seq)
            for rid, c in zip(rids, chunks):
                state[rid][1].extend(c)
            done = [r for r in rids if len(state[r][1]) >= len(state[r][0]) + 6 and rng.random() < 0.5]
            for rid in done:
                free.extend(state.pop(rid)[2])
            if done:
                t.sync_membership(done, {rid: (len(p), None) for rid, (p, _, _) in state.items()})
    return log


def _copy_keys(log):
    return {k for k in launch_log.keys(log) if k[0].startswith("copy_match.")}


@pytest.mark.parametrize("copy_once", [True, False], ids=["default", "every_copying_step"])
def test_warmup_reaches_every_compile_key_of_the_copy_trigger(copy_once):
    """The copy trigger is on by default, so its kernels are warmed too: a grid of real steps through
    the engine's request table (paged history, the runner's buffers) launches no record or match key
    that :func:`warm_up_copy_trigger` did not, given only what the engine knows at start-up."""
    from vllm_ext.methods.sfi.warmup import warm_up_copy_trigger

    t, pages, _ = _copy_table(copy_once)
    before = pages.clone()
    with launch_log.record() as log:
        warm_up_copy_trigger(cfg=t.sfi.cfg, pages=pages, max_len=HIST_MAX_LEN, capacity=CAP, max_rows=6)
    warm = _copy_keys(log)
    assert torch.equal(pages, before), "the warm-up writes no history page"
    assert {name for name, _ in warm} == {"copy_match._record_kernel", "copy_match._match_kernel"}
    t, _, width = _copy_table(copy_once)
    real = _copy_keys(_real_copy_steps(t, width, random.Random(8)))
    assert {name for name, _ in real} == {"copy_match._record_kernel", "copy_match._match_kernel"}
    assert real <= warm, "compiled after start-up:\n" + launch_log.describe_missing(real, warm)


def test_the_copy_warm_up_follows_the_configuration():
    """The check can fail: a warm-up for the other copy_once misses the match key of real steps."""
    from vllm_ext.methods.sfi.warmup import warm_up_copy_trigger

    t, pages, width = _copy_table(True)
    other = dataclasses.replace(t.sfi.cfg, copy_once=False)
    with launch_log.record() as log:
        warm_up_copy_trigger(cfg=other, pages=pages, max_len=HIST_MAX_LEN, capacity=CAP, max_rows=6)
    real = _copy_keys(_real_copy_steps(t, width, random.Random(9)))
    missing = real - _copy_keys(log)
    assert {name for name, _ in missing} == {"copy_match._match_kernel"}
