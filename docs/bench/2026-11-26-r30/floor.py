"""Each row of kvq-bench JSON results against its one-launch read floor.

Prints, per (scheme, B, L): the step's median, the read floor's, their ratio, and the share of
the run's copy bandwidth each reaches (bytes / time / copy). With several files, each row comes
from the file whose step was fastest.

Usage: python3 floor.py RESULTS.json [MORE.json ...] [--min-batch B --max-batch B]
"""
import json, sys

args = sys.argv[1:]
lo, hi = 0, 1 << 30
if '--min-batch' in args:
    i = args.index('--min-batch'); lo = int(args[i + 1]); del args[i:i + 2]
if '--max-batch' in args:
    i = args.index('--max-batch'); hi = int(args[i + 1]); del args[i:i + 2]
best = {}
for f in args:
    d = json.load(open(f))
    copy = d['copy']['gbps']
    for r in d['rows']:
        if r.get('read_floor_us') is None or not lo <= r['batch'] <= hi:
            continue
        k = (r['batch'], r['context'], r['scheme'])
        if k not in best or r['median_us'] < best[k][0]['median_us']:
            best[k] = (r, copy)
print('| scheme | B | L | step µs | read µs | × read | step % of copy | read % of copy |')
print('|---|---:|---:|---:|---:|---:|---:|---:|')
for (b, l, s), (r, copy) in sorted(best.items()):
    floor = r['read_floor_us']
    pct = lambda us: 100 * r['bytes'] / (us * 1e-6) / 1e9 / copy
    tokens = f"{l // 1024}K" if l >= 1024 else str(l)
    print(f"| {s} | {b} | {tokens} | {r['median_us']:.1f} | {floor:.1f} | {r['median_us'] / floor:.2f} "
          f"| {pct(r['median_us']):.1f} | {pct(floor):.1f} |")
