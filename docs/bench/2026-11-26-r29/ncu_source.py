#!/usr/bin/env python3
"""Summarises ncu's per-SASS-instruction source page (written on the GPU machine with
`ncu --import REPORT --page source --csv --print-source sass > src.csv`): for each kernel, warp
stall samples by reason, samples and executed instructions by opcode, and the N instructions
with the most samples.  Usage: ncu_source.py src.csv [N]"""
import csv,sys,collections,re
rows=list(csv.reader(open(sys.argv[1])))
kern=None;hdr=None;data=collections.defaultdict(list)
for r in rows:
    if len(r)>=2 and r[0]=='Kernel Name': kern=r[1];continue
    if r and r[0]=='Address': hdr=r;continue
    if hdr and kern and len(r)==len(hdr): data[kern].append(dict(zip(hdr,r)))
for k,ins in data.items():
    tot=sum(int(i['Warp Stall Sampling (All Samples)']) for i in ins)
    ex=sum(int(i['Instructions Executed']) for i in ins)
    print('==',k,'samples',tot,'warp-instrs executed',ex)
    st=collections.Counter()
    for i in ins:
        for h in hdr:
            if h.startswith('stall_') and 'Not Issued' not in h:
                try: st[h]+=int(i[h])
                except: pass
    print(' '.join(f'{a[6:]}:{100*b/tot:.1f}%' for a,b in st.most_common(12)))
    # op class totals
    opc=collections.Counter(); ope=collections.Counter()
    for i in ins:
        op=i['Source'].strip().split()
        if not op: continue
        o=op[0]
        if o.startswith('@'): o=op[1]
        o=o.split('.')[0]
        opc[o]+=int(i['Warp Stall Sampling (All Samples)']); ope[o]+=int(i['Instructions Executed'])
    print('by op (samples%, exec%):',' '.join(f'{o}:{100*opc[o]/tot:.1f}/{100*ope[o]/ex:.1f}' for o,_ in opc.most_common(16)))
    n=int(sys.argv[2]) if len(sys.argv)>2 else 25
    top=sorted(ins,key=lambda i:-int(i['Warp Stall Sampling (All Samples)']))[:n]
    for i in top:
        s=int(i['Warp Stall Sampling (All Samples)'])
        reasons=sorted(((int(i[h]) if i[h].isdigit() else 0,h[6:]) for h in hdr if h.startswith('stall_') and 'Not Issued' not in h),reverse=True)[:3]
        print(f"{i['Address'][-5:]} {100*s/tot:5.2f}% ex={i['Instructions Executed']:>8} {i['Source'].strip()[:60]:60s} {reasons}")
