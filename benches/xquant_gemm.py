#!/usr/bin/env python3
"""The tensor-core ceiling for XQuant's K rebuild: a cuBLAS GEMM of the rebuild's shape.

XQuant's decode rebuilds K as [B·L × R] latents times up_k's [R × kv_heads·head_dim]; at the
benchmarks' shape (R = 1,024, 8 KV heads of 128) that is `torch.matmul` of [B·L × 1024] by
[1024 × 1024] in f16. This script times that GEMM for the rows of each (batch, context) pair, so
`kvq bench --schemes xquant2` can be read as a share of it (docs/BENCHMARKS.md, *XQuant on the
GPU*): CUDA events around one matmul, the median of `--runs` after `--warmup` calls. The inputs
are not rotated: from 32,768 rows on A (64 MiB) is past L2 anyway; below that cuBLAS may read it
from L2, which only raises the ceiling the decode is compared with.

    python3 benches/xquant_gemm.py --batch 1,16 --context 4K,32K
"""

import argparse
import statistics
import sys

from common import parse_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--context", default="4K,32K", help="context lengths, comma-separated (K = 1024)")
    ap.add_argument("--rank", type=int, default=1024, help="latent width R (the GEMM's K)")
    ap.add_argument("--columns", type=int, default=1024, help="kv_heads·head_dim (the GEMM's N)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("xquant_gemm: needs PyTorch")
    if not torch.cuda.is_available():
        sys.exit("xquant_gemm: needs a CUDA GPU")
    b = torch.randn(args.rank, args.columns, device="cuda", dtype=torch.half)
    # The GPU's clocks ramp up under load: a tenth of a second of GEMMs first, so the first shape
    # is not timed on an idle GPU. The rate still varies from call to call with the GPU's state
    # (docs/BENCHMARKS.md gives the spread): compare a decode with the GEMM of the same call.
    warm = torch.randn(65536, args.rank, device="cuda", dtype=torch.half)
    for _ in range(500):
        torch.matmul(warm, b)
    torch.cuda.synchronize()
    del warm
    print("| rows (B·L) | B | L | µs | TFLOP/s |")
    print("|---:|---:|---:|---:|---:|")
    for batch in parse_tokens(args.batch):
        for context in parse_tokens(args.context):
            rows = batch * context
            a = torch.randn(rows, args.rank, device="cuda", dtype=torch.half)
            for _ in range(args.warmup):
                torch.matmul(a, b)
            times = []
            for _ in range(args.runs):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                torch.matmul(a, b)
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop))
            ms = statistics.median(times)
            tflops = 2 * rows * args.rank * args.columns / (ms * 1e-3) / 1e12
            print(f"| {rows} | {batch} | {context} | {ms * 1e3:.1f} | {tflops:.0f} |")
            del a


if __name__ == "__main__":
    main()
