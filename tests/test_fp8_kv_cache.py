"""An fp8 KV cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``) as the backend takes it:

- acceptance where the platform's dense backend takes it, refusal with that backend's own reason
  where it does not (on the CPU build ``CPU_ATTN``'s: x86 with AVX-512 or AMX; this CI machine may
  be either, so each test says which it checks), and CritiPrefill refused at start-up;
- the page views and the scales through the dense paths (the reference path's write and rows, the
  CUDA delegate's ``paged_decode`` rows and what vLLM's impl is handed) and through SFI's decode
  path, each against the same computation over the pages dequantised explicitly;
- SFI's cache groups in the attention pages' format (``uint8`` for fp8), their bytes per entry, and
  the compiled CPU passes declining fp8 pages (logged once, counted).

The end-to-end checks on a CPU that serves fp8 are in ``tests/e2e/test_fp8_e2e.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernel_choice import torch_kernels
from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.paged_reference import attention_over, dense_paged_attention, gather_kv

pytest.importorskip("vllm")

FP8_SPELLINGS = ("fp8", "fp8_e4m3", "fp8_e5m2")
K_SCALE, V_SCALE = 0.37, 2.5          # scales != 1: a read that forgets one is far off
CPU_FP8_REASON = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


def cpu_serves_fp8() -> bool:
    """vLLM's own condition for ``CPU_ATTN`` with an fp8 cache (``cpu_attn._get_attn_isa``)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def fake_layer(k_scale=K_SCALE, v_scale=V_SCALE, name="layers.0.attn", kv_cache_dtype="fp8"):
    """vLLM's attention layer as the backend reads it: per-tensor scales as device tensors (one of
    shape ``[1]``, one of shape ``[]``: both occur) and as host floats."""
    return SimpleNamespace(layer_name=name, kv_cache_dtype=kv_cache_dtype,
                           _k_scale=torch.tensor([k_scale]), _v_scale=torch.tensor(v_scale),
                           _k_scale_float=float(k_scale), _v_scale_float=float(v_scale))


# ----------------------------------------------------------------------------- acceptance, refusal
def _validate(**kw):
    from vllm_ext.backend.backend import SpeedSfiBackend

    args = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=None, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=None, attn_type="decoder")
    args.update(kw)
    return SpeedSfiBackend.validate_configuration(**args)


@pytest.mark.parametrize("spelling", FP8_SPELLINGS)
def test_fp8_is_taken_exactly_where_cpu_attn_takes_it(spelling):
    """Every fp8 spelling is a supported KV-cache dtype; on the CPU build the combination is refused
    with ``CPU_ATTN``'s own reason where ``CPU_ATTN`` refuses it (this machine: with AVX-512 or AMX
    accepted, without refused), for the fp32 model as for bf16."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_ext.backend.backend import SpeedSfiBackend

    assert SpeedSfiBackend.supports_kv_cache_dtype(spelling)
    for dtype in (torch.bfloat16, torch.float32):
        try:
            _get_attn_isa(dtype, 32, 64, spelling)
            vllm_reason = None
        except NotImplementedError as exc:
            vllm_reason = str(exc)
        reasons = _validate(kv_cache_dtype=spelling, dtype=dtype)
        if cpu_serves_fp8():
            assert vllm_reason is None and reasons == [], reasons
        else:
            assert vllm_reason == CPU_FP8_REASON
            assert reasons == [CPU_FP8_REASON], reasons


def test_fp8_refusals_name_cpu_attn_limits():
    """``CPU_ATTN``'s fp8 limits besides the ISA: head sizes divisible by 32 (its own message, on any
    x86 CPU), and its kernel block sizes (multiples of 32) where the CPU serves fp8."""
    assert _validate(head_size=80) == ["FP8 KV cache requires head_size divisible by 32 on CPU."]
    block16 = _validate(block_size=16)
    if cpu_serves_fp8():
        assert len(block16) == 1 and "multiple of 32" in block16[0], block16
        assert _validate(block_size=64) == []
    else:
        assert block16 == [CPU_FP8_REASON]


def test_quantised_caches_other_than_per_tensor_fp8_stay_refused():
    for cache in ("int8_per_token_head", "fp8_per_token_head", "nvfp4"):
        assert "kv_cache_dtype not supported" in _validate(kv_cache_dtype=cache)


def test_fp32_rule_refuses_16_bit_caches_only():
    """A 16-bit cache under an fp32 model stays refused (our kernels read pages in the model's dtype);
    fp8 pages are widened exactly, so they are taken with an fp32 model where the platform takes them."""
    reasons = _validate(kv_cache_dtype="bfloat16", dtype=torch.float32)
    assert any("fp16/bf16 KV cache with an fp32 model" in r for r in reasons)
    assert not any("fp32 model" in r for r in _validate(kv_cache_dtype="fp8", dtype=torch.float32))
    assert _validate(kv_cache_dtype="auto", dtype=torch.float32) == []


def test_cuda_refuses_fp8_below_native_fp8(monkeypatch):
    """On CUDA the dense delegate (vLLM's Triton attention) and our Triton kernels need native fp8
    (compute capability 8.9+): below it, refused at start-up naming the capability."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_ext.backend.backend import fp8_kv_cache_refusal

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *a: False)
    why = fp8_kv_cache_refusal(64, torch.bfloat16, "fp8", 16, DeviceCapability(8, 0))
    assert why is not None and "8.9" in why and "8.0" in why
    for cap in (DeviceCapability(8, 9), DeviceCapability(9, 0)):
        assert fp8_kv_cache_refusal(64, torch.bfloat16, "fp8_e5m2", 16, cap) is None


def test_cpu_selector_refuses_fp8_with_vllm_reason_on_this_cpu():
    """The CPU build's selector (``vllm_patches``) runs ``validate_configuration`` for SPEEDSFI: here
    fp8 starts where ``CPU_ATTN`` serves it and stops with its reason where it does not."""
    import vllm_ext
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    vllm_ext.register()
    plat = type(current_platform)
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=None)
    if cpu_serves_fp8():
        assert plat.get_attn_backend_cls(AttentionBackendEnum["SPEEDSFI"], cfg) == vllm_ext.BACKEND_PATH
    else:
        with pytest.raises(ValueError, match="AVX-512 or AMX"):
            plat.get_attn_backend_cls(AttentionBackendEnum["SPEEDSFI"], cfg)


