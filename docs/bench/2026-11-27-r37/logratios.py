"""Ratios old µs / new µs from bench logs (the `[kvq-bench] SCHEME B=.. L=..: X µs` lines), for
runs cut short before their tables were written; the fastest median of each side.

Usage: python3 logratios.py OLD1.log,OLD2.log NEW1.log,NEW2.log [VARIANT.log,...]
"""
import collections, re, sys


def load(names):
    runs = collections.defaultdict(list)
    for name in names.split(','):
        for line in open(name):
            m = re.match(r'\[kvq-bench\] (\S+) B=(\d+) L=(\S+): ([\d.]+) µs', line)
            if m:
                runs[(m.group(1), int(m.group(2)), m.group(3))].append(float(m.group(4)))
    return runs


old, new = load(sys.argv[1]), load(sys.argv[2])
var = load(sys.argv[3]) if len(sys.argv) > 3 else {}
for key in sorted(old, key=lambda k: (k[0], k[1], len(k[2]), k[2])):
    if key not in new:
        continue
    o, n = min(old[key]), min(new[key])
    line = f'{key[0]:12s} B={key[1]:<3d} L={key[2]:5s} {o:8.1f} -> {n:8.1f}  x{o / n:.3f}  (runs {len(old[key])}, {len(new[key])})'
    if key in var:
        line += f'   variant {min(var[key]):8.1f}  x{o / min(var[key]):.3f}'
    print(line)
