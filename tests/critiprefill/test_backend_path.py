"""CritiPrefill as the backend runs it (host plan of ``vllm_ext.methods.critiprefill.slots`` + the per-layer path
of ``vllm_ext.methods.critiprefill.path``), driven chunk by chunk over a paged cache, against an
independent oracle: ``select_for_sequence`` on contiguous tensors + attention over explicit visible sets.

Properties (docs/critiprefill.md, "Chunk boundaries change nothing"):
- every chunking gives the oracle of that chunking: each chunk's segments are represented by their
  queries from the segment's start (the carried part included) to the chunk's end, key blocks are
  complete, fusion runs over the sparse layers of the step;
- chunk boundaries on segment boundaries give the unchunked result; other boundaries change only the
  queries of a cut segment that lie in the earlier chunk;
- the device counters agree with the host's count of sparse segments and the budget.
"""

import numpy as np
import pytest
import torch

from helpers import cfg as make_cfg
from types import SimpleNamespace

from vllm_ext.methods.critiprefill.path import critiprefill_prefill
from vllm_ext.methods.critiprefill.criticality import LayerFusion, select_for_sequence
from vllm_ext.methods.critiprefill.slots import (STAT_BLOCKS_CANDIDATE, STAT_BLOCKS_SELECTED,
                                         STAT_SPARSE_SEGMENTS, CritiPrefillSlots, first_sparse_segment,
                                         sparse_range)
from vllm_ext.kernels import kv_quant
from vllm_ext.methods.critiprefill.state_layout import STATE_SUFFIX, carry_entries, state_pages
from vllm_ext.kernels.paged_reference import attention_over

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HQ, HKV, D, PAGE = 4, 2, 16, 16
N = 333                                  # prompt length (final segment 5 is partial)
SPARSE_LAYERS = (1, 2)                   # layer 0 is dense (dense_layers=(0,)): the path never runs it
SCALE = 0.25
GID = 2                                  # CritiPrefill's state group (as vLLM numbers it)
STATE_PAGES = 12


