#!/usr/bin/env python3
"""CommVQ's own Triton decode kernels, timed for the side-by-side with `kvq bench --schemes commvq1`.

CommVQ's release (UMass-Embodied-AGI/CommVQ, `commvq/triton_kernels.py`) decodes LLaMA-3.1-8B at
1 bit with three Triton kernels and PyTorch between them. This script imports that file from a
checkout (`--repo`; nothing of it is copied here) and times one decode step over the compressed
part of the cache, as their `modeling_llama_triton.py` runs it:

  1. `calculate_QC_T_triton`: the query times every key codebook entry (32 q heads × 64 pairs × R
     rounds × 64 entries);
  2. `gatherC1C2_and_sum_over_residual_and_apply_rope_and_sum`: per token, the entries its codes
     select, summed over the rounds, rotated by RoPE through the sin/cos tables, times the scale;
  3. PyTorch's softmax over the scores (f32, back to bf16), as their attention does;
  4. `attn_weights_mul_value_triton`: the weights times the 1024-bit value codes (8 tokens a byte),
     then one matmul with the 1024-row value codebook (its autotuner limited to the configs of 16
     query heads a program, the only ones whose indexing covers every head).

Their FP16 recent-token window (a PyTorch matmul over at most their residual length) is not timed.
Shapes are theirs: 32 query / 8 KV heads, head_dim 128, key codes of R rounds (`--rounds`, 10 for
kvq's CommVQ-1 at the same bits), bf16. Inputs are random (the kernels' speed does not depend on
the values). Method as benches/sdpa.py: CUDA events, the median of `--runs`, after their autotuner
has run, with enough input copies to rotate through that no step finds its cache in L2.

    python3 benches/commvq_triton.py --repo /path/to/CommVQ --batch 1,16 --context 4K,32K
"""

import argparse
import json
import math
import statistics
import sys

from common import parse_tokens


def median_ms(torch, fn, runs, warmup):
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(warmup + i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def cache_set(torch, batch, tokens, rounds, dev):
    """One sequence batch's compressed cache in their layout."""
    bf16 = torch.bfloat16
    return {
        # [B, 8 KV heads, R, N] int16 codes a·64 + b.
        "key_code": torch.randint(0, 4096, (batch, 8, rounds, tokens), dtype=torch.int16, device=dev),
        # One scale a token (their span over all heads), [B, 1, N, 1].
        "key_prescale": torch.rand(batch, 1, tokens, 1, dtype=bf16, device=dev) + 0.5,
        # 1024 code bits a token, 8 tokens a byte: [B, N/8, 1024].
        "value_code": torch.randint(0, 256, (batch, tokens // 8, 1024), dtype=torch.uint8, device=dev),
        "value_prescale": torch.rand(batch, tokens, 1, dtype=bf16, device=dev) + 0.5,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", required=True, help="a checkout of UMass-Embodied-AGI/CommVQ")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", default="4K,32K")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--l2-bytes", type=float, default=60 * 2**20, help="inputs rotate past 2x this")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, args.repo)
    from commvq import triton_kernels as tk

    # Their value kernel derives the batch from the program id assuming 16 query heads a program
    # (batch = pid >> 1 with 32 heads); its other autotune configs skip heads, so time only those
    # that compute the whole output.
    value_kernel = tk.attn_weights_mul_value_kernel
    value_kernel.configs = [c for c in value_kernel.configs if c.kwargs["H_SIZE"] == 16]

    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    rounds, q_heads, pairs = args.rounds, 32, 64
    # Their key codebook as the kernels take it: [32 q heads, 64 pairs, R, 64 entries, 2, 2].
    centers = torch.randn(q_heads, pairs, rounds, 64, 2, 2, dtype=bf16, device=dev)
    learnable_scale = torch.rand(1024, dtype=bf16, device=dev) + 0.5
    codebook = torch.randn(q_heads, 1024, 128, dtype=bf16, device=dev) * 0.05
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for tokens in parse_tokens(args.context):
            one = cache_set(torch, batch, tokens, rounds, dev)
            set_bytes = sum(t.numel() * t.element_size() for t in one.values())
            copies = max(1, math.ceil(2 * args.l2_bytes / set_bytes))
            sets = [one] + [cache_set(torch, batch, tokens, rounds, dev) for _ in range(copies - 1)]
            sin = torch.rand(tokens, pairs, dtype=bf16, device=dev)
            cos = torch.rand(tokens, pairs, dtype=bf16, device=dev)
            query = torch.randn(batch, q_heads, 1, pairs, 2, dtype=bf16, device=dev)

            def step(i):
                s = sets[i % len(sets)]
                qc = tk.calculate_QC_T_triton(query, centers)
                scores = tk.gatherC1C2_and_sum_over_residual_and_apply_rope_and_sum(
                    s["key_code"], qc, sin, cos, s["key_prescale"], factor=math.sqrt(128)
                )
                weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(bf16)
                return tk.attn_weights_mul_value_triton(
                    attn_weights=weights,
                    value_code=s["value_code"],
                    prescale=s["value_prescale"],
                    learnable_scale=learnable_scale,
                    eps=1e-6,
                    codebook=codebook,
                )

            out = step(0)
            assert out.shape == (batch, q_heads, 1, 128), out.shape
            ms = median_ms(torch, step, args.runs, args.warmup)
            rows.append({"batch": batch, "context": tokens, "rounds": rounds, "us": ms * 1e3, "copies": copies})
            print(f"CommVQ Triton, B={batch} L={tokens}: {ms * 1e3:.1f} us ({copies} input copies)", flush=True)
            del sets, one
            torch.cuda.empty_cache()
    print()
    print("| batch | context | CommVQ Triton µs |")
    print("|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
