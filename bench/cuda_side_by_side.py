#!/usr/bin/env python3
"""Side-by-side timings on a CUDA device: PyTorch SDPA (flash, cuDNN) for the issue-5 shapes,
plus the measured ceilings (device copy bandwidth, bf16 GEMM). attnrt's own numbers come from
`attnrt_gpu_tests --gtest_filter=*Bench*` (ATTNRT_GPU_BENCH=1), run by scripts/device_cuda.sh.
Prints one line per (shape, backend): median ms over CUDA-event-timed repeats."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    x = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), 10)
    print(f"CEIL copy {2 * x.numel() / ms / 1e9:.2f} TB/s")
    del x, y
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = bench(lambda: a @ b, 10)
    print(f"CEIL bf16 gemm {2 * 8192**3 / ms / 1e9:.1f} TFLOP/s")
    hq, hkv, d = 32, 8, 128
    for name, bsz, s in [("prefill 4k x4", 4, 4096), ("prefill 16k", 1, 16384), ("prefill 64k", 1, 65536)]:
        q = torch.randn(bsz, hq, s, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(bsz, hkv, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4.0 * bsz * hq * d * s * (s + 1) / 2
        for be_name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
            try:
                with sdpa_kernel(be):
                    ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 10)
                print(f"SDPA {name:16s} {be_name:6s} {ms:9.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
            except Exception as e:  # report, don't hide
                print(f"SDPA {name:16s} {be_name:6s} failed: {str(e)[:100]}")
    for name, bsz, s in [("decode 1x128k", 1, 131072), ("decode 32x8k", 32, 8192), ("decode 64x32k", 64, 32768)]:
        q = torch.randn(bsz, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(bsz, hkv, s, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kvb = 2.0 * k.numel() * 2
        for be_name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
            try:
                with sdpa_kernel(be):
                    ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 20)
                print(f"SDPA {name:16s} {be_name:6s} {ms:9.3f} ms {kvb / ms / 1e9:8.2f} TB/s(kv)")
            except Exception as e:
                print(f"SDPA {name:16s} {be_name:6s} failed: {str(e)[:100]}")


if __name__ == "__main__":
    main()
