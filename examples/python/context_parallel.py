"""Decode context parallelism: one batch's long sequences split across the GPUs of one host.

    pip install ./python && python examples/python/context_parallel.py [--scheme fp16]

Each GPU holds a contiguous part of every sequence's tokens in its own kvq.engine.PagedCache and
attends the step's query over its part, returning the output and the log-sum-exp of each row;
the parts are gathered on GPU 0 and merged (kvq.engine.merge) into attention over the whole
sequence. The same batch is also attended whole on GPU 0 alone: the script checks the merged
result against it and prints the GPU time of each piece (CUDA events, medians of 50 steps): the
whole on one GPU, each part on its GPU, and the gather and merge on GPU 0.
"""

import argparse
import statistics

import torch

import kvq
from kvq.engine import PagedCache, merge


def plan_for(scheme, tokens, batch, args):
    limits = dict(head_dim=args.head_dim, q_heads=32, kv_heads=8, max_seqs=batch,
                  max_seq_len=tokens, dtype=torch.float16)
    pages = kvq.Plan(scheme, pool_pages=1, **limits).max_pages_per_seq
    return kvq.Plan(scheme, pool_pages=batch * pages, **limits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="fp16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"context parallelism needs two GPUs; torch sees {gpus}")
    b, t, d = args.batch, args.context, args.head_dim
    part = t // gpus
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    k = torch.randn((b, t, 8, d), generator=gen, device="cuda:0").half()
    v = torch.randn((b, t, 8, d), generator=gen, device="cuda:0").half()
    q = torch.randn((b, 32, d), generator=gen, device="cuda:0").half()
    slots = list(range(b))

    whole_plan = plan_for(args.scheme, t, b, args)
    whole = PagedCache(whole_plan, "cuda:0")
    whole.prefill(slots, [t] * b, k.reshape(b * t, 8, d), v.reshape(b * t, 8, d))
    part_plan = plan_for(args.scheme, part, b, args)
    parts, queries, slot_rows = [], [], []
    for g in range(gpus):
        dev = torch.device("cuda", g)
        cache = PagedCache(part_plan, dev)
        kp = k[:, g * part:(g + 1) * part].reshape(b * part, 8, d).to(dev)
        vp = v[:, g * part:(g + 1) * part].reshape(b * part, 8, d).to(dev)
        cache.prefill(slots, [part] * b, kp, vp)
        parts.append(cache)
        queries.append(q.to(dev))
        slot_rows.append(torch.arange(b, dtype=torch.int32, device=dev))
    for g in range(gpus):
        torch.cuda.synchronize(g)

    def timed(device, fn):
        """Runs fn on `device`'s current stream between two CUDA events; (result, events)."""
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
        return result, (start, end)

    def sync():
        for g in range(gpus):
            torch.cuda.synchronize(g)

    names = ["whole on GPU 0"] + [f"part on GPU {g}" for g in range(gpus)] + ["gather + merge"]
    times = {name: [] for name in names}
    for _ in range(50):
        sync()
        (w_out, w_lse), whole_ev = timed(0, lambda: whole.attend(slot_rows[0], q))
        sync()
        # The parts run at once, one a GPU; then GPU 0 gathers their states and merges them.
        runs = [timed(g, lambda g=g: parts[g].attend(slot_rows[g], queries[g])) for g in range(gpus)]
        sync()
        states = [r[0] for r in runs]
        (m_out, m_lse), merge_ev = timed(0, lambda: merge(
            part_plan,
            torch.stack([o.to("cuda:0") for o, _ in states]),
            torch.stack([lse.to("cuda:0") for _, lse in states])))
        sync()
        for name, (start, end) in zip(names, [whole_ev] + [r[1] for r in runs] + [merge_ev]):
            times[name].append(start.elapsed_time(end) * 1000)
    err = ((m_out.double() - w_out.double()).norm() / w_out.double().norm()).item()
    lse_err = (m_lse.double() - w_lse.double()).abs().max().item()
    print(f"{args.scheme}: batch {b} × {t} tokens, 32 q / 8 KV heads, head_dim {d}; "
          f"merged against whole: relative error {err:.2e}, largest LSE difference {lse_err:.2e}")
    med = {name: statistics.median(xs) for name, xs in times.items()}
    for name in names:
        print(f"  GPU time, {name}: {med[name]:.1f} µs")
    split = max(med[f"part on GPU {g}"] for g in range(gpus)) + med["gather + merge"]
    print(f"  a context-parallel step (slowest part, then gather + merge): {split:.1f} µs, "
          f"{med['whole on GPU 0'] / split:.2f}× the whole on one GPU")
    quantized = args.scheme != "fp16"
    # FP16 parts merge to the whole up to rounding; a quantized scheme's parts keep their own FP16
    # windows (each part's first and last tokens), so they differ from the whole by quantization.
    if not quantized and (err > 3e-3 or lse_err > 1e-3):
        raise SystemExit("the merged parts differ from the whole")


if __name__ == "__main__":
    main()
