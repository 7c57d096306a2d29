#!/usr/bin/env python3
"""Side by side on a CUDA device, in one run: attnrt's dense ops through
`attnrt bench --device cuda:0 --suite cuda-dense --json` and PyTorch
scaled_dot_product_attention (flash and cuDNN backends) on the same shapes (Hq=32, Hkv=8,
d=128, bf16; causal prefill 4k x 4, 16k, 64k; decode 1 x 128k, 32 x 8k, 64 x 32k), plus the
measured ceilings (large device copy, bf16 GEMM). attnrt runs through its paged cache (pages of
64 scattered, 128, and one page per request); torch runs contiguous tensors.

Usage: cuda_side_by_side.py [path/to/attnrt] [--m3]   (default build/bin/attnrt)
Prints one table; the last column is attnrt's speed over the cuDNN backend's.
--m3: instead, dense decode at the MiniMax-M3 per-rank shape (Hq=16, Hkv=1, d=128, bf16) through
torch's cuDNN and flash backends, timed as attnrt_gpu_sm90_tests' BenchM3 times sparse decode (one
call captured in a CUDA graph, replayed after L2 is evicted, median of 20), so that the two compare
on the same card in one device session; each peer twice, L2 evicted by a 256 MB memset and by a
256 MB read (BenchM3 with ATTNRT_GPU_BENCH_FLUSH=read)."""
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(fn, reps=20, before=None):
    """Median ms of fn over reps timed calls after 3 untimed ones; before(), if given, runs
    untimed ahead of each timed call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def attnrt_cases(exe):
    out = subprocess.run([exe, "bench", "--device", "cuda:0", "--suite", "cuda-dense", "--json",
                          "--repeat", "7"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def sdpa_ms(bsz, s, prefill, backend, hq=32, hkv=8, d=128):
    dev = torch.device("cuda")
    q = torch.randn(bsz, hq, s if prefill else 1, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(bsz, hkv, s, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(backend):
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=prefill,
                                                            enable_gqa=True), 10 if prefill else 20)


def cold_graph_ms(fn, reps=20, read_flush=False):
    """Median ms of fn captured in a CUDA graph, each replay after L2 is evicted: by a 256 MB
    memset, or with read_flush by a reduction that reads 256 MB (no dirty lines left in L2 to
    write back, as BenchM3's ATTNRT_GPU_BENCH_FLUSH=read)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    evict = (lambda: flush.view(torch.int64).sum()) if read_flush else flush.zero_
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, reps, before=evict)


def m3_dense_decode():
    """Dense decode peers at the shapes of BenchM3 (sparse decode, M3 per rank)."""
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'M3 dense decode':24s} {'cudnn ms':>9s} {'flash ms':>9s} {'cudnn read':>10s} "
          f"{'flash read':>10s}  (Hq=16 Hkv=1 d=128 bf16, CUDA graph, L2 evicted by a memset or "
          "by a read, median of 20)")
    dev = torch.device("cuda")
    for bsz, ctx in ((1, 65536), (1, 131072), (16, 65536), (64, 65536), (64, 131072)):
        q = torch.randn(bsz, 16, 1, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(bsz, 1, ctx, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            for read in (False, True):
                key = name + (" read" if read else "")
                try:
                    with sdpa_kernel(be):
                        row[key] = cold_graph_ms(
                            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                            read_flush=read)
                except Exception as e:  # report, do not hide
                    print(f"SDPA {key} failed at {bsz}x{ctx}: {str(e)[:100]}")
        del q, k, v
        torch.cuda.empty_cache()
        nan = float("nan")
        print(f"{f'{bsz} x {ctx // 1024}k':24s} {row.get('cudnn', nan):9.4f} "
              f"{row.get('flash', nan):9.4f} {row.get('cudnn read', nan):10.4f} "
              f"{row.get('flash read', nan):10.4f}")
    sys.stdout.flush()


def main():
    args = [x for x in sys.argv[1:] if not x.startswith("--")]
    if "--m3" in sys.argv[1:]:
        return m3_dense_decode()
    exe = args[0] if args else "build/bin/attnrt"
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    res = attnrt_cases(exe)
    dev = torch.device("cuda")
    x = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_tbs = 2 * x.numel() / bench(lambda: y.copy_(x), 10) / 1e9
    del x, y
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    gemm_tf = 2 * 8192 ** 3 / bench(lambda: a @ b, 10) / 1e9
    del a, b
    print(f"CEIL copy {copy_tbs:.2f} TB/s   bf16 GEMM {gemm_tf:.1f} TFLOP/s")
    peer = {}
    hdr = f"{'shape':24s} {'attnrt ms':>10s} {'rate':>14s} {'flash ms':>9s} {'cudnn ms':>9s} " \
          f"{'x flash':>8s} {'x cudnn':>8s} {'%ceil':>6s}"
    print(hdr)
    for c in res["cases"]:
        prefill = c["op"] == "dense_extend"
        key = (c["batch"], c["kv_len"], prefill)
        if key not in peer:
            peer[key] = {}
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    peer[key][name] = sdpa_ms(c["batch"], c["kv_len"], prefill, be)
                except Exception as e:  # report, do not hide
                    print(f"SDPA {name} failed for {c['case']}: {str(e)[:100]}")
            torch.cuda.empty_cache()
        ms = c["median_ms"]
        if prefill:
            rate, ceil = f"{c['gflops'] / 1e3:8.1f} TFLOP/s", c["gflops"] / 1e3 / gemm_tf
        else:
            rate, ceil = f"{c['gbps'] / 1e3:8.2f} TB/s ", c["gbps"] / 1e3 / copy_tbs
        fl, cu = peer[key].get("flash"), peer[key].get("cudnn")
        print(f"{c['case']:24s} {ms:10.3f} {rate:>14s} {fl or float('nan'):9.3f} "
              f"{cu or float('nan'):9.3f} {(fl / ms) if fl else float('nan'):7.2f}x "
              f"{(cu / ms) if cu else float('nan'):7.2f}x {100 * ceil:5.1f}%")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
