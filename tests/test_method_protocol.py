"""The impl only dispatches: a method it has never heard of, written against
``vllm_ext.methods.protocol`` alone, takes its rows of a layer (or the whole layer) and the dense path
attends exactly the rest. Runs the impl's forward on the CPU with the PyTorch dense path
(``ReferenceDense``) against dense attention computed directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ext.kernels import paged_reference
from vllm_ext.methods.protocol import MethodLayer

pytest.importorskip("vllm")

HKV, G, D, BS = 2, 2, 16, 16
HQ = HKV * G


class TailMarker(MethodLayer):
    """Takes the step's last ``n`` rows and writes a constant there (a stand-in for a method that
    attends a trailing sub-batch itself)."""

    name = "tail_marker"

    def __init__(self, n: int):
        self.n = n
        self.seen = []

    def plan(self, md):
        return md.step.plans.get(self.name)

    def claim_rows(self, rows, query, kv_cache, md, plan):
        rows.end = min(rows.end, md.num_reqs - self.n)

    def attend_claimed(self, query, kv_cache, md, plan, output, rows):
        self.seen.append(rows.end)
        t0 = md.query_start_loc_host[md.num_reqs - self.n]
        output[t0:] = plan


class WholeLayer(MethodLayer):
    name = "whole"
    exclusive = True

    def plan(self, md):
        return True

    def takes_layer(self, md, plan):
        return True

    def forward_layer(self, dense, layer, query, key, value, kv_cache, md, plan, output):
        return output.fill_(-1.0)


def _step(gen, q_lens, ctx):
    seq = [c + q for c, q in zip(ctx, q_lens)]
    nb = sum(-(-n // BS) for n in seq) + 2
    kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)     # LBNHC strides
    bt = torch.zeros(len(seq), max(-(-n // BS) for n in seq), dtype=torch.int32)
    used = 1
    for i, n in enumerate(seq):
        k = -(-n // BS)
        bt[i, :k] = torch.arange(used, used + k, dtype=torch.int32)
        used += k
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    n_tok = qsl[-1]
    # the new tokens' K/V are already in the cache; the impl writes them again at their slots
    slots = torch.cat([bt[i, torch.arange(c, c + q) // BS].long() * BS + torch.arange(c, c + q) % BS
                       for i, (c, q) in enumerate(zip(ctx, q_lens))])
    k_new = kv.permute(0, 2, 1, 3).reshape(-1, HKV, 2 * D)[slots]
    md = SimpleNamespace(num_reqs=len(seq), num_decodes=sum(q == 1 for q in q_lens),
                         num_prefills=sum(q > 1 for q in q_lens), num_actual_tokens=n_tok,
                         block_table=bt, seq_lens=torch.tensor(seq, dtype=torch.int32),
                         slot_mapping=slots, query_start_loc_host=qsl, seq_lens_host=seq,
                         last_layer_name="layers.0.attn",
                         step=SimpleNamespace(plans={"tail_marker": 3.0}, is_real=False))
    query = torch.randn(n_tok, HQ, D, generator=gen)
    return kv, md, query, k_new[..., :D].contiguous(), k_new[..., D:].contiguous()


def _impl(layers):
    from vllm_ext.backend.dense_path import ReferenceDense
    from vllm_ext.backend.impl import SpeedSfiImpl

    impl = object.__new__(SpeedSfiImpl)
    impl._rows = None
    impl.layers = layers
    impl.dense = ReferenceDense(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5,
                                kv_cache_dtype="auto", rows=None)
    return impl


def test_a_method_takes_its_trailing_rows_and_the_dense_path_the_rest():
    gen = torch.Generator().manual_seed(0)
    kv, md, query, k, v = _step(gen, q_lens=[1, 1, 5, 7], ctx=[40, 17, 30, 64])
    ref = torch.zeros_like(query)
    paged_reference.dense_paged_attention(query, kv.clone(), md.block_table, md.query_start_loc_host,
                                          md.seq_lens_host, D ** -0.5, ref)
    marker = TailMarker(n=1)
    out = torch.full_like(query, 7.0)
    _impl([marker]).forward(SimpleNamespace(layer_name="layers.0.attn"), query, k, v, kv, md, out)
    t0 = md.query_start_loc_host[3]
    torch.testing.assert_close(out[:t0], ref[:t0])            # every row before it: dense, once
    assert torch.equal(out[t0:], torch.full_like(out[t0:], 3.0))
    assert marker.seen == [3]


def test_a_method_without_a_plan_this_step_leaves_every_row_dense():
    gen = torch.Generator().manual_seed(1)
    kv, md, query, k, v = _step(gen, q_lens=[1, 6], ctx=[33, 20])
    md.step.plans = {}
    ref = torch.zeros_like(query)
    paged_reference.dense_paged_attention(query, kv.clone(), md.block_table, md.query_start_loc_host,
                                          md.seq_lens_host, D ** -0.5, ref)
    out = torch.zeros_like(query)
    _impl([TailMarker(n=1)]).forward(SimpleNamespace(layer_name="layers.0.attn"), query, k, v, kv, md, out)
    torch.testing.assert_close(out, ref)


def test_a_method_that_takes_the_layer_whole_runs_it_alone():
    gen = torch.Generator().manual_seed(2)
    kv, md, query, k, v = _step(gen, q_lens=[1, 4], ctx=[10, 12])
    before = kv.clone()
    out = torch.zeros_like(query)
    marker = TailMarker(n=1)
    _impl([WholeLayer(), marker]).forward(SimpleNamespace(layer_name="layers.0.attn"), query, k, v, kv,
                                          md, out)
    assert torch.equal(out, torch.full_like(out, -1.0))
    assert torch.equal(kv, before) and marker.seen == []     # no K/V write, no other share ran
