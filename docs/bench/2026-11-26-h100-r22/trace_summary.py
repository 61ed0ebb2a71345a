#!/usr/bin/env python3
"""Summarises the per-warp timestamps printed by a build with trace.patch (lines `KVQT sm part kvh
warp begin end chunks pad t0 t1 t2 t3 [tA tB tC]`, %globaltimer ns): per launch, the spread of each
warp's start, first staged chunk, loop end and end, and the prologue's steps. Usage: trace_summary.py LOG"""
import sys, statistics as st
lines=[l.split() for l in open(sys.argv[1]) if l.startswith('KVQT')]
rows=[list(map(int,l[1:])) for l in lines]
# split into launches: consecutive groups; detect by t0 gaps > 50us
rows.sort(key=lambda r:r[8])
groups=[[rows[0]]]
for r in rows[1:]:
    if r[8]-groups[-1][-1][8] > 100000: groups.append([r])
    else: groups[-1].append(r)
for gi,g in enumerate(groups):
    T0=min(r[8] for r in g)
    s=[r[8]-T0 for r in g]; f=[r[9]-T0 for r in g]; l=[r[10]-T0 for r in g]; e=[r[11]-T0 for r in g]
    n=[r[6] for r in g]
    print(f"launch {gi}: warps {len(g)} chunks/warp mean {st.mean(n):.1f} max {max(n)} min {min(n)}")
    def q(x): 
        x=sorted(x); return f"min {x[0]/1000:.2f} p10 {x[len(x)//10]/1000:.2f} med {x[len(x)//2]/1000:.2f} p90 {x[9*len(x)//10]/1000:.2f} max {x[-1]/1000:.2f}"
    print("  start   ", q(s))
    print("  1st chunk", q(f))
    print("  loop end ", q(l))
    print("  end      ", q(e))
    print("  1st-start", q([a-b for a,b in zip(f,s)]))
    print("  loop     ", q([a-b for a,b in zip(l,f)]))
    print("  epilogue ", q([a-b for a,b in zip(e,l)]))
    if max(n)==0: continue
    per=[(a-b)/max(c,1) for a,b,c in zip(l,f,n) if c>0]
    print("  loop/chunk", q(per))
    # per-SM end max
    sm={}
    for r,ee in zip(g,e): sm[r[0]]=max(sm.get(r[0],0),ee)
    v=sorted(sm.values()); print("  SM end  ", f"min {v[0]/1000:.2f} med {v[len(v)//2]/1000:.2f} max {v[-1]/1000:.2f}", "nSM",len(v))
    # slowest warps
    g2=sorted(zip(e,g),key=lambda x:-x[0])[:5]
    for ee,r in g2: print("   slow:", r[:8], f"start {(r[8]-T0)/1000:.2f} first {(r[9]-T0)/1000:.2f} loopend {(r[10]-T0)/1000:.2f} end {ee/1000:.2f}")
if len(rows[0])>12:
  for gi,g in enumerate(groups):
    if max(r[6] for r in g)==0: continue
    def q(x):
        x=sorted(x); return f"min {x[0]/1000:.2f} p10 {x[len(x)//10]/1000:.2f} med {x[len(x)//2]/1000:.2f} p90 {x[9*len(x)//10]/1000:.2f} max {x[-1]/1000:.2f}"
    print(f"launch {gi} prologue:")
    print("  start->A (len, share)", q([r[12]-r[8] for r in g]))
    print("  A->B (page table, issue)", q([r[13]-r[12] for r in g]))
    print("  B->C (query, syncthreads)", q([r[14]-r[13] for r in g]))
    print("  C->1st chunk", q([r[9]-r[14] for r in g]))
    T0=min(r[8] for r in g)
    print("  abs A", q([r[12]-T0 for r in g])); print("  abs B", q([r[13]-T0 for r in g])); print("  abs C", q([r[14]-T0 for r in g]))
