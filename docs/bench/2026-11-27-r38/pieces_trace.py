import statistics as st, collections, sys
def launches(f):
    L=[]
    for l in open(f):
        if not l.startswith('KVQT'): continue
        r=list(map(int,l.split()[1:17]))
        if r[1]==0 and r[2]==0 and r[3]==0 and r[7]==0: L.append([])
        L[-1].append(r)
    return L
def q(xs):
    xs=sorted(xs); n=len(xs)
    return "min %6.1f p10 %6.1f med %6.1f p90 %6.1f max %6.1f"%(xs[0]/1e3,xs[n//10]/1e3,xs[n//2]/1e3,xs[9*n//10]/1e3,xs[-1]/1e3)
for f,splits,base in [a.split(':') for a in sys.argv[1:]]:
    splits=int(splits); base=int(base)
    L=launches(f)
    print('==',f, [len(g) for g in L])
    for g in L:
        if len(g)==base: continue  # fp16 baseline
        T0=min(r[8] for r in g)
        sp=[r for r in g if r[1]<splits]; pc=[r for r in g if r[1]>=splits]
        ends=collections.defaultdict(int)
        for r in g: ends[r[0]]=max(ends[r[0]], r[11]-T0)
        e=sorted(ends.values())
        print(' launch of %d warps: split warps end %s'%(len(g), q([r[11]-T0 for r in sp])))
        if pc:
            print('   piece warps start   %s'%q([r[8]-T0 for r in pc]))
            print('   piece 1st chunk lat %s'%q([r[9]-r[8] for r in pc]))
            print('   piece warp duration %s'%q([r[11]-r[8] for r in pc]))
            print('   piece chunks %.1f mean; piece warps end %s'%(st.mean(r[6] for r in pc), q([r[11]-T0 for r in pc])))
        print('   SM last end %s mean %.1f'%(q(e), st.mean(e)/1e3))
