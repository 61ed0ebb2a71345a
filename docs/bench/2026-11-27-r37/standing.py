"""Per (scheme, B, L) over several bench logs: the fastest median, the spread of the runs, % of
copy, the multiple of FP16's fastest and of the one-launch read, and the checked runs' errors.

Usage: python3 standing.py c4-standing/chk.log c4-standing/p0.log c4-standing/p40.log
"""
import collections, re, sys

rows = collections.defaultdict(list)
for name in sys.argv[1:]:
    for line in open(name):
        m = re.match(r'\[kvq-bench\] (\S+) B=(\d+) L=(\S+): ([\d.]+) µs, (\d+) GB/s \(([\d.]+)% of copy\)', line)
        if not m:
            continue
        err = re.search(r'rel err ([\d.e-]+)', line)
        read = re.search(r'read ([\d.]+) µs \(×([\d.]+)\)', line)
        rows[(m.group(1), int(m.group(2)), m.group(3))].append(
            (float(m.group(4)), float(m.group(6)), err.group(1) if err else '', float(read.group(2))))
fp16 = {k[1:]: min(x[0] for x in v) for k, v in rows.items() if k[0] == 'fp16'}
for k in sorted(rows, key=lambda k: (k[1], len(k[2]), k[2], k[0])):
    v = rows[k]
    best = min(v, key=lambda x: x[0])
    print(f"{k[0]:12s} B={k[1]:2d} L={k[2]:5s} best {best[0]:8.1f} µs (runs {min(x[0] for x in v):.1f}-{max(x[0] for x in v):.1f})"
          f"  copy% {min(x[1] for x in v):.1f}-{max(x[1] for x in v):.1f}  xFP16 {fp16[k[1:]] / best[0]:.2f}"
          f"  xread {best[3]:.2f}  err {[x[2] for x in v if x[2]]}")
