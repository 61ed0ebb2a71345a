#!/usr/bin/env python3
"""Summarises a `kvq-bench --tune` table (STEM.md): per scheme, the tuned gain's range, the shapes
where the tuner left the default (the default's `range splits`, which the tuned column
does not print, left out of the comparison; a tuned config of "the default", which the bench
prints since the forty-first round, counts as kept), and the seconds a shape took to tune.

Usage: python3 tune_summary.py TABLE.md
"""
import re
import sys


def rows(path):
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 15 or cells[0] in ("scheme", "---"):
            continue
        if not cells[1].isdigit():
            continue
        yield {
            "scheme": cells[0], "B": int(cells[1]), "L": cells[2], "default": re.sub(r" range splits \d+", "", cells[7]),
            "tuned_us": float(cells[11]), "gain": float(cells[12]), "tuned": cells[13],
            "secs": float(cells[14]),
        }


def main():
    by = {}
    for r in rows(sys.argv[1]):
        by.setdefault(r["scheme"], []).append(r)
    allsecs = []
    for scheme, rs in by.items():
        gains = [r["gain"] for r in rs]
        moved = [r for r in rs if r["tuned"] not in (r["default"], "the default")]
        secs = [r["secs"] for r in rs]
        allsecs += secs
        print(f"{scheme:12s} gain x{min(gains):.3f}-x{max(gains):.3f}  "
              f"default kept at {len(rs) - len(moved)} of {len(rs)}  "
              f"tune {min(secs):.1f}-{max(secs):.1f} s")
        for r in moved:
            print(f"    B={r['B']:<2} L={r['L']:<5} x{r['gain']:.3f}  {r['default']}  ->  {r['tuned']}")
    print(f"every shape tuned in {min(allsecs):.1f}-{max(allsecs):.1f} s")


if __name__ == "__main__":
    main()
