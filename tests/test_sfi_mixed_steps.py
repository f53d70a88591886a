"""A step with prefills computes every row once on the CUDA route, and side-stream work reads
no temporary. The CUDA branch of the impl (with the CUDA dense path, ``DelegateDense``) runs here on the CPU
with a stand-in for vLLM's Triton delegate (dense attention over the rows its metadata names) and the
PyTorch twins of our kernels: the delegate must see only the prefill rows (its metadata cut by the
``dense_delegate.cut_delegate``), SFI computes every decode row (dense ones through ``paged_decode``), and
the row counters (``vllm_ext.row_counters``) add up to the rows of the layer call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ext import row_counters
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.config import ConfigError, SpeedSfiConfig
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import paged_reference
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

pytest.importorskip("vllm")

HKV, G, D, BS = 2, 2, 32, 16
HQ = HKV * G
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, dual_stream=False)
# three decode rows (dense, slow, fast), then two prefill chunks of 5 and 7 tokens
DECODE_T = [30, 130, 161]
PREFILL = [(40, 5), (64, 7)]                     # (tokens before the chunk, chunk length)


class FakeDelegate:
    """vLLM's TritonAttentionImpl as the impl uses it: ``forward`` attends the rows of its metadata
    (``query``/``output`` start at the metadata's first token), densely, with the reference kernel."""

    def __init__(self, scale):
        self.scale = scale
        self.calls = []

    def do_kv_cache_update(self, *args):           # K/V are in the cache already
        pass

    def forward(self, layer, query, key, value, kv_cache, md, output):
        qsl = md.query_start_loc.tolist()
        seq = md.seq_lens.tolist()
        self.calls.append(dict(rows=len(seq), qsl=qsl, seq=seq, tokens=md.num_actual_tokens,
                               first_query=query[0].clone()))
        paged_reference.dense_paged_attention(query, kv_cache, md.block_table, qsl, seq, self.scale,
                                              output)
        return output


def _batch(gen):
    seq = DECODE_T + [c + q for c, q in PREFILL]
    q_lens = [1] * len(DECODE_T) + [q for _, q in PREFILL]
    nb = sum(-(-n // BS) for n in seq) + 4
    kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)    # LBNHC strides
    width = max(-(-n // BS) for n in seq) + 1
    bt = torch.zeros(len(seq), width, dtype=torch.int32)
    perm = torch.randperm(nb, generator=gen)
    used = 0
    for i, n in enumerate(seq):
        k = -(-n // BS)
        bt[i, :k] = perm[used:used + k].to(torch.int32)
        used += k
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return kv, bt, torch.tensor(seq, dtype=torch.int32), qsl, q_lens


def _setup(sfi_on: bool, *, cut: bool = True):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    from vllm_ext.backend.dense_path import DelegateDense
    from vllm_ext.backend.dense_delegate import cut_delegate
    from vllm_ext.backend.impl import SpeedSfiImpl
    from vllm_ext.methods.protocol import LayerGeometry
    from vllm_ext.methods.sfi.layer import SfiLayer
    from vllm_ext.methods.sfi.method import SfiMethod
    from vllm_ext.methods.sfi.step_plan import write_plan

    gen = torch.Generator().manual_seed(3)
    kv, bt, seq, qsl, q_lens = _batch(gen)
    n_tok = int(qsl[-1])
    nd, nreq = len(DECODE_T), len(seq)
    scale = D ** -0.5
    query = torch.randn(n_tok, HQ, D, generator=gen)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=nreq,
                                 num_actual_tokens=n_tok, max_query_len=max(q_lens), max_seq_len=int(seq.max()),
                                 block_table_tensor=bt, slot_mapping=torch.arange(n_tok))
    scratch = torch.zeros(1)
    delegate = TritonAttentionMetadata(num_actual_tokens=n_tok, max_query_len=max(q_lens), query_start_loc=qsl,
                                       max_seq_len=int(seq.max()), seq_lens=seq, block_table=bt,
                                       slot_mapping=cm.slot_mapping, seq_threshold_3D=0,
                                       num_par_softmax_segments=16, softmax_segm_output=scratch,
                                       softmax_segm_max=scratch, softmax_segm_expsum=scratch, causal=True)
    if not cut:
        delegate.mm_prefix_range = {0: [(0, 1)]}  # a multimodal batch: the delegate is not cut
    sfi_step = None
    cfg = SpeedSfiConfig(sfi=CFG if sfi_on else SfiConfig(), dense_decode="auto" if sfi_on else "paged_decode")
    cpu = torch.device("cpu")
    rows = row_counters.RowCounters(cpu)
    impl = object.__new__(SpeedSfiImpl)
    impl.config, impl.scale, impl._rows, impl.layers = cfg, scale, rows, []
    impl.dense = DelegateDense(FakeDelegate(scale), paged_decode=not sfi_on, max_rows=8, max_len=256,
                               device=cpu, num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=scale,
                               kv_cache_dtype="auto", rows=rows)
    if sfi_on:
        geometry = LayerGeometry(layer_name="layers.0.attn", layer_index=0, num_layers=1, num_heads=HQ,
                                 num_kv_heads=HKV, head_size=D, scale=scale, max_rows=8, max_len=256,
                                 max_batched_tokens=64, device=cpu)
        share = SfiLayer(SfiMethod(cfg, None, row_counters=rows), geometry)
        share.buffers = SfiLayerBuffers(4, HKV, CFG, D, torch.float32, cpu)
        share.runtime = SfiRuntime(CFG, capacity=4, max_rows=8, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                                   max_len=256, device=cpu)
        impl.layers = [share]
        buffers = SfiPlanBuffers(8, 4, cpu)
        t = torch.tensor(DECODE_T + [0, 0], dtype=torch.int32)
        slow = torch.tensor([False, True, False, False, False])
        fast = torch.tensor([False, False, True, False, False])
        sparse = slow | fast
        sfi_step = write_plan(buffers, nreq, slow=slow, fast=fast, sparse=sparse,
                              row_sfi_slot=torch.where(sparse, torch.tensor([0, 1, 2, 0, 0], dtype=torch.int32), 0),
                              k=torch.full_like(t, CFG.k), recent_start=torch.clamp(t - CFG.n_recent, min=0),
                              lo=torch.full_like(t, CFG.n_sink), hi=torch.clamp(t - CFG.n_recent, min=CFG.n_sink),
                              t=t, block_table=bt)
    step = SimpleNamespace(plans={"sfi": sfi_step})
    md = SimpleNamespace(num_decodes=nd, num_prefills=nreq - nd, num_reqs=nreq, num_actual_tokens=n_tok,
                         block_table=bt, seq_lens=seq, slot_mapping=cm.slot_mapping, step=step,
                         delegate=delegate, delegate_head=None, delegate_tail=None, delegate_first_row=0,
                         delegate_first_token=0)
    cut_delegate(md, cm, delegate, decodes_apart=True, tail_row=None)
    ref = torch.zeros_like(query)
    paged_reference.dense_paged_attention(query, kv, bt, qsl.tolist(), seq.tolist(), scale, ref)
    return impl, md, query, kv, ref


def _run(impl, md, query, kv):
    out = torch.full_like(query, 7.0)
    active = [(share, plan) for share in impl.layers if (plan := share.plan(md)) is not None]
    impl._forward(None, query, query, query, kv, md, out, active)
    return out, impl._rows.read()


def test_mixed_step_delegate_sees_only_the_prefill_rows_and_each_row_is_computed_once():
    impl, md, query, kv, ref = _setup(sfi_on=True)
    assert md.delegate_first_row == 3 and md.delegate_first_token == 3 and md.delegate_tail is not None
    out, rows = _run(impl, md, query, kv)
    (call,) = impl.dense.impl.calls
    assert call["rows"] == 2 and call["qsl"] == [0, 5, 12] and call["tokens"] == 12
    assert call["seq"] == [c + q for c, q in PREFILL]
    assert torch.equal(call["first_query"], query[3])          # its token 0 is the first prefill token
    # dense (paged_decode), slow (dense + evidence) and prefill rows are exact; the fast row attends
    # its compact segment + recent window (written, not dense)
    torch.testing.assert_close(out[:2], ref[:2], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out[3:], ref[3:], atol=2e-4, rtol=2e-4)
    assert not torch.equal(out[2], torch.full_like(out[2], 7.0))
    assert rows == {"rows.layer": 5, "rows.delegate": 2, "rows.paged_decode": 1, "rows.sfi_slow": 1,
                    "rows.sfi_fast": 1, "rows.critiprefill": 0}
    assert sum(v for k, v in rows.items() if k != "rows.layer") == rows["rows.layer"]


def test_uncuttable_delegate_falls_back_to_every_row_and_the_counters_show_it():
    impl, md, query, kv, ref = _setup(sfi_on=True, cut=False)
    assert md.delegate_first_row == 0 and md.delegate_tail is None
    out, rows = _run(impl, md, query, kv)
    assert impl.dense.impl.calls[0]["rows"] == 5
    torch.testing.assert_close(out[:2], ref[:2], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out[3:], ref[3:], atol=2e-4, rtol=2e-4)
    # the sparse decode rows were computed twice (delegate, then SFI): the sum exceeds the rows
    assert rows["rows.delegate"] == 5 and rows["rows.paged_decode"] == 0
    assert sum(v for k, v in rows.items() if k != "rows.layer") == rows["rows.layer"] + 2


def test_with_a_critiprefill_sub_batch_both_cuts_are_built():
    """CritiPrefill's sparse layers take the delegate up to its sub-batch (``delegate_head``), its dense
    layers every row from the first prefill row (``delegate_tail``)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_ext.backend.dense_delegate import cut_delegate

    impl, md, query, kv, ref = _setup(sfi_on=True)
    qsl = torch.tensor([0, 1, 2, 3, 8, 15], dtype=torch.int32)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=md.seq_lens, num_reqs=5,
                                 num_actual_tokens=15, max_query_len=7, max_seq_len=200,
                                 block_table_tensor=md.block_table, slot_mapping=torch.arange(15))
    step = SimpleNamespace(plans=dict(md.step.plans, critiprefill=SimpleNamespace(first_row=4)))
    cut_delegate(md, cm, md.delegate, decodes_apart=True, tail_row=4)
    assert md.delegate_first_row == 3
    assert md.delegate_head.query_start_loc.tolist() == [0, 5] and md.delegate_head.num_actual_tokens == 5
    assert md.delegate_tail.query_start_loc.tolist() == [0, 5, 12] and md.delegate_tail.num_actual_tokens == 12
    # a dense layer (no CritiPrefill tables): the delegate takes every prefill row
    md.step = step
    out, rows = _run(impl, md, query, kv)
    assert impl.dense.impl.calls[0]["rows"] == 2
    torch.testing.assert_close(out[3:], ref[3:], atol=2e-4, rtol=2e-4)


def test_all_off_with_paged_decode_computes_decode_rows_with_our_kernel():
    impl, md, query, kv, ref = _setup(sfi_on=False)
    assert md.delegate_first_row == 3
    out, rows = _run(impl, md, query, kv)
    assert impl.dense.impl.calls[0]["rows"] == 2
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    assert rows["rows.paged_decode"] == 3 and rows["rows.delegate"] == 2 and rows["rows.layer"] == 5


def test_dense_decode_switch_resolves_and_refuses_the_delegate_under_sfi():
    assert SpeedSfiConfig().resolved_dense_decode == "delegate"
    assert SpeedSfiConfig(sfi=CFG).resolved_dense_decode == "paged_decode"
    assert SpeedSfiConfig.from_dict({"dense_decode": "paged_decode"}).resolved_dense_decode == "paged_decode"
    with pytest.raises(ConfigError, match="dense_decode"):
        SpeedSfiConfig.from_dict({"sfi": {"enabled": True}, "dense_decode": "delegate"})
    with pytest.raises(ConfigError, match="per request"):
        SpeedSfiConfig().with_overrides({"dense_decode": "paged_decode"})


def test_prefill_end_side_stream_work_reads_the_ring_slots_persistent_tables():
    """``sfi_prefill_end`` hands the side stream the ending requests' block-table rows in the ring
    slot's persistent buffer (not a temporary the main stream could reuse before the side stream ran)."""
    from vllm_ext.methods.sfi.path import sfi_prefill_end
    from vllm_ext.methods.sfi.prompt_tail import plan_prompt_tail, TailRow

    cfg = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, w_prefill=8, dual_stream=False)
    gen = torch.Generator().manual_seed(1)
    kv, bt, seq, qsl, _ = _batch(gen)
    layer = SfiLayerBuffers(4, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=HQ)
    rt = SfiRuntime(cfg, capacity=4, max_rows=8, num_heads=HQ, num_kv_heads=HKV, head_size=D, max_len=256,
                    device=torch.device("cpu"))
    rows = [TailRow(row=3 + i, token_start=int(qsl[3 + i]), computed=c, q_len=q, prompt_len=c + q, k=cfg.k,
                    sfi_slot=i, first_computed=0) for i, (c, q) in enumerate(PREFILL)]
    plan, _ = plan_prompt_tail(cfg, rows, torch.device("cpu"))
    assert plan.num_ends == 2
    seen = []
    submit = rt.ring.submit

    def spy(i, fn):
        seen.append([c.cell_contents for c in fn.__closure__ or ()] + list(fn.__defaults__ or ()))
        submit(i, fn)

    rt.ring.submit = spy
    query = torch.randn(int(qsl[-1]), HQ, D, generator=gen)
    sfi_prefill_end(query, kv, bt, plan, cfg, layer, rt, 0, D ** -0.5)
    assert len(seen) == 1
    captured = seen[0]
    tables = [t for t in captured if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 2]
    (table,) = tables
    buf = rt.ring.entries[0].tables
    assert table.data_ptr() == buf.data_ptr()
    assert torch.equal(table, bt[plan.rows])
    assert int(layer.compact_len[0]) > 0 and int(layer.compact_len[1]) > 0
