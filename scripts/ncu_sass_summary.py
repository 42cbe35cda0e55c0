"""Summarise Nsight Compute's SASS source export (`ncu --import R.ncu-rep --page source --print-source sass --csv`):
the lines holding at least ``--min-share`` of the warp stall samples with their main stall reasons, then the
samples by region of equal execution count (a warpgroup's loop, its epilogue) and by stall reason within each.

    python scripts/ncu_sass_summary.py R_sass.csv > R_sass_top.txt

Read this way, a warp-specialised body shows which warpgroup waits on what.
"""

import argparse
import csv


def _value(row, ix, key):
    try:
        return float(row[ix[key]].replace(",", "") or 0)
    except (KeyError, ValueError):
        return 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sass_csv")
    p.add_argument("--min-share", type=float, default=0.002, help="lines with at least this share of the samples")
    a = p.parse_args()
    rows = list(csv.reader(open(a.sass_csv)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    h, data = rows[header], [r for r in rows[header + 1 :] if len(r) > 3]
    ix = {k: i for i, k in enumerate(h)}
    stalls = [k for k in h if k.startswith("stall_") and "Not Issued" not in k]
    samples = [_value(r, ix, "Warp Stall Sampling (All Samples)") for r in data]
    total = sum(samples) or 1.0
    print(f"# {len(data)} SASS lines, {total:.0f} warp stall samples")
    print("# line  share  executed  top stalls | SASS")
    for i, (r, n) in enumerate(zip(data, samples)):
        if n / total >= a.min_share:
            top = sorted(((k[6:], _value(r, ix, k)) for k in stalls), key=lambda kv: -kv[1])[:2]
            why = " ".join(f"{k}={v:.0f}" for k, v in top if v)
            executed = _value(r, ix, "Instructions Executed")
            print(f"{i:5d} {100 * n / total:5.1f}% {executed:9.0f}  {why:30s} | {r[ix['Source']].strip()[:80]}")
    print("\n# regions (runs of lines with one execution count of 1000 or more, merged while the count holds)")
    start, count = 0, None
    regions = []
    for i, r in enumerate(data + [None]):
        c = None if r is None else _value(r, ix, "Instructions Executed")
        if c != count:
            if count is not None and count >= 1000:
                regions.append((start, i, count))
            start, count = i, c
    for a_, b_, c in regions:
        share = sum(samples[a_:b_]) / total
        if share < 0.005:
            continue
        by = sorted(
            ((k[6:], sum(_value(data[j], ix, k) for j in range(a_, b_))) for k in stalls), key=lambda kv: -kv[1]
        )
        print(
            f"lines {a_}-{b_ - 1}: executed {c:.0f}, {100 * share:.1f}% of samples; "
            + ", ".join(f"{k} {v:.0f}" for k, v in by[:3] if v)
        )


if __name__ == "__main__":
    main()
