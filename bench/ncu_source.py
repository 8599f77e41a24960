"""Where a kernel's warps stall, by SASS opcode and instruction: reads the per-instruction page of an ncu report,

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz

(bench/verify.sh's ncu mode writes it with NCU_SOURCE=...), and prints for each kernel in it the warp-stall samples
by reason, by opcode, and the instructions that collect the most samples of the reasons asked for:

    python bench/ncu_source.py source.csv.gz [--kernels fa2::bwd_kernel,dq_dk_dv] [--reasons lg,barrier] [--top 8]
"""
import argparse
import csv
import gzip
import io
import re
from collections import Counter, defaultdict


def kernels(path):
    """{kernel name: [row dict per SASS instruction]}; a kernel listed twice keeps its first listing."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out, name, header, rows = {}, None, None, []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            if name and name not in out:
                out[name] = rows
            name, header, rows = next(csv.reader(io.StringIO(line)))[1], None, []
        elif header is None and line.startswith('"Address"'):
            header = next(csv.reader(io.StringIO(line)))
        elif header is not None and line.startswith('"0x'):
            rows.append(dict(zip(header, next(csv.reader(io.StringIO(line))))))
    if name and name not in out:
        out[name] = rows
    return out


def opcode(source):
    """'@!P0 LDG.E.128 R4, [R2.64]' -> 'LDG'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def num(value):
    try:
        return int(value.replace(",", ""))
    except (ValueError, AttributeError):
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--kernels", default="fa2::bwd_kernel,fa2::fwd_kernel,dq_dk_dv,flash_fwd_kernel",
                    help="comma list of substrings; kernels matching none are skipped")
    ap.add_argument("--reasons", default="lg,barrier,long_sb,mio,short_sb",
                    help="stall reasons (ncu's stall_* columns) to list the top instructions of")
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    wanted = a.kernels.split(",")
    for name, rows in kernels(a.csv).items():
        if not any(w in name for w in wanted):
            continue
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        total = Counter()
        by_op = defaultdict(Counter)
        for r in rows:
            for c in reasons:
                n = num(r[c])
                total[c] += n
                by_op[opcode(r["Source"])][c] += n
        samples = sum(total.values())
        print(f"\n== {re.sub(r'[(]int[)]|[(]bool[)]', '', name)[:160]}")
        print(f"   {len(rows)} SASS instructions, {samples} stall samples; by reason (% of samples):")
        print("   " + ", ".join(f"{c[6:]} {100 * n / samples:.1f}" for c, n in total.most_common() if n))
        print("   by opcode (% of all samples: total, then the largest reasons):")
        ops = sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))
        for op, cnt in ops[:10]:
            share = 100 * sum(cnt.values()) / samples
            parts = ", ".join(f"{c[6:]} {100 * n / samples:.1f}" for c, n in cnt.most_common(3) if n)
            print(f"     {op:10} {share:5.1f}  ({parts})")
        for reason in a.reasons.split(","):
            col = f"stall_{reason}"
            if col not in rows[0] or not total[col]:
                continue
            top = sorted(rows, key=lambda r: -num(r[col]))[:a.top]
            print(f"   top instructions by {reason} ({100 * total[col] / samples:.1f}% of samples):")
            for r in top:
                print(f"     {100 * num(r[col]) / samples:5.2f}%  {r['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()
