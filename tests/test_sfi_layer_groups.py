"""SFI's slow maintenance reads a layer's KV through that layer's own KV-cache group.

vLLM splits the attention layers into several KV-cache groups when another spec has fewer layers
(SPEED's upper layers: 27 lower + 9 upper layers of a 36-layer model make three groups of nine
lower layers), and every group has its own block ids. The step plan gathers the slow rows' block-table
rows once, from the step's first group; a layer of another group must select and gather from its
own. Here the same logical KV sits at other physical blocks for a second group: the compact
segments, selections and outputs must be those of a plan built from that group's own table."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.sfi_forced_steps import forced_step
from vllm_ext.methods.sfi.path import sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.triton_utils import use_triton
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

DEV = torch.device("cpu")
HKV, G, D, BS = 2, 2, 16, 16
HQ = HKV * G
CAP = 4
LENS = [150, 97, 130, 120]
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, w_prefill=8, dual_stream=False)
QUEST = dataclasses.replace(CFG, selector="quest", page_size=8, k=24, quest_rerank=2)
KERNELS = ["twins"] + (["triton"] if use_triton(DEV) else [])
STEPS = [["slow", "slow", "dense", "slow"], ["fast", "slow", "slow", "fast"]]


def _groups(seed=0):
    """One group's cache and table, and a second group holding the same logical KV at other blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(LENS) // BS) + 1
    nb = CAP * width + 2
    kv_a = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)
    bt_a = torch.randperm(nb, generator=gen)[:CAP * width].reshape(CAP, width).to(torch.int32)
    bt_b = torch.randperm(nb, generator=gen)[:CAP * width].reshape(CAP, width).to(torch.int32)
    kv_b = torch.zeros_like(kv_a)
    kv_b[bt_b.flatten().long()] = kv_a[bt_a.flatten().long()]
    return gen, (kv_a, bt_a), (kv_b, bt_b)


def _run(cfg, plan_table, kv, bt, kernels, fixed):
    gen = torch.Generator().manual_seed(1)
    layer = SfiLayerBuffers(CAP, HKV, cfg, D, torch.float32, DEV, num_heads=HQ, max_len=256)
    rt = SfiRuntime(cfg, capacity=CAP, max_rows=CAP, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                    max_len=256, device=DEV)
    buffers = SfiPlanBuffers(CAP, CAP, DEV, chunk_rows=rt.maintenance_rows)
    outs = []
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx:
        for modes in STEPS:
            step, t = forced_step(buffers, cfg, modes, LENS, plan_table)
            if cfg.selector == "quest":
                step.row_page_slot.copy_(torch.arange(CAP, dtype=torch.int32))
                step.row_page_first.zero_()
            q = torch.randn(CAP, HQ, D, generator=gen)
            out = torch.zeros_like(q)
            sfi_decode(q, kv, bt, t, step, cfg, layer, rt, 0, D ** -0.5, out, dense_done=False,
                       fixed_launches=fixed)
            rt.ring.join()
            outs.append(out)
    return outs, layer.compact_kv.clone(), layer.compact_len.clone()


# the Triton kernels run on CUDA only, in CUDA's launch sequence; the twins in both sequences
@pytest.mark.parametrize("kernels,fixed", [(k, f) for k in KERNELS for f in (True, False) if k == "twins" or f],
                         ids=lambda v: {True: "cuda_sequence", False: "cpu_sequence"}.get(v, v)
                         if isinstance(v, bool) else v)
@pytest.mark.parametrize("cfg", [CFG, QUEST], ids=["sfi", "quest_rerank"])
def test_a_layer_of_another_group_maintains_from_its_own_block_table(cfg, fixed, kernels):
    _, (kv_a, bt_a), (kv_b, bt_b) = _groups()
    ref = _run(cfg, bt_b, kv_b, bt_b, kernels, fixed)          # the plan from the layer's own group
    got = _run(cfg, bt_a, kv_b, bt_b, kernels, fixed)          # the plan from the step's first group
    assert bool((ref[2] > 0).all()), "every slot selected"
    assert torch.equal(ref[1], got[1]), "compact segments differ from the layer's own group's"
    assert torch.equal(ref[2], got[2])
    for o0, o1 in zip(ref[0], got[0]):
        assert torch.equal(o0, o1)
    # and the group's KV is really elsewhere: read through the first group's table it differs
    wrong = _run(cfg, bt_a, kv_a, bt_b, kernels, fixed)
    assert not torch.equal(ref[1], wrong[1])
