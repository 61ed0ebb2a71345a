"""What a speculative-decoding verification step costs: attention of q_len query tokens a sequence.

    pip install ./python && python examples/python/verify_steps.py [--scheme kivi2]

Prefills a batch of long sequences into a kvq.engine.PagedCache whose plan takes up to 8 query
tokens a sequence, then times `attend` of 1, 2, 4 and 8 query tokens a sequence (each token
causal over the cache and the step's earlier tokens) on the GPU: one call captured in a CUDA
graph, replayed between CUDA events (medians of 50), printed with its ratio to one token.
"""

import argparse
import statistics

import torch

import kvq
from kvq.engine import PagedCache


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="kivi2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    b, t, d = args.batch, args.context, args.head_dim
    limits = dict(head_dim=d, q_heads=32, kv_heads=8, max_seqs=b, max_seq_len=t + 8,
                  max_q_len=8, dtype=torch.float16)
    pages = kvq.Plan(args.scheme, pool_pages=1, **limits).max_pages_per_seq
    plan = kvq.Plan(args.scheme, pool_pages=b * pages, **limits)
    cache = PagedCache(plan, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s in range(b):  # one sequence at a time keeps the staging tensors small
        k = torch.randn((t, 8, d), generator=gen, device="cuda").half()
        v = torch.randn((t, 8, d), generator=gen, device="cuda").half()
        cache.prefill([s], [t], k, v)
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    times = {}
    for q_len in (1, 2, 4, 8):
        q = torch.randn((b, q_len, 32, d), generator=gen, device="cuda").half()
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cache.attend(slots, q, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.attend(slots, q, out=out, lse=lse)
        xs = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            xs.append(start.elapsed_time(end) * 1000)
        if not torch.isfinite(out).all():
            raise SystemExit(f"q_len {q_len}: the output is not finite")
        times[q_len] = statistics.median(xs)
    print(f"{args.scheme}, batch {b} × {t} tokens, 32 q / 8 KV heads, head_dim {d}, f16: "
          "GPU time of an attend (graph replay)")
    for q_len, us in times.items():
        print(f"  q_len {q_len}: {us:.1f} µs ({us / times[1]:.2f}× one token)")


if __name__ == "__main__":
    main()
