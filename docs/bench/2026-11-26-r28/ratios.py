"""Old µs / new µs per (scheme, B, L) from kvq-bench tables: the fastest median of each side.

Usage: python3 ratios.py OLD1.md,OLD2.md NEW1.md,NEW2.md
"""
import sys, collections
def load(files):
    d=collections.defaultdict(list)
    for f in files.split(','):
        for line in open(f):
            c=[x.strip() for x in line.split('|')]
            if len(c)>8 and c[1] and c[1]!='scheme' and not c[1].startswith('-'):
                try: d[(c[1],int(c[2]),c[3])].append((float(c[4]),c[6],c[8]))
                except ValueError: pass
    return d
b=load(sys.argv[1]); n=load(sys.argv[2])
for k in sorted(b, key=lambda k:(k[0],k[1],k[2])):
    if k in n:
        bo=min(x[0] for x in b[k]); no=min(x[0] for x in n[k])
        print(f"{k[0]:12s} B={k[1]:<4d} L={k[2]:5s} {bo:8.1f} -> {no:8.1f}  x{bo/no:.3f}   base {[x[0] for x in b[k]]} new {[x[0] for x in n[k]]}  [{n[k][0][2]}]")
