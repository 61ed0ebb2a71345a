import sys,re,math,collections
def load(f):
    d={}
    for l in open(f):
        if l.startswith('| ') and not l.startswith('| scheme'):
            c=[x.strip() for x in l.split('|')[1:-1]]
            try: d[(c[0],c[1],c[2])]=float(c[3])
            except: pass
    return d
base=load(sys.argv[1]); vs=[(f.split('/')[-1][:-3],load(f)) for f in sys.argv[2:]]
schemes=sorted(set(k[0] for k in base))
print("%-12s %-9s %8s "%("scheme","B/L","base")+" ".join("%12s"%n for n,_ in vs))
g=collections.defaultdict(list)
for k in sorted(base, key=lambda k:(k[0],int(k[1]),k[2])):
    row="%-12s %-9s %8.1f "%(k[0],k[1]+"/"+k[2],base[k])
    for n,d in vs:
        r=base[k]/d[k] if k in d else float('nan'); g[(k[0],n)].append(r); row+="%12.3f"%r
    print(row)
print()
for s in schemes:
    print("%-12s"%s, " ".join("%s gm %.3f min %.3f max %.3f |"%(n,math.exp(sum(map(math.log,g[(s,n)]))/len(g[(s,n)])),min(g[(s,n)]),max(g[(s,n)])) for n,_ in vs))
