"""Decode context parallelism over torch.distributed (NCCL): each GPU holds part of every sequence.

    pip install ./python
    torchrun --nproc_per_node 2 examples/python/context_parallel.py [--scheme fp16]

Rank r keeps the r-th contiguous part of every sequence's tokens in its own
kvq.engine.PagedCache. A decode step attends the query over each rank's part (output and
log-sum-exp per row, written straight into the buffers NCCL sends), gathers every rank's pair
with two all-gathers, and merges them (kvq.engine.merge) into attention over the whole sequence,
on every rank. Rank 0 also holds the whole batch and checks the merged result against it.

Printed (rank 0, CUDA events, medians of 100 steps): the whole on one GPU; a context-parallel
step, eager and replayed from a CUDA graph (the attend, the gathers and the merge captured
together); and the GPU time of its kvq pieces alone, the attend of a part and
the merge (with its share of the replayed step), each replayed from a graph of 20.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import kvq
from kvq.engine import PagedCache, merge

STEPS = 100


def plan_for(scheme, tokens, batch, args):
    limits = dict(head_dim=args.head_dim, q_heads=32, kv_heads=8, max_seqs=batch,
                  max_seq_len=tokens, dtype=torch.float16)
    pages = kvq.Plan(scheme, pool_pages=1, **limits).max_pages_per_seq
    return kvq.Plan(scheme, pool_pages=batch * pages, **limits)


def events(n):
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="fp16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node 2 " + __file__)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.device_count() <= local:
        raise SystemExit(f"rank {rank} needs GPU {local}; torch sees {torch.cuda.device_count()} "
                         "(NCCL takes one GPU a rank)")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    b, t, d = args.batch, args.context, args.head_dim
    if t % world:
        raise SystemExit(f"--context {t} does not split into {world} equal parts")
    part = t // world

    # Every rank draws the same batch from the same seed and keeps its part.
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn((b, t, 8, d), generator=gen, device=device).half()
    v = torch.randn((b, t, 8, d), generator=gen, device=device).half()
    q = torch.randn((b, 32, d), generator=gen, device=device).half()
    slots = torch.arange(b, dtype=torch.int32, device=device)
    part_plan = plan_for(args.scheme, part, b, args)
    cache = PagedCache(part_plan, device)
    mine = slice(rank * part, (rank + 1) * part)
    cache.prefill(list(range(b)), [part] * b, k[:, mine].reshape(b * part, 8, d),
                  v[:, mine].reshape(b * part, 8, d))
    whole = None
    if rank == 0:
        whole = PagedCache(plan_for(args.scheme, t, b, args), device)
        whole.prefill(list(range(b)), [t] * b, k.reshape(b * t, 8, d), v.reshape(b * t, 8, d))
    del k, v
    torch.cuda.synchronize()

    # The step's buffers, fixed so that a graph can replay it.
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    outs = torch.empty((world,) + tuple(q.shape), dtype=q.dtype, device=device)
    lses = torch.empty((world,) + tuple(lse.shape), dtype=torch.float32, device=device)
    merged, merged_lse = torch.empty_like(q), torch.empty_like(lse)

    def step():
        """A context-parallel step: attend the part, gather every rank's (O, LSE), merge."""
        cache.attend(slots, q, out=out, lse=lse)
        dist.all_gather_into_tensor(outs, out)
        dist.all_gather_into_tensor(lses, lse)
        return merge(part_plan, outs, lses, out=merged, lse=merged_lse)

    for _ in range(3):  # NCCL's communicators and kvq's kernels warm up
        step()
    torch.cuda.synchronize()
    eager, whole_t, graphed = [], [], []
    for _ in range(STEPS):
        if rank == 0:
            w = events(2)
            w[0].record()
            w_out, w_lse = whole.attend(slots, q)
            w[1].record()
            torch.cuda.synchronize()
            whole_t.append(w[0].elapsed_time(w[1]) * 1000)
        dist.barrier()
        marks = events(2)
        marks[0].record()
        m_out, m_lse = step()
        marks[1].record()
        torch.cuda.synchronize()
        eager.append(marks[0].elapsed_time(marks[1]) * 1000)
    m_out, m_lse = m_out.clone(), m_lse.clone()  # the graphs below write `merged` again

    def replayed_time(fn, runs=20, replays=10):
        """GPU time of one `fn`: `runs` calls captured in a CUDA graph, replayed `replays` times
        between two events (no host time in between)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(runs):
                fn()
        torch.cuda.synchronize()
        e = events(2)
        e[0].record()
        for _ in range(replays):
            g.replay()
        e[1].record()
        torch.cuda.synchronize()
        return e[0].elapsed_time(e[1]) * 1000 / (runs * replays)

    attend_t = replayed_time(lambda: cache.attend(slots, q, out=out, lse=lse))
    merge_t = replayed_time(lambda: merge(part_plan, outs, lses, out=merged, lse=merged_lse))

    # The same step captured once (attend, gathers, merge) and replayed.
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream(device)
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        step()  # NCCL and the allocator settle on the capture stream first
    torch.cuda.current_stream().wait_stream(capture)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    for _ in range(STEPS):
        dist.barrier()
        g = events(2)
        g[0].record()
        graph.replay()
        g[1].record()
        torch.cuda.synchronize()
        graphed.append(g[0].elapsed_time(g[1]) * 1000)
    replayed = merged.clone()
    torch.cuda.synchronize()
    dist.barrier()
    del graph

    if rank == 0:
        ref = w_out.double()
        err = ((m_out.double() - ref).norm() / ref.norm()).item()
        lse_err = (m_lse.double() - w_lse.double()).abs().max().item()
        g_err = ((replayed.double() - ref).norm() / ref.norm()).item()
        print(f"{args.scheme}: batch {b} × {t} tokens, 32 q / 8 KV heads, head_dim {d}, "
              f"{world} ranks of {part} tokens (NCCL); merged against whole: relative error "
              f"{err:.2e}, largest LSE difference {lse_err:.2e}; graph replay {g_err:.2e}")
        whole_med, graph_med = statistics.median(whole_t), statistics.median(graphed)
        eager_med = statistics.median(eager)
        print(f"  GPU time, the whole on one GPU: {whole_med:.1f} µs")
        print(f"  a context-parallel step, eager: {eager_med:.1f} µs "
              f"({whole_med / eager_med:.2f}× the whole's speed)")
        print(f"  a context-parallel step, graph replay: {graph_med:.1f} µs "
              f"({whole_med / graph_med:.2f}× the whole's speed)")
        print(f"  pieces (graph replays): attend of a part {attend_t:.1f} µs, merge "
              f"{merge_t:.1f} µs ({100 * merge_t / graph_med:.1f}% of the replayed step); the "
              "gathers and the wait for the slower rank take the rest")
        # FP16 parts merge to the whole up to rounding; a quantized scheme's parts keep their
        # own FP16 windows (each part's first and last tokens), so they differ by quantization.
        if args.scheme == "fp16" and (err > 3e-3 or lse_err > 1e-3 or g_err > 3e-3):
            raise SystemExit("the merged parts differ from the whole")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
