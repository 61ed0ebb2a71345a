# Sums ncu source-page samples (ncu --import REP --page source --csv --print-source sass) over runs of
# consecutive SASS instructions with the same execution count, so a kernel's basic blocks show with
# their share of stall samples and of executed instructions. Usage: python3 segments.py src.csv
import csv,sys,collections
rows=list(csv.reader(open(sys.argv[1])))
hdr=rows[1]; data=rows[2:]
ia=hdr.index("Address"); isrc=hdr.index("Source"); isamp=hdr.index("Warp Stall Sampling (All Samples)"); iex=hdr.index("Instructions Executed")
stall_cols=[i for i,h in enumerate(hdr) if h.startswith('stall_') and 'Not Issued' not in h]
base=int(data[0][ia],16)
segs=[]; cur=None
tot=sum(int(r[isamp]) for r in data); totex=sum(int(r[iex]) for r in data)
for r in data:
    ex=int(r[iex]); s=int(r[isamp]); op=r[isrc].split()[0] if r[isrc].split() else ''
    if op.startswith('@'): op=r[isrc].split()[1]
    if cur is None or cur['ex']!=ex:
        cur={'start':int(r[ia],16)-base,'ex':ex,'n':0,'samp':0,'ops':collections.Counter(),'st':collections.Counter()}; segs.append(cur)
    cur['n']+=1; cur['samp']+=s; cur['ops'][op.split('.')[0]]+=1
    for i in stall_cols: cur['st'][hdr[i][6:]]+=int(r[i])
print('total samples',tot,'total warp inst',totex)
for sg in segs:
    if sg['samp']>tot*0.01:
        print(f"{sg['start']:6x} n={sg['n']:4d} ex={sg['ex']:8d} samp={sg['samp']:6d} ({100*sg['samp']/tot:4.1f}%) instshare={100*sg['n']*sg['ex']/totex:4.1f}%  ", ' '.join(f'{k}:{v}' for k,v in sg['ops'].most_common(6)), '|', ' '.join(f'{k}:{v}' for k,v in sg['st'].most_common(5)))
