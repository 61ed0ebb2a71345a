#!/usr/bin/env python3
"""Sums up the per-warp timestamps a decode kernel built with trace.patch prints (lines
`KVQT sm part kvh warp begin end chunks seq t0 t1 t2 t3 tA tB tC tM`, %globaltimer ns): per launch,
when warps start, learn their share (A), issue their first copies (B), stage the query (C), see
their first chunk land, leave the loop, pass the CTA's merge barrier (M) and end, with the spread
of each over the launch's warps and, per SM, when its last warp ends. Usage: trace_summary.py LOG"""
import statistics as st
import sys

rows = [list(map(int, l.split()[1:17])) for l in open(sys.argv[1]) if l.startswith('KVQT')]
rows.sort(key=lambda r: r[8])
launches = [[rows[0]]]
for r in rows[1:]:
    # A new launch starts when a warp starts more than 20 µs after the previous warp did.
    if r[8] - launches[-1][-1][8] > 20000:
        launches.append([r])
    else:
        launches[-1].append(r)


def q(xs):
    xs = sorted(xs)
    n = len(xs)
    return (f"min {xs[0] / 1000:7.2f} p10 {xs[n // 10] / 1000:7.2f} med {xs[n // 2] / 1000:7.2f} "
            f"p90 {xs[9 * n // 10] / 1000:7.2f} max {xs[-1] / 1000:7.2f}")


for i, g in enumerate(launches):
    T0 = min(r[8] for r in g)
    col = lambda k: [r[k] - T0 for r in g]
    start, first, loopend, end, a, b, c, m = (col(k) for k in (8, 9, 10, 11, 12, 13, 14, 15))
    chunks = [r[6] for r in g]
    print(f"launch {i}: {len(g)} warps, {len(set(r[0] for r in g))} SMs, chunks a warp "
          f"{min(chunks)}-{max(chunks)} (mean {st.mean(chunks):.1f}), span {max(end) / 1000:.2f} µs")
    print("  start      ", q(start))
    print("  share (A)  ", q(a))
    print("  copies (B) ", q(b))
    print("  query (C)  ", q(c))
    print("  1st chunk  ", q(first))
    print("  loop end   ", q(loopend))
    print("  merge bar. ", q(m))
    print("  end        ", q(end))
    print("  loop       ", q([x - y for x, y in zip(loopend, first)]))
    print("  wait at bar", q([x - y for x, y in zip(m, loopend)]))
    print("  after bar. ", q([x - y for x, y in zip(end, m)]))
    per_chunk = [(x - y) / n for x, y, n in zip(loopend, first, chunks) if n > 0]
    if per_chunk:
        print("  loop/chunk ", q(per_chunk))
    sm_end = {}
    for r, e in zip(g, end):
        sm_end[r[0]] = max(sm_end.get(r[0], 0), e)
    print("  SM last end", q(list(sm_end.values())))
    # The step's warps end when the last SM does: what the spread of loop ends costs.
    print(f"  last end - median loop end: {(max(end) - sorted(loopend)[len(loopend) // 2]) / 1000:.2f} µs")


def sm_chunk_times(g):
    """Mean loop time a chunk of each SM's warps, µs."""
    per = {}
    for r in g:
        if r[6] > 0:
            per.setdefault(r[0], []).append((r[10] - r[9]) / r[6] / 1000)
    return {sm: st.mean(v) for sm, v in per.items()}


def correlation(a, b):
    keys = sorted(set(a) & set(b))
    xs, ys = [a[k] for k in keys], [b[k] for k in keys]
    mx, my = st.mean(xs), st.mean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    den = (sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5
    return num / den


# Whether an SM's speed is a property of the SM: the correlation of its chunk time between
# launches of the same kernel, and what an even finish would save. Launches of one kernel: the
# same warp count and spans within a factor of two (the FP16 baseline's launches come first and
# can have the scheme's warp count).
by_kernel = {}
for g in launches:
    T0 = min(r[8] for r in g)
    span = max(r[11] for r in g) - T0
    key = next((k for k in by_kernel if k[0] == len(g) and 0.5 < span / k[1] < 2), (len(g), span))
    by_kernel.setdefault(key, []).append(g)
for (warps, _), gs in by_kernel.items():
    times = [sm_chunk_times(g) for g in gs]
    corr = ", ".join(f"{correlation(times[0], t):.2f}" for t in times[1:])
    print(f"launches of {warps} warps: per-SM chunk time correlates with the first launch's at {corr}")
    for i, g in enumerate(gs):
        T0 = min(r[8] for r in g)
        ends = {}
        for r in g:
            ends[r[0]] = max(ends.get(r[0], 0), r[11] - T0)
        vals = sorted(ends.values())
        t = times[i]
        print(f"  launch {launches.index(g)}: SM chunk time {min(t.values()):.2f}-{max(t.values()):.2f} µs; "
              f"SMs end {vals[0] / 1000:.1f}-{vals[-1] / 1000:.1f} µs, mean {st.mean(vals) / 1000:.1f}: "
              f"an even finish would save {(vals[-1] - st.mean(vals)) / 1000:.1f} µs")
