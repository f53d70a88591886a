import torch, triton, time, sys
from vllm_ext.kernels.two_segment_decode import two_segment_decode, two_segment_workspace
from vllm_ext.kernels.dense_decode_evidence import paged_decode, dense_decode_with_evidence
dev = "cuda"
B, Hq, Hkv, D, BS, L = 16, 32, 8, 128, 16, 16384
nb = B * L // BS
kv = torch.randn(nb, BS, Hkv, 2 * D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
bt = torch.randperm(nb, device=dev, dtype=torch.int32).reshape(B, L // BS)
seq = torch.full((B,), L, dtype=torch.int32, device=dev)
q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(q)
def gbs(bytes_, ms): return bytes_ / ms / 1e6
for ns in (1, 2, 4, 8, 16, None):
    f = lambda: paged_decode(q, kv, bt, seq, D ** -0.5, out, num_splits=ns)
    ms = triton.testing.do_bench(f, warmup=50, rep=200)
    print(f"dense splits={ns}: {ms*1e3:.1f} us  {gbs(B*L*Hkv*2*D*2, ms):.0f} GB/s", flush=True)
for frac in (0.016, 0.125, 0.5):
    keep = int(L * frac)
    rec = min(256, keep // 2)
    cap = keep - rec
    ckv = torch.randn(B, Hkv, cap, 2 * D, device=dev, dtype=torch.bfloat16)
    clen = torch.full((B,), cap, dtype=torch.int32, device=dev)
    slot = torch.arange(B, dtype=torch.int32, device=dev)
    rs = seq - rec
    for ns in (1, 2, 4, None):
        f = lambda: two_segment_decode(q, kv, bt, seq, rs, ckv, clen, slot, D ** -0.5, out, num_splits=ns, max_recent=rec)
        ms = triton.testing.do_bench(f, warmup=50, rep=200)
        print(f"sparse {frac} keep={keep} splits={ns}: {ms*1e3:.1f} us  {gbs(B*keep*Hkv*2*D*2, ms):.0f} GB/s", flush=True)
ev = torch.empty(B, Hkv, L, device=dev)
lo = torch.full((B,), 4, dtype=torch.int32, device=dev); hi = seq - 256
f = lambda: dense_decode_with_evidence(q, kv, bt, seq, lo, hi, D ** -0.5, out, ev)
ms = triton.testing.do_bench(f, warmup=20, rep=100)
print(f"dense+evidence: {ms*1e3:.1f} us", flush=True)
x = torch.empty(1 << 30, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50)
print(f"copy 1GiB: {ms:.3f} ms, {2*(1<<30)/ms/1e6:.0f} GB/s (r+w)", flush=True)