def test_every_method_takes_fp8_at_start_up():
    """No method refuses an fp8 cache (every kernel reads fp8 pages with the layer's scales): the
    front end's checks pass with each spelling and every method on."""
    from vllm_ext.backend.startup import check_front_end_model
    from vllm_ext.config import SpeedSfiConfig

    model = SimpleNamespace(get_total_num_hidden_layers=lambda: 4, max_model_len=4096)
    every = SpeedSfiConfig.from_dict({"critiprefill": {"enabled": True}, "sfi": {"enabled": True},
                                      "speed": {"enabled": True, "l_cut": 3}})
    for spelling in FP8_SPELLINGS:
        check_front_end_model(every, SimpleNamespace(model_config=model,
                                                     cache_config=SimpleNamespace(cache_dtype=spelling)))


# ---------------------------------------------------------------------------------- page views
def test_stored_dtype_follows_the_writer():
    """The CPU build stores the spelling's format; vLLM's CUDA writes the platform's e4m3 for every
    fp8 spelling (fp8_e5m2 included)."""
    e4m3 = kv_quant.fp8_dtype("fp8")
    assert kv_quant.stored_dtype("fp8", on_cpu=True) == kv_quant.stored_dtype("fp8_e4m3", on_cpu=True) == e4m3
    assert kv_quant.stored_dtype("fp8_e5m2", on_cpu=True) == torch.float8_e5m2
    assert {kv_quant.stored_dtype(s, on_cpu=False) for s in FP8_SPELLINGS} == {e4m3}
    assert kv_quant.stored_dtype("auto") is None and kv_quant.stored_dtype("bfloat16") is None
    layer = fake_layer()
    assert kv_quant.layer_scales(layer) == (layer._k_scale, layer._v_scale)
    assert kv_quant.layer_scales(SimpleNamespace()) == (None, None)


HKV, G, D, BS = 2, 2, 32, 16
HQ = HKV * G


