"""SPEED's start-up warm-up: the upper layers' attention kernel."""

from __future__ import annotations

import torch

from vllm_ext.methods.warmup import WarmupShape, synthetic_block_table

def warm_up_speed_layer(*, kv_cache: torch.Tensor, num_heads: int, head_size: int, scale: float,
                        dtype: torch.dtype, shape: WarmupShape, anchor_end: int, self_only: bool,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """SPEED's upper-layer attention (one kernel; the token count is its grid, not an argument).
    ``k_scale``/``v_scale``: the layer's, as the forward passes them (fp8 pages: the scaled variant)."""
    from vllm_ext.kernels.speed_attention import speed_attention

    device = kv_cache.device
    bt = synthetic_block_table(shape, 2, kv_cache.shape[0], device)
    for n in (1, 3):
        # the dtypes of the plan's buffers (``vllm_ext.methods.speed.visibility.SpeedPlanBuffers``)
        q = torch.randn(n, num_heads, head_size, dtype=dtype, device=device)
        rows = torch.zeros(n, dtype=torch.int64, device=device)
        positions = torch.arange(40, 40 + n, dtype=torch.int64, device=device)
        tail = torch.full((max(shape.max_rows, 1),), 39, dtype=torch.int32, device=device)
        speed_attention(q, kv_cache, bt, rows, positions, tail, anchor_end, self_only, scale,
                        torch.empty_like(q), k_scale=k_scale, v_scale=v_scale)