@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    """The PyTorch twins (the CPU build's path); the Triton kernels have their own test below."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")


def _cfg(**kw):
    base = dict(segment_size=64, block_size=16, budget=32, min_len=0, dense_layers=(0,))
    base.update(kw)
    return make_cfg(**base)


def _data(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in SPARSE_LAYERS:
        k = torch.randn(n, HKV, D, generator=g)
        k = k + 1.5 * torch.randn(-(-n // 16), HKV, D, generator=g).repeat_interleave(16, 0)[:n]
        out[layer] = (torch.randn(n, HQ, D, generator=g), k, torch.randn(n, HKV, D, generator=g))
    return out


def _paged(k, v, seed):
    """``k``/``v`` of one request in a shuffled paged cache; block table row."""
    n = k.shape[0]
    pages = -(-n // PAGE)
    perm = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(seed))
    cache = torch.randn(pages + 3, PAGE, HKV, 2 * D).transpose(1, 2) * 9.0   # NHD, junk elsewhere
    for i in range(pages):
        a, e = i * PAGE, min(n, (i + 1) * PAGE)
        cache[perm[i], :, :e - a, :D] = k[a:e].transpose(0, 1)
        cache[perm[i], :, :e - a, D:] = v[a:e].transpose(0, 1)
    return cache, perm[:pages].to(torch.int32)


def _state_caches(dtype=torch.float32):
    """Each sparse layer's state pages (NaN: a read of a page never written shows) and the prompt's
    block-table row of the state group (shuffled pages)."""
    perm = torch.randperm(STATE_PAGES, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    caches = {layer: torch.full((STATE_PAGES, PAGE, HKV, 2 * D), float("nan")).to(dtype).transpose(1, 2)
              for layer in SPARSE_LAYERS}
    return caches, perm


def _quantized(cache, fp8):
    """A cache's entries stored as ``fp8 = (dtype, k_scale, v_scale)`` (vLLM's write)."""
    dtype, ks, vs = fp8
    out = torch.empty_like(cache, dtype=dtype)
    out[..., :D] = kv_quant.quantize(cache[..., :D], ks, dtype)
    out[..., D:] = kv_quant.quantize(cache[..., D:], vs, dtype)
    return out


def _dequantized_data(data, fp8):
    """``data`` with K and V as the fp8 cache holds them: what the oracle attends to."""
    dtype, ks, vs = fp8
    return {layer: (q, kv_quant.quantize(k, ks, dtype).float() * ks, kv_quant.quantize(v, vs, dtype).float() * vs)
            for layer, (q, k, v) in data.items()}


def run_path(cfg, data, chunks, *, companion=True, stats=None, fp8=None):
    """The prompt prefilled in ``chunks`` (lengths) through the backend path, its state in pages of
    a state group as vLLM allocates them (grown with the chunks). Each step also holds a decode row
    of another request (before the sub-batch) and, after the prompt's row, the chunk of a short
    prompt that stays dense; both hold no state pages and their stale table rows point at the
    prompt's (they must never write there). ``fp8``: ``(dtype, k_scale, v_scale)``: the KV pages and
    the state pages in that fp8 format, the scales passed as the layer's. Returns
    ``{layer: output [N, Hq, D]}``."""
    n = sum(chunks)
    slots = CritiPrefillSlots(4, max_rows=4, cfg=cfg, device=torch.device("cpu"))
    page_dtype = fp8[0] if fp8 else torch.float32
    carry = carry_entries(HQ, HKV, 4, page_dtype.itemsize)      # fp32 queries
    spec = SimpleNamespace(carry_entries=carry, block_size=PAGE)
    slots.bind_kv_groups({GID: (STATE_PAGES, [f"layer{l}" + STATE_SUFFIX for l in SPARSE_LAYERS], spec)})
    state, state_row = _state_caches(page_dtype)
    scales = dict(k_scale=torch.tensor([fp8[1]]), v_scale=torch.tensor(fp8[2])) if fp8 else {}
    caches = {}
    for layer, (q, k, v) in data.items():
        # the full prompt is in the cache from the start: the path must only read positions < seq
        cache, bt = _paged(k, v, seed=layer)
        caches[layer] = (_quantized(cache, fp8) if fp8 else cache, bt)
    outs = {layer: torch.zeros(n, HQ, D) for layer in SPARSE_LAYERS}
    short = 40                                                    # the dense companion prompt
    ctx = 0
    for step_id, ql in enumerate(chunks):
        seq = ctx + ql
        sq = min(8, short)                                        # the short prompt's chunk
        rows_q = [1, ql, sq] if companion else [ql]
        qsl = np.cumsum([0] + rows_q)
        computed = np.array([100, ctx, 0] if companion else [ctx])
        slots_np = np.array([1, 0, 2] if companion else [0])
        decode = np.array([1, 0, 0] if companion else [0])
        prompt_len = np.array([n, 50, short])
        held = state_pages(seq, carry, cfg.block_size, PAGE)
        assert held <= STATE_PAGES
        counts = np.array([0, held, 0] if companion else [held])
        group = {GID: (state_row[None, :].repeat(len(rows_q), 1), counts > 0, counts)}
        step = slots.plan(num_reqs=len(rows_q), row_slots=slots_np, row_is_decode=decode,
                          prompt_len=prompt_len, host_geometry=(qsl, computed), step_id=step_id,
                          group_tables=group)
        for layer in SPARSE_LAYERS:
            q, _, _ = data[layer]
            cache, bt = caches[layer]
            table = bt[None, :].repeat(len(rows_q), 1)            # the other rows' keys: any pages
            query = torch.randn(int(qsl[-1]) + 3, HQ, D) * 5.0       # other rows and padding: junk
            mine = slice(int(qsl[1]), int(qsl[2])) if companion else slice(0, ql)
            query[mine] = q[ctx:seq]
            out = torch.full_like(query, float("nan"))
            if step is not None:
                critiprefill_prefill(query, cache, table, step, cfg, state[layer],
                                     step.state_table(f"layer{layer}"), layer, SCALE, out, stats=stats, **scales)
                assert step.first_row == (1 if companion else 0)
                assert torch.isnan(out[:int(qsl[step.first_row])]).all()   # rows before: untouched
                outs[layer][ctx:seq] = out[mine]
            else:
                outs[layer][ctx:seq] = _dense(q[ctx:seq], data[layer], ctx, seq)
        ctx = seq
    return outs


def _dense(q, layer_data, ctx, seq):
    _, k, v = layer_data
    pos = torch.arange(ctx, seq)
    mask = torch.arange(seq)[None, :] <= pos[:, None]
    return attention_over(q, k[:seq].transpose(0, 1), v[:seq].transpose(0, 1), SCALE, mask)[0]


def oracle(cfg, data, chunks):
    """Per chunk: ``select_for_sequence`` from the chunk's first segment start (the carried queries)
    to its end, layer fusion over the step's sparse layers, attention over the visible sets."""
    n = sum(chunks)
    sq, bk = cfg.segment_size, cfg.block_size
    outs = {layer: torch.zeros(n, HQ, D) for layer in SPARSE_LAYERS}
    ctx = 0
    for ql in chunks:
        seq = ctx + ql
        s0 = ctx // sq * sq
        fusion = LayerFusion(cfg.fusion, cfg.alpha)
        for layer in SPARSE_LAYERS:
            q, k, v = data[layer]
            r = select_for_sequence(q[s0:seq], k[:seq], cfg, fusion, ctx_len=s0, prompt_len=n)
            mask = torch.zeros(ql, HQ, seq, dtype=torch.bool)
            g = HQ // HKV
            for p in range(ctx, seq):
                j = p // sq
                loc = j - ctx // sq
                for h in range(HKV):
                    vis = torch.zeros(seq, dtype=torch.bool)
                    if r.dense[loc]:
                        vis[:j * sq] = True
                    else:
                        for blk in r.sel[loc, h].tolist():
                            if blk >= 0:
                                vis[blk * bk:(blk + 1) * bk] = True
                    vis[j * sq:p + 1] = True
                    mask[p - ctx, h * g:(h + 1) * g] = vis
            o, _ = attention_over(q[ctx:seq], k[:seq].transpose(0, 1), v[:seq].transpose(0, 1), SCALE, mask)
            outs[layer][ctx:seq] = o
        ctx = seq
    return outs


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


