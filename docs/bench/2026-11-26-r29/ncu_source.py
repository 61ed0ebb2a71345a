#!/usr/bin/env python3
"""Summarises ncu's per-SASS-instruction source page, written on the GPU machine with
`ncu --import REPORT --page source --csv --print-source sass > src.csv`.

  ncu_source.py src.csv [N]            per kernel: warp stall samples by reason, samples and
                                       executed instructions by opcode, the N instructions with
                                       the most samples
  ncu_source.py src.csv --regions NAME N
                                       the kernel whose name contains NAME, grouped into runs of
                                       consecutive instructions executed equally often (about
                                       basic blocks): the N runs with the most samples, their
                                       share, top stall reasons and opcodes
"""
import collections
import csv
import sys

SAMPLES = 'Warp Stall Sampling (All Samples)'


def load(path):
    """{kernel name: [instruction rows as dicts]} and the column names."""
    kern, hdr, data = None, None, collections.defaultdict(list)
    for row in csv.reader(open(path)):
        if len(row) >= 2 and row[0] == 'Kernel Name':
            kern = row[1]
        elif row and row[0] == 'Address':
            hdr = row
        elif hdr and kern and len(row) == len(hdr):
            data[kern].append(dict(zip(hdr, row)))
    return data, hdr


def stalls(ins, hdr):
    """Stall samples by reason (issued and not) of one instruction row."""
    return {h[6:]: int(ins[h]) for h in hdr
            if h.startswith('stall_') and 'Not Issued' not in h and ins[h].isdigit()}


def opcode(ins):
    words = ins['Source'].strip().split()
    if not words:
        return '?'
    op = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
    return op.split('.')[0]


def summary(data, hdr, n):
    for kernel, rows in data.items():
        total = sum(int(i[SAMPLES]) for i in rows)
        executed = sum(int(i['Instructions Executed']) for i in rows)
        print('==', kernel, 'samples', total, 'warp-instrs executed', executed)
        by_reason = collections.Counter()
        for i in rows:
            by_reason.update(stalls(i, hdr))
        print(' '.join(f'{r}:{100 * c / total:.1f}%' for r, c in by_reason.most_common(12)))
        samples, execs = collections.Counter(), collections.Counter()
        for i in rows:
            samples[opcode(i)] += int(i[SAMPLES])
            execs[opcode(i)] += int(i['Instructions Executed'])
        print('by op (samples%, exec%):', ' '.join(
            f'{o}:{100 * samples[o] / total:.1f}/{100 * execs[o] / executed:.1f}' for o, _ in samples.most_common(16)))
        for i in sorted(rows, key=lambda i: -int(i[SAMPLES]))[:n]:
            top = sorted(((c, r) for r, c in stalls(i, hdr).items()), reverse=True)[:3]
            print(f"{i['Address'][-5:]} {100 * int(i[SAMPLES]) / total:5.2f}% ex={i['Instructions Executed']:>8} "
                  f"{i['Source'].strip()[:60]:60s} {top}")


def regions(data, hdr, name, n):
    for kernel, rows in data.items():
        if name not in kernel:
            continue
        total = sum(int(i[SAMPLES]) for i in rows)
        runs = []
        for i in rows:
            ex = int(i['Instructions Executed'])
            if not runs or runs[-1]['ex'] != ex:
                runs.append({'ex': ex, 'start': i['Address'][-5:], 'n': 0, 's': 0,
                             'st': collections.Counter(), 'ops': collections.Counter()})
            run = runs[-1]
            run['n'] += 1
            run['s'] += int(i[SAMPLES])
            run['ops'][opcode(i)] += 1
            run['st'].update(stalls(i, hdr))
        for run in sorted(runs, key=lambda r: -r['s'])[:n]:
            print(f"{run['start']} n={run['n']:4d} ex={run['ex']:7d} {100 * run['s'] / total:5.1f}%  ",
                  ' '.join(f'{a}:{b}' for a, b in run['st'].most_common(4)), ' | ',
                  ' '.join(f'{a}:{b}' for a, b in run['ops'].most_common(6)))


if __name__ == '__main__':
    table, columns = load(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2] == '--regions':
        regions(table, columns, sys.argv[3], int(sys.argv[4]))
    else:
        summary(table, columns, int(sys.argv[2]) if len(sys.argv) > 2 else 25)
