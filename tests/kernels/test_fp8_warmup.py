"""The start-up warm-up over an fp8 KV cache reaches every compile key a real fp8 step launches: the
forward passes the layer's ``k_scale`` / ``v_scale`` with fp8 pages (the kernels' scaled variants,
another compile key), and so does the warm-up. A warm-up that forgot the scales would miss them
(checked). Reuses the grids of ``test_kernel_warmup`` with fp8 pages (the cache, SFI's compact and
Quest pages) and scales."""

from __future__ import annotations

import functools

import pytest
import torch

import test_kernel_warmup as kw
from vllm_ext.backend.dense_path import paged_decode_workspace
from vllm_ext.kernels import launch_log
from vllm_ext.kernels.dense_decode_evidence import paged_decode
from vllm_ext.methods.warmup import warm_up_paged_decode

pytestmark = kw.pytestmark

FP8 = torch.float8_e4m3fn
SCALES = dict(k_scale=torch.tensor([0.5], device=kw.DEV), v_scale=torch.tensor(3.0, device=kw.DEV))


def _fp8(pages: torch.Tensor) -> torch.Tensor:
    """fp32 pages stored as fp8 (the strides kept), as an fp8 cache's view."""
    return pages.to(FP8)


def test_paged_decode_warm_up_reaches_the_scaled_keys():
    gen = torch.Generator().manual_seed(1)
    kv, bt = _fp8(kw._kv(gen)), kw._block_table(gen)
    ws = paged_decode_workspace(max_rows=kw.MAX_ROWS, num_heads=kw.HQ, num_kv_heads=kw.HKV, head_size=kw.D,
                                max_len=kw.MAX_LEN, device=kw.DEV)

    def warm(**scales):
        with launch_log.record(run_programs=False) as log:
            warm_up_paged_decode(kv_cache=kv, workspace=ws, num_heads=kw.HQ, head_size=kw.D, scale=kw.SCALE,
                                 dtype=torch.float32, shape=kw.SHAPE, **scales)
        return launch_log.keys(log)

    with launch_log.record(run_programs=False) as log:
        for rows in (1, 3, 16, 33):
            q = torch.randn(rows, kw.HQ, kw.D, generator=gen).to(kw.DEV)
            seq = torch.randint(1, kw.MAX_LEN, (rows,), generator=gen, dtype=torch.int32).to(kw.DEV)
            paged_decode(q, kv, bt[:rows], seq, kw.SCALE, torch.empty_like(q), workspace=ws, **SCALES)
    real = launch_log.keys(log)
    assert real and real <= warm(**SCALES), launch_log.describe_missing(real, warm(**SCALES))
    assert not real <= warm(), "the scaled variant is another compile key: a warm-up without scales misses it"


@pytest.mark.parametrize("cfg", [kw.CFG, kw.QUEST], ids=["sfi", "quest_rerank"])
def test_sfi_warm_up_reaches_every_compile_key_of_real_fp8_steps(cfg, monkeypatch):
    """SFI's layer as inside vLLM (its compact and Quest pages in fp8, the attention pages' dtype)."""
    gen = torch.Generator().manual_seed(0)
    kv, bt = _fp8(kw._kv(gen)), kw._block_table(gen)
    compact = _fp8(kw._kv(gen))
    monkeypatch.setattr(kw, "warm_up_sfi_layer", functools.partial(kw.warm_up_sfi_layer, **SCALES))
    warm = kw._warmup_keys(kv, cfg, compact)
    monkeypatch.setattr(kw, "sfi_decode", functools.partial(kw.sfi_decode, **SCALES))
    monkeypatch.setattr(kw, "sfi_prefill_end", functools.partial(kw.sfi_prefill_end, k_scale=SCALES["k_scale"]))
    real = launch_log.keys(kw._real_steps(kv, bt, gen, cfg, compact))
    assert real, "the grid launched none of our kernels"
    assert real <= warm, "compiled after start-up:\n" + launch_log.describe_missing(real, warm)