def _contexts(gen, lens):
    """A uint8 cache as vLLM allocates an fp8 one (LBNHC strides), its block table, and fp32 K/V of
    every position."""
    nb = sum(-(-n // BS) for n in lens) + 2
    raw = torch.zeros(nb, BS, HKV, 2 * D, dtype=torch.uint8).transpose(1, 2)
    bt = torch.zeros(len(lens), max(-(-n // BS) for n in lens), dtype=torch.int32)
    used = 1
    for i, n in enumerate(lens):
        k = -(-n // BS)
        bt[i, :k] = torch.arange(used, used + k, dtype=torch.int32)
        used += k
    slots = torch.cat([bt[i, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS for i, n in enumerate(lens)])
    key = torch.randn(slots.shape[0], HKV, D, generator=gen) * 3
    value = torch.randn(slots.shape[0], HKV, D, generator=gen) * 3
    return raw, bt, slots, key, value


def _dequantised(pages, k_scale=K_SCALE, v_scale=V_SCALE):
    out = pages.float()
    out[..., :D] *= k_scale
    out[..., D:] *= v_scale
    return out


@pytest.mark.parametrize("spelling", FP8_SPELLINGS)
def test_reference_dense_path_writes_and_reads_fp8_pages_with_the_scales(spelling):
    """The PyTorch dense path (the CPU build where ``CPU_ATTN``'s pages cannot be read) on vLLM's
    ``uint8`` allocation: its page view is the stored fp8 dtype, its write stores ``value / scale``
    rounded, and its rows equal dense attention over the pages dequantised explicitly."""
    from vllm_ext.backend.dense_path import ReferenceDense
    from vllm_ext.methods.protocol import DenseRows

    gen = torch.Generator().manual_seed(0)
    lens = [37, 70, 16]
    raw, bt, slots, key, value = _contexts(gen, lens)
    dense = ReferenceDense(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5,
                           kv_cache_dtype=spelling, rows=None)
    layer = fake_layer(kv_cache_dtype=spelling)
    pages = dense.pages(layer, None, raw, None)
    assert pages.dtype == kv_quant.stored_dtype(spelling, on_cpu=True)
    assert pages.data_ptr() == raw.data_ptr()
    dense.write_kv(layer, key, value, pages, slots)
    blk, off = slots // BS, slots % BS
    stored = pages[blk, :, off]
    assert torch.equal(kv_quant.as_bytes(stored[..., :D]),
                       kv_quant.as_bytes(kv_quant.quantize(key, K_SCALE, pages.dtype)))
    assert torch.equal(kv_quant.as_bytes(stored[..., D:]),
                       kv_quant.as_bytes(kv_quant.quantize(value, V_SCALE, pages.dtype)))
    # one decode query per request (the last position) and one 5-token chunk ending the last request
    qsl = [0, 1, 2, 7]
    query = torch.randn(qsl[-1], HQ, D, generator=gen)
    md = SimpleNamespace(block_table=bt, seq_lens_host=lens, query_start_loc_host=qsl)
    out = torch.full_like(query, 7.0)
    dense.attend(layer, query, None, None, pages, md, out, DenseRows(start=0, end=len(lens), host_plan=True))
    ref = torch.zeros_like(query)
    dense_paged_attention(query, _dequantised(pages), bt, qsl, lens, D ** -0.5, ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the scales matter: read without them the rows are far off
    unscaled = torch.zeros_like(query)
    dense_paged_attention(query, pages.float(), bt, qsl, lens, D ** -0.5, unscaled)
    assert (unscaled - ref).abs().max() > 0.1


class _RecordingImpl:
    """A stand-in for vLLM's CUDA attention impl: records the cache it is handed."""

    def __init__(self):
        self.caches = []

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.caches.append(kv_cache)

    def forward(self, layer, query, key, value, kv_cache, md, output):
        self.caches.append(kv_cache)


def test_delegate_gets_vllm_allocation_and_paged_decode_takes_the_scales():
    """CUDA's dense path: vLLM's impl is handed the ``uint8`` allocation (it views it itself), the
    methods the platform's e4m3 view; ``paged_decode`` (dense decode rows) reads the view with the
    layer's scales (its PyTorch twin here) and equals attention over the dequantised pages."""
    from vllm_ext.backend.dense_path import DelegateDense
    from vllm_ext.methods.protocol import DenseRows

    gen = torch.Generator().manual_seed(1)
    lens = [40, 17, 65]
    raw, bt, slots, key, value = _contexts(gen, lens)
    impl = _RecordingImpl()
    dense = DelegateDense(impl, paged_decode=True, max_rows=4, max_len=128, device=torch.device("cpu"),
                          num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5,
                          kv_cache_dtype="fp8_e5m2", rows=None)
    assert dense.page_dtype == kv_quant.stored_dtype("fp8_e5m2", on_cpu=False)       # e4m3: the writer's
    layer = fake_layer(kv_cache_dtype="fp8_e5m2")
    pages = dense.pages(layer, None, raw, None)
    stored = kv_quant.quantize(torch.cat([key / K_SCALE, value / V_SCALE], -1), None, pages.dtype)
    kv_quant.as_bytes(pages)[slots // BS, :, slots % BS] = kv_quant.as_bytes(stored)       # vLLM's write
    dense.write_kv(layer, key, value, pages, slots)
    assert impl.caches[-1].dtype == torch.uint8 and impl.caches[-1].data_ptr() == raw.data_ptr()
    query = torch.randn(len(lens), HQ, D, generator=gen)
    out = torch.full_like(query, 7.0)
    md = SimpleNamespace(num_decodes=len(lens), num_prefills=0, num_reqs=len(lens), block_table=bt,
                         seq_lens=torch.tensor(lens, dtype=torch.int32))
    with torch_kernels():
        dense.attend_decode_rows(layer, query, pages, md, out, DenseRows(0, len(lens), host_plan=False))
    deq = _dequantised(pages)
    for r, n in enumerate(lens):
        k, v = gather_kv(deq, bt[r], torch.arange(n))
        ref, _ = attention_over(query[r:r + 1], k, v, D ** -0.5)
        torch.testing.assert_close(out[r:r + 1], ref, atol=1e-5, rtol=1e-5)


def test_impl_warm_up_hands_the_page_view_and_the_scales():
    """The start-up warm-up compiles the variants the forward launches: the shares get the fp8 view
    of the layer's cache, the dense path the layer (its scales) too."""
    from vllm_ext.backend.dense_path import DelegateDense
    from vllm_ext.backend.impl import SpeedSfiImpl

    seen = []

    class Share:
        def warm_up(self, kv_cache, shape, dtype):
            seen.append(("share", kv_cache.dtype))
            return False

    class Dense(DelegateDense):
        def warm_up(self, layer, pages, shape, dtype):
            seen.append(("dense", pages.dtype, kv_quant.layer_scales(layer)[0]))
            return True

    layer = fake_layer()
    impl = object.__new__(SpeedSfiImpl)
    impl.layers = [Share()]
    impl.dense = Dense(None, paged_decode=True, max_rows=2, max_len=64, device=torch.device("cpu"),
                       num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=1.0, kv_cache_dtype="fp8", rows=None)
    impl._forward_context = {layer.layer_name: SimpleNamespace(impl=impl, **vars(layer))}
    impl._vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: 1, max_model_len=64),
        scheduler_config=SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64))
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = HQ, HKV, D, 1.0
    raw = torch.zeros(4, HKV, BS, 2 * D, dtype=torch.uint8)
    assert impl.warm_up(raw, None, torch.bfloat16)
    e4m3 = kv_quant.stored_dtype("fp8", on_cpu=False)
    assert seen[0] == ("share", e4m3)
    assert seen[1][:2] == ("dense", e4m3) and float(seen[1][2]) == pytest.approx(K_SCALE)


# --------------------------------------------------------------------------------------- SFI
def _sfi_problem(seed):
    from tests.test_sfi_path import LENS, Problem

    p = Problem(LENS, 2, "cpu", seed=seed)
    p.kv = p.kv * 3                       # values that use the fp8 range
    return p


def _run_sfi(p, kv, scales, compact_dtype, grid, cfg):
    """Two decode steps (slow rows select and gather, then fast rows read the compact segment) of
    SFI's path on ``kv`` with ``scales`` (the CPU build's kernels: the PyTorch twins, and the compiled
    passes over CPU_ATTN's packed pages where they are built and on); the outputs and the compact
    segments."""
    from tests.test_sfi_path import SLOTS, plan_for
    from vllm_ext.methods.sfi.path import sfi_decode
    from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
    from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

    layer = SfiLayerBuffers(5, 2, cfg, D, torch.float32, torch.device("cpu"))
    layer.compact_kv = torch.zeros(layer.compact_kv.shape, dtype=compact_dtype)
    rt = SfiRuntime(cfg, capacity=5, max_rows=len(p.lens), num_heads=p.hq, num_kv_heads=2, head_size=D,
                    max_len=max(p.lens) + 8, device=torch.device("cpu"))
    buffers = SfiPlanBuffers(len(p.lens), 5, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    outs = []
    with torch_kernels():
        for modes in grid:
            q = torch.randn(len(p.lens), p.hq, D, generator=gen)
            out = torch.full_like(q, 7.0)
            plan, t = plan_for(buffers, modes, p.lens, SLOTS, p.bt, p.device)
            sfi_decode(q, kv, p.bt, t, plan, cfg, layer, rt, 0, p.scale, out, dense_done=False,
                       fixed_launches=False, **scales)
            rt.ring.join()
            outs.append(out)
    return outs, layer.compact_kv, layer.compact_len


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_sfi_decode_on_fp8_pages_equals_sfi_on_the_dequantised_pages(fmt):
    """SFI's decode path (dense, slow and fast rows; the PyTorch twins) over fp8 pages with the
    layer's scales gives what it gives over the same pages dequantised to fp32 without scales: the
    same selections (compact lengths, and compact entries that are the pages' stored bytes), the
    same outputs. Without the scales it does not."""
    from tests.test_sfi_path import CFG, GRIDS

    p = _sfi_problem(seed=3)
    d = D
    fmax = torch.finfo(fmt).max
    kv8 = torch.empty_like(p.kv, dtype=fmt)
    kv8[..., :d] = (p.kv[..., :d] / K_SCALE).clamp(-fmax, fmax).to(fmt)
    kv8[..., d:] = (p.kv[..., d:] / V_SCALE).clamp(-fmax, fmax).to(fmt)
    ref_kv = _dequantised(kv8)
    ks, vs = torch.tensor([K_SCALE]), torch.tensor(V_SCALE)
    cfg = CFG
    for grid in (GRIDS[0], GRIDS[1]):
        outs8, ckv8, clen8 = _run_sfi(p, kv8, dict(k_scale=ks, v_scale=vs), fmt, grid, cfg)
        outs, ckv, clen = _run_sfi(p, ref_kv, {}, torch.float32, grid, cfg)
        assert torch.equal(clen8, clen) and int(clen.max()) > 0
        for s in range(ckv.shape[0]):
            n = int(clen[s])
            torch.testing.assert_close(_dequantised(ckv8[s, :, :n]), ckv[s, :, :n], atol=0, rtol=0)
        for o8, o in zip(outs8, outs):
            torch.testing.assert_close(o8, o, atol=1e-4, rtol=1e-4)
    unscaled, _, _ = _run_sfi(p, kv8, {}, fmt, GRIDS[0], cfg)
    assert (unscaled[-1] - outs[-1]).abs().max() > 0.1


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_sfi_decode_on_fp8_packed_pages_compiled_equals_the_twins(fmt, isa, monkeypatch):
    """The CPU build's path over CPU_ATTN's fp8 packings with the layer's scales: the compiled passes
    (the fused slow step: evidence with the slow rows' output, selection, gather; the fast step) give
    the twins' selections, compact bytes and outputs."""
    from tests.test_sfi_path import CFG, GRIDS
    from vllm_ext.kernels import cpu_native
    from vllm_ext.kernels.packed_pages import PackedPages

    if cpu_native.library() is None:
        pytest.skip("no C++ compiler here")
    p = _sfi_problem(seed=4)
    fmax = torch.finfo(fmt).max
    pages = PackedPages((p.kv / K_SCALE).clamp(-fmax, fmax).to(fmt).contiguous(), isa)
    scales = dict(k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor(V_SCALE))
    calls = []
    slow_rows = cpu_native.slow_rows
    monkeypatch.setattr(cpu_native, "slow_rows", lambda *a, **k: calls.append(slow_rows(*a, **k)) or calls[-1])
    for grid in (GRIDS[0], GRIDS[1]):
        monkeypatch.setenv(cpu_native.ENV, "0")
        ref = _run_sfi(p, pages, scales, fmt, grid, CFG)
        monkeypatch.delenv(cpu_native.ENV)
        calls.clear()
        got = _run_sfi(p, pages, scales, fmt, grid, CFG)
        assert calls and all(calls), "the compiled slow step did not take the fp8 pages"
        assert torch.equal(got[2], ref[2]) and int(ref[2].max()) > 0
        assert torch.equal(got[1].view(torch.uint8), ref[1].view(torch.uint8))
        for o, r in zip(got[0], ref[0]):
            torch.testing.assert_close(o, r, atol=2e-4, rtol=2e-4)


def test_sfi_layer_views_its_groups_as_the_attention_pages():
    """SFI's compact and Quest groups are allocated as the attention pages (``uint8`` for fp8) and read
    as their fp8 view: one view object per allocation (a binding is kept while it is)."""
    from vllm_ext.methods.sfi.layer import SfiLayer

    share = object.__new__(SfiLayer)
    share._views = {}
    share.page_dtype = kv_quant.stored_dtype("fp8_e5m2")
    holder = SimpleNamespace(layer_name="layers.0.attn.sfi_compact",
                             kv_cache=torch.zeros(3, HKV, BS, 2 * D, dtype=torch.uint8))
    view = share._pages_of(holder)
    assert view.dtype == torch.float8_e5m2 and view.data_ptr() == holder.kv_cache.data_ptr()
    assert share._pages_of(holder) is view
    holder.kv_cache = torch.zeros(3, HKV, BS, 2 * D, dtype=torch.uint8)      # vLLM's allocation replaced
    assert share._pages_of(holder) is not view
    share.page_dtype = None                                                  # a 16-bit cache: as it is
    bf16 = SimpleNamespace(layer_name="x", kv_cache=torch.zeros(1, dtype=torch.bfloat16))
    assert share._pages_of(bf16) is bf16.kv_cache


def test_sfi_groups_take_the_attention_page_format_and_half_the_bytes():
    """With an fp8 cache SFI's compact group is ``uint8`` pages of the attention layer's format: a
    compact entry is ``2 D`` bytes (half of bf16's), the segment takes as many blocks, the kept
    positions (int32) and prompt-tail queries (the model's dtype) take the blocks their bytes need;
    the token history stays one int32 per position."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.history_kv_spec import history_spec_for
    from vllm_ext.methods.sfi.kv_spec import compact_spec_for
    from vllm_ext.methods.sfi.state_pages import sfi_state_pages

    cfg = SfiConfig(enabled=True, k=256, n_sink=4, keep_prefill=64)
    geo = dict(block_size=32, num_kv_heads=2, head_size=64)
    fp8 = FullAttentionSpec(**geo, dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    bf16 = FullAttentionSpec(**geo, dtype=torch.bfloat16)
    c8 = compact_spec_for(fp8, cfg, num_heads=4, act_dtype=torch.bfloat16)
    c16 = compact_spec_for(bf16, cfg, num_heads=4, act_dtype=torch.bfloat16)
    assert (c8.dtype, c8.kv_quant_mode) == (torch.uint8, KVQuantMode.FP8_PER_TENSOR)
    assert c8.page_size_bytes == fp8.page_size_bytes == bf16.page_size_bytes // 2
    p8 = sfi_state_pages(cfg, **geo, num_heads=4, cache_dtype=torch.float8_e4m3fn, act_dtype=torch.bfloat16)
    p16 = sfi_state_pages(cfg, **geo, num_heads=4, cache_dtype=torch.bfloat16, act_dtype=torch.bfloat16)
    assert p8.segment == p16.segment == -(-(cfg.n_sink + cfg.k) // 32)
    kept_bytes, tail_bytes = 2 * cfg.keep_prefill * 4, cfg.w_prefill * 4 * 64 * 2
    assert (p8.kept, p8.tail) == (-(-kept_bytes // c8.page_size_bytes), -(-tail_bytes // c8.page_size_bytes))
    assert p8.tail > 0 and c8.compact_blocks == p8.total
    # the segment's bytes per request: n_sink + k entries of 2 D bytes per KV head
    seg_bytes = p8.segment * c8.page_size_bytes
    assert seg_bytes == p16.segment * c16.page_size_bytes // 2
    h8 = history_spec_for(fp8, max_len=4096)
    assert h8.page_elems == fp8.page_size_bytes // 4


def test_every_compiled_cpu_pass_reads_fp8_pages_and_nothing_falls_back(monkeypatch, caplog):
    """The compiled CPU passes (evidence, gather, fast step) read fp8 pages as they read bf16 / fp32
    ones (tests/kernels/test_cpu_native.py, test_cpu_gather_compact.py, test_cpu_two_segment.py
    compare them with the twins): an fp8 cache brings no fallback of its own at engine start."""
    import logging

    from vllm_ext import metrics
    from vllm_ext.kernels import cpu_native
    from vllm_ext.methods.sfi.method import SfiMethod

    assert all(cpu_native.reads_pages(t) for t in (torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                                                   torch.float8_e5m2))
    assert not cpu_native.reads_pages(torch.float16)
    monkeypatch.setattr(cpu_native, "library", lambda: object())      # a built library
    metrics.reset()
    method = object.__new__(SfiMethod)
    method._cpu_kernels_checked = False
    with caplog.at_level(logging.WARNING):
        method.load_cpu_kernels()
    assert not [k for k in metrics.snapshot() if k.startswith("fallback.")]
    assert not caplog.records
    metrics.reset()
