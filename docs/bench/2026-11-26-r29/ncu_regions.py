#!/usr/bin/env python3
"""Groups ncu's per-SASS-instruction source page (see ncu_source.py) into runs of consecutive
instructions executed equally often (about basic blocks) and prints the N runs of the kernel
whose name contains NAME with the most warp stall samples: share of samples, top stall reasons,
opcodes.  Usage: ncu_regions.py src.csv NAME N"""
import csv,sys,collections
rows=list(csv.reader(open(sys.argv[1])))
kern=None;hdr=None;data=collections.defaultdict(list)
for r in rows:
    if len(r)>=2 and r[0]=='Kernel Name': kern=r[1];continue
    if r and r[0]=='Address': hdr=r;continue
    if hdr and kern and len(r)==len(hdr): data[kern].append(dict(zip(hdr,r)))
want=sys.argv[2]
for k,ins in data.items():
    if want not in k: continue
    tot=sum(int(i['Warp Stall Sampling (All Samples)']) for i in ins)
    # group into runs of consecutive instructions with the same exec count (basic-block-ish)
    groups=[];cur=None
    for i in ins:
        ex=int(i['Instructions Executed'])
        if cur is None or cur['ex']!=ex:
            cur={'ex':ex,'start':i['Address'][-5:],'n':0,'s':0,'st':collections.Counter(),'ops':collections.Counter()};groups.append(cur)
        cur['n']+=1; cur['s']+=int(i['Warp Stall Sampling (All Samples)'])
        op=i['Source'].strip().split(); o=op[1] if op and op[0].startswith('@') else (op[0] if op else '?')
        cur['ops'][o.split('.')[0]]+=1
        for h in hdr:
            if h.startswith('stall_') and 'Not Issued' not in h and i[h].isdigit(): cur['st'][h[6:]]+=int(i[h])
    for g in sorted(groups,key=lambda g:-g['s'])[:int(sys.argv[3])]:
        print(f"{g['start']} n={g['n']:4d} ex={g['ex']:7d} {100*g['s']/tot:5.1f}%  ", ' '.join(f'{a}:{b}' for a,b in g['st'].most_common(4)),' | ',' '.join(f'{a}:{b}' for a,b in g['ops'].most_common(6)))
