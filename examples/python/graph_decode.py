"""A paged batch decoded through kvq from PyTorch, one step captured in a CUDA graph.

    pip install ./python && python examples/python/graph_decode.py [--scheme kivi2]

Prefills a batch of prompts into a kvq.engine.PagedCache, then runs decode steps (append the new
token's K/V, attend one query token a sequence) eagerly and as replays of a captured CUDA graph,
checks that both give the same bits, and prints the time of a step each way (CUDA events, median
of 200 steps; and replays back to back), and the host time of each call through PagedCache,
through the torch custom ops and straight into kvq's extension: the graph takes the Python and
launch overhead out of the step.
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
    max_len = args.prompt + 1000  # the probe cache below takes 800 steps
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
    # GPU time of a step when the host keeps ahead: graph replays back to back between two events
    # (what crates/kvq-capi's step_host_time example measures for the Rust launches).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) * 1000 / 200
    # Host time of each call, the GPU idle before it: through PagedCache (allocating the output,
    # and into the caller's buffers), through torch.ops.kvq.* and straight into the extension,
    # each on a third cache kept in step (a token an iteration for each way).
    probe = PagedCache(plan, "cuda")
    probe.prefill(list(range(b)), [args.prompt] * b, k, v)
    stream = torch.cuda.current_stream().cuda_stream
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    steps, buffers = probe._steps, probe._buffers()
    ways = {
        "PagedCache": (lambda: probe.append(slots, kn, vn), lambda: probe.attend(slots, q)),
        "PagedCache, out= and lse= given": (
            lambda: probe.append(slots, kn, vn), lambda: probe.attend(slots, q, out=out, lse=lse)),
        "torch.ops.kvq.*": (
            lambda: torch.ops.kvq.append(probe._id, *buffers, slots, kn.unsqueeze(1),
                                         vn.unsqueeze(1), None),
            lambda: torch.ops.kvq.attend(probe._id, *buffers, slots, q.unsqueeze(1),
                                         probe.workspace)),
        "extension (what PagedCache calls after its checks)": (
            lambda: steps.append(stream, b, 1, slots.data_ptr(), kn.data_ptr(), vn.data_ptr()),
            lambda: steps.attend(stream, b, 1, slots.data_ptr(), q.data_ptr(), out.data_ptr(),
                                 lse.data_ptr())),
    }
    host = {name: ([], []) for name in ways}
    for t in range(200):
        for name, calls in ways.items():
            for call, xs in zip(calls, host[name]):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                xs.append((time.perf_counter() - t0) * 1e6)
    print(f"{args.scheme}, batch {b}, {args.prompt} + 200 tokens, head_dim {d}, "
          f"{q_heads} q / {kv_heads} KV heads: identical outputs every step")
    for name, xs in times.items():
        print(f"  {name}: {statistics.median(xs):.1f} µs a step (append + attend) on the GPU")
    print(f"  graph replays back to back: {back_to_back:.1f} µs a step on the GPU")
    for name, (app, att) in host.items():
        print(f"  host time, {name}: append {statistics.median(app):.1f} µs, "
              f"attend {statistics.median(att):.1f} µs")


if __name__ == "__main__":
    main()
