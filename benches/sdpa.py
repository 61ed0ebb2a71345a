#!/usr/bin/env python3
"""PyTorch SDPA decode baseline for `kvq bench` tables.

Times one decode step (q_len = 1) of torch.nn.functional.scaled_dot_product_attention over a dense
FP16/BF16 cache, with the same method kvq's bench uses: CUDA events, the median of many runs,
enough cache copies to rotate through that no run finds its K/V in L2, and the device-to-device
copy bandwidth measured in the same process. Prints a markdown table and, with --json, writes the
rows. Backends are tried in the order given (cuDNN first) and the one that ran is reported.

    python3 benches/sdpa.py --batch 16 --context 32K --head-dim 80,96,128 --json sdpa.json
"""

import argparse
import json
import statistics
import sys

from common import parse_tokens


def parse_ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def median_ms(torch, fn, runs, warmup):
    for _ in range(warmup):
        fn(0)
    times = []
    for i in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i + 1)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_gbps(torch, gib, runs, warmup):
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda _i: dst.copy_(src), runs, warmup)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", default="4K,32K,128K")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", default="128")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16"])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--mem-budget-gib", type=float, default=60.0)
    ap.add_argument("--backends", default="cudnn,flash,efficient,math")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"sdpa.py: needs PyTorch: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sdpa.py: no CUDA device", file=sys.stderr)
        return 2

    names = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in names:
            print(f"sdpa.py: unknown backend `{b}` (known: {', '.join(names)})", file=sys.stderr)
            return 2
    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy = copy_gbps(torch, args.copy_gib, args.runs, args.warmup)
    device = torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__}, copy {copy:.0f} GB/s", file=sys.stderr)

    rows = []
    for d in parse_ints(args.head_dim):
        for b in parse_ints(args.batch):
            for n in parse_tokens(args.context):
                kv_bytes = 2 * b * args.kv_heads * n * d * 2
                # Enough copies that consecutive runs never share K/V, past 3x the L2.
                copies = max(1, -(-3 * l2 // kv_bytes))
                if kv_bytes * copies > args.mem_budget_gib * 2**30:
                    print(f"skip d={d} B={b} L={n}: over the memory budget", file=sys.stderr)
                    continue
                g = torch.Generator(device="cuda").manual_seed(1)
                kv = [
                    (
                        torch.randn(b, args.kv_heads, n, d, dtype=dtype, device="cuda", generator=g),
                        torch.randn(b, args.kv_heads, n, d, dtype=dtype, device="cuda", generator=g),
                    )
                    for _ in range(copies)
                ]
                q = torch.randn(b, args.q_heads, 1, d, dtype=dtype, device="cuda", generator=g)
                ran, ms = None, None
                gqa = args.q_heads != args.kv_heads

                def step(i):
                    k, v = kv[i % copies]
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

                for name in backends:
                    with sdpa_kernel(names[name]):
                        try:
                            step(0)
                            torch.cuda.synchronize()
                        except RuntimeError:
                            continue
                        ms = median_ms(torch, step, args.runs, args.warmup)
                    ran = name
                    break
                del kv
                torch.cuda.empty_cache()
                if ran is None:
                    print(f"d={d} B={b} L={n}: no backend ran", file=sys.stderr)
                    continue
                us = ms * 1e3
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                rows.append(
                    dict(head_dim=d, batch=b, context=n, backend=ran, us=us, gbps=gbps,
                         copy_gbps=copy, pct_copy=100 * gbps / copy, device=device)
                )

    print("| head_dim | B | L | backend | µs | GB/s | % copy |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {r['backend']} | "
              f"{r['us']:.1f} | {r['gbps']:.0f} | {r['pct_copy']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
