"""A paged batch decoded through kvq from PyTorch, one step captured in a CUDA graph.

    pip install ./python && python examples/python/graph_decode.py [--scheme kivi2]

Prefills a batch of prompts into a kvq.engine.PagedCache, then runs decode steps (append the new
token's K/V, attend one query token a sequence) eagerly and as replays of a captured CUDA graph,
checks that both give the same bits, and prints the time of a step each way (CUDA events, median
of 200 steps), and the host time of an eager step through PagedCache, through the torch custom
ops and straight into kvq's extension: the graph takes the Python and launch overhead out of the step.
"""

import argparse
import statistics
import time

import torch

import kvq
from kvq.engine import PagedCache


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="kivi2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    q_heads, kv_heads, d, b = 32, 8, args.head_dim, args.batch
    max_len = args.prompt + 800
    pages = kvq.Plan(args.scheme, head_dim=d, q_heads=q_heads, kv_heads=kv_heads, max_seqs=b,
                     max_seq_len=max_len, pool_pages=1).max_pages_per_seq
    plan = kvq.Plan(args.scheme, head_dim=d, q_heads=q_heads, kv_heads=kv_heads, max_seqs=b,
                    max_seq_len=max_len, pool_pages=b * pages)
    caches = [PagedCache(plan, "cuda") for _ in range(2)]  # eager, graphed
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((b * args.prompt, kv_heads, d), generator=gen, device="cuda").half()
    v = torch.randn((b * args.prompt, kv_heads, d), generator=gen, device="cuda").half()
    for c in caches:
        c.prefill(list(range(b)), [args.prompt] * b, k, v)
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    kn = torch.zeros((b, kv_heads, d), dtype=torch.float16, device="cuda")
    vn, q = torch.zeros_like(kn), torch.zeros((b, q_heads, d), dtype=torch.float16, device="cuda")

    def step(cache):
        cache.append(slots, kn, vn)
        return cache.attend(slots, q)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _ = step(caches[1])
    times = {"eager": [], "graph": []}
    host = {"PagedCache (eager)": [], "torch.ops.kvq.*": [], "extension": []}
    for t in range(200):
        kn.normal_(generator=gen), vn.normal_(generator=gen), q.normal_(generator=gen)
        for name in times:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if name == "eager":
                e_out, _ = step(caches[0])
            else:
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000)
        if not torch.equal(e_out.view(torch.int16), g_out.view(torch.int16)):
            raise SystemExit(f"step {t}: the graph's output differs from the eager step's")
    # Host time of the calls alone: through torch.ops.kvq.*, and the extension's own entry points
    # (what the ops call, without torch's dispatch), each on a third cache kept in step.
    probe = PagedCache(plan, "cuda")  # kept in step by every call below (3 tokens an iteration)
    probe.prefill(list(range(b)), [args.prompt] * b, k, v)
    stream = torch.cuda.current_stream().cuda_stream
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    ptrs = [t.data_ptr() for t in probe._buffers()]
    buffers = probe._buffers()
    for t in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(probe)
        host["PagedCache (eager)"].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.ops.kvq.append(probe._id, *buffers, slots, kn.unsqueeze(1), vn.unsqueeze(1))
        torch.ops.kvq.attend(probe._id, *buffers, slots, q.unsqueeze(1), probe.workspace)
        host["torch.ops.kvq.*"].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan._append(ptrs, stream, b, 1, slots.data_ptr(), kn.data_ptr(), vn.data_ptr())
        plan._attend(ptrs, stream, b, 1, slots.data_ptr(), q.data_ptr(), out.data_ptr(),
                     lse.data_ptr(), probe.workspace.data_ptr())
        host["extension"].append((time.perf_counter() - t0) * 1e6)
    print(f"{args.scheme}, batch {b}, {args.prompt} + 200 tokens, head_dim {d}, "
          f"{q_heads} q / {kv_heads} KV heads: identical outputs every step")
    for name, xs in times.items():
        print(f"  {name}: {statistics.median(xs):.1f} µs a step (append + attend) on the GPU")
    for name, xs in host.items():
        print(f"  host time of the calls, {name}: {statistics.median(xs):.1f} µs a step")


if __name__ == "__main__":
    main()