SCHEDULES = {
    "one chunk": [N],
    "segment aligned": [128, 64, 141],
    "cut mid-segment": [100, 37, 130, 66],
    "one-token chunk": [100, 1, 232],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("score,fusion", [("paper", "paper"), ("code", "ema")])
def test_path_equals_the_oracle_of_its_chunking(name, score, fusion):
    cfg = _cfg(score=score, fusion=fusion)
    data = _data(1)
    chunks = SCHEDULES[name]
    got = run_path(cfg, data, chunks)
    if name == "one-token chunk":
        # the one-token chunk (position 100) attends densely; the rest is the oracle of [100, 233]
        want = oracle(cfg, data, [100, 233])
        for layer in SPARSE_LAYERS:
            _close(got[layer][100], _dense(data[layer][0][100:101], data[layer], 100, 101)[0])
            _close(got[layer][:100], want[layer][:100])
            _close(got[layer][101:], _oracle_tail(cfg, data, layer))
        return
    want = oracle(cfg, data, chunks)
    for layer in SPARSE_LAYERS:
        _close(got[layer], want[layer])


def _oracle_tail(cfg, data, layer):
    """Chunk [101, 333) after the dense one-token chunk: the segment holding 101 is represented by
    its queries from 101 on (the carry does not span the dense chunk)."""
    n, ctx = N, 101
    seq = n
    out = torch.zeros(n - ctx, HQ, D)
    fusion = LayerFusion(cfg.fusion, cfg.alpha)
    sq, bk = cfg.segment_size, cfg.block_size
    for lyr in SPARSE_LAYERS:
        q, k, v = data[lyr]
        r = select_for_sequence(q[ctx:seq], k[:seq], cfg, fusion, ctx_len=ctx, prompt_len=n)
        if lyr != layer:
            continue
        g = HQ // HKV
        mask = torch.zeros(seq - ctx, HQ, seq, dtype=torch.bool)
        for p in range(ctx, seq):
            j = p // sq
            loc = j - ctx // sq
            for h in range(HKV):
                vis = torch.zeros(seq, dtype=torch.bool)
                if r.dense[loc]:
                    vis[:j * sq] = True
                else:
                    for blk in r.sel[loc, h].tolist():
                        if blk >= 0:
                            vis[blk * bk:(blk + 1) * bk] = True
                vis[j * sq:p + 1] = True
                mask[p - ctx, h * g:(h + 1) * g] = vis
        out, _ = attention_over(q[ctx:seq], k[:seq].transpose(0, 1), v[:seq].transpose(0, 1), SCALE, mask)
    return out


@pytest.mark.parametrize("fp8", [(torch.float8_e4m3fn, 0.5, 3.0), (torch.float8_e5m2, 3.0, 0.25)],
                         ids=["e4m3", "e5m2"])
def test_fp8_pages_equal_the_oracle_of_their_dequantised_values(fp8):
    """An fp8 KV cache and fp8 state pages with the layer's scales: the key-block representatives
    (kept in stored units, scaled where scored) select what the oracle selects on the dequantised
    keys, and the attention reads the dequantised values; the query carry of a cut segment spans
    several one-byte entries and comes back exact."""
    cfg = _cfg(score="code", fusion="ema")
    data = _data(2)
    chunks = [100, 37, 196]
    got = run_path(cfg, data, chunks, fp8=fp8)
    want = oracle(cfg, _dequantized_data(data, fp8), chunks)
    for layer in SPARSE_LAYERS:
        _close(got[layer], want[layer])


def test_what_depends_on_the_chunk_boundaries():
    cfg = _cfg()
    data = _data(4)                  # (with some seeds the partial queries happen to select the same)
    whole = run_path(cfg, data, [N])
    aligned = run_path(cfg, data, [64, 192, 77])
    cut = run_path(cfg, data, [100, 37, 130, 66])
    for layer in SPARSE_LAYERS:
        _close(aligned[layer], whole[layer])                 # boundaries on segments: no change
        # cuts at 100, 137, 267: only [64, 100), [128, 137), [256, 267) may differ
        earlier = torch.zeros(N, dtype=torch.bool)
        for c in (100, 137, 267):
            earlier[c // 64 * 64:c] = True
        _close(cut[layer][~earlier], whole[layer][~earlier])
        diff = (cut[layer][earlier] - whole[layer][earlier]).abs().amax()
        assert diff > 1e-3, "the earlier part of a cut segment selects from its own queries"
    # and the sparse path really is sparse: it differs from dense attention
    dense = _dense(data[1][0], data[1], 0, N)
    assert (whole[1] - dense).abs().amax() > 1e-2


def test_budget_covering_the_prompt_plans_nothing():
    """Every segment's candidates fit the budget: no row runs CritiPrefill (the dense path does)."""
    cfg = _cfg(budget=512)
    lo, hi = sparse_range(cfg, N)
    assert lo >= hi
    slots = CritiPrefillSlots(2, max_rows=4, cfg=cfg, device=torch.device("cpu"))
    assert slots.plan(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                      prompt_len=np.array([N]), host_geometry=(np.array([0, N]), np.array([0])),
                      step_id=0) is None


def test_device_counters_match_the_host_plan():
    cfg = _cfg()
    data = _data(4)
    stats = torch.zeros(3, dtype=torch.int64)
    run_path(cfg, data, [64, 192, 77], stats=stats)
    # sparse segments: 64-token segments 1..4 (segment 0 has no block before it, 5 is final);
    # segment j: 4j candidate blocks, budget/Bk = 2 selected, per KV head and sparse layer
    j_lo = first_sparse_segment(cfg)
    segs = list(range(j_lo, (N - 1) // 64))
    assert segs == [1, 2, 3, 4]
    per = HKV * len(SPARSE_LAYERS)
    assert stats[STAT_SPARSE_SEGMENTS] == len(segs) * per
    assert stats[STAT_BLOCKS_CANDIDATE] == sum(4 * j for j in segs) * per
    assert stats[STAT_BLOCKS_SELECTED] == 2 * len(segs) * per


def test_min_len_and_short_prompts_stay_dense():
    cfg = _cfg(min_len=N + 1)
    slots = CritiPrefillSlots(2, max_rows=4, cfg=cfg, device=torch.device("cpu"))
    step = slots.plan(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                      prompt_len=np.array([N]), host_geometry=(np.array([0, N]), np.array([0])), step_id=0)
    assert step is None


@pytest.mark.parametrize("fp8", [None, (torch.float8_e4m3fn, 0.5, 3.0)], ids=["fp32", "e4m3"])
def test_triton_kernels_in_the_path_match_the_twins(monkeypatch, fp8):
    from vllm_ext.kernels.triton_utils import HAS_TRITON, interpret_mode

    if not HAS_TRITON or not (torch.cuda.is_available() or interpret_mode()):
        pytest.skip("no Triton")
    cfg = _cfg()
    data = _data(5, n=200)
    chunks = [90, 110]
    twin = run_path(cfg, data, chunks, fp8=fp8)
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "0")
    from vllm_ext.kernels import block_representatives, block_sparse_prefill, paged_state

    def twin_ran(*args, **kwargs):
        raise AssertionError("a PyTorch twin ran where the Triton kernel should")

    for module, name in [(block_sparse_prefill, "block_sparse_prefill_torch"),
                         (paged_state, "update_block_representatives_paged_torch"),
                         (paged_state, "write_state_entries_torch"),
                         (block_representatives, "query_segment_representatives_torch")]:
        monkeypatch.setattr(module, name, twin_ran)
    tri = run_path(cfg, data, chunks, fp8=fp8)
    for layer in SPARSE_LAYERS:
        torch.testing.assert_close(tri[layer], twin[layer], rtol=1e-4, atol=1e-5)
