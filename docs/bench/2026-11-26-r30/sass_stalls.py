"""Static schedule of a kernel's largest basic blocks, from `nvdisasm -c -hex` output.

Each sm_90 instruction is 128 bits; bits 105-108 of its control code are the stall count the
compiler gives it: the cycles the warp waits before its next instruction (fixed-latency
dependencies, and the issue rate of the pipe: integer ALU instructions such as LOP3 take two
cycles a warp on an H100 SM sub-partition, whose integer unit is 16 lanes wide). The sum over a
block is the least time one warp alone spends in it; per opcode it shows which pipe sets that
time. No GPU needed.

Usage: nvdisasm -c -hex decode.sm_90a.cubin > k.sass
       python3 sass_stalls.py k.sass KERNEL_NAME [N]     # the N largest blocks (default 3)
"""
import collections, re, sys

lines = open(sys.argv[1]).read().split('\n')
name = sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 3
start = next(i for i, l in enumerate(lines) if l.startswith('.text.' + name + ':'))
end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith('.text.')), len(lines))
blocks, label, cur = [], 'entry', []
i = start + 1
while i < end:
    l = lines[i]
    m = re.match(r'^(\.L_x_\d+):', l)
    if m:
        if cur: blocks.append((label, cur))
        label, cur = m.group(1), []
        i += 1
        continue
    m = re.search(r'/\*[0-9a-f]{4,}\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/', l)
    if m and i + 1 < end:
        hi = re.search(r'/\* (0x[0-9a-f]+) \*/', lines[i + 1])
        word = (int(hi.group(1), 16) << 64) | int(m.group(2), 16)
        text = m.group(1).strip()
        op = (text.split()[1] if text.startswith('@') else text.split()[0]).split('.')[0]
        cur.append((op, (word >> 105) & 0xF))
        i += 2
        continue
    i += 1
if cur: blocks.append((label, cur))
for label, ins in sorted(blocks, key=lambda b: -len(b[1]))[:top]:
    stalls = sum(s for _, s in ins)
    print(f'{label}: {len(ins)} instructions, {stalls} stall cycles (one warp alone)')
    per = collections.defaultdict(lambda: [0, 0])
    for op, s in ins:
        per[op][0] += 1
        per[op][1] += s
    for op, (n, s) in sorted(per.items(), key=lambda x: -x[1][1])[:8]:
        print(f'    {op:8s} {n:4d} instructions, {s:4d} cycles ({s / n:.2f} each)')
