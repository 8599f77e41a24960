"""Where a kernel's warps stall, by SASS opcode and instruction: reads the per-instruction page of an ncu report,

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz

(bench/verify.sh's ncu mode writes it with NCU_SOURCE=...), and prints for each kernel in it the warp-stall samples
by reason, by opcode, and the instructions that collect the most samples of the reasons asked for:

    python bench/ncu_source.py source.csv.gz [--kernels fa2::bwd_kernel,dq_dk_dv] [--reasons lg,barrier] [--top 8]

--groups puts the forward kernels of the report side by side instead (fa2's first, FA2's second): stall samples
and executed instructions per group of work (the S = Q K^T MMAs, the O += P V MMAs, their ldmatrix, the softmax
arithmetic, the global->shared copies, ...), and which instruction produced the operands that the MMAs waited
for. An MMA is put in a group by where its B operand came from (ldmatrix for S, ldmatrix.trans for P V).
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




def num(value):
    try:
        return int(value.replace(",", ""))
    except (ValueError, AttributeError):
        return 0


SOFTMAX_OPS = {"FMNMX", "SHFL", "FMUL", "FFMA", "MUFU", "FADD", "F2FP", "FSETP", "FSEL", "VOTE", "FSWZADD"}


def registers(source):
    """'HMMA.16816.F32.BF16 R24, R172, R36, R24' -> ('HMMA.16816.F32.BF16', [[24], [172], [36], [24]])."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    op, _, rest = text.partition(" ")
    return op, [[int(x) for x in re.findall(r"\bR(\d+)\b", part)] for part in rest.split(",")]


def opcode(source):
    """'@!P0 LDG.E.128 R4, [R2.64]' -> 'LDG'."""
    return registers(source)[0].split(".")[0] or "?"


def work_groups(rows):
    """Per group of work: stall samples, instructions executed, and (for the MMA groups) the opcode that last
    wrote an A or B register of MMAs that stalled on `wait` or `short_sb`, weighted by those samples."""
    writer = {}  # register -> (position, full opcode) of the instruction that last wrote it, in program order
    samples, executed, producers = Counter(), Counter(), defaultdict(Counter)
    for i, r in enumerate(rows):
        op, regs = registers(r["Source"])
        base = op.split(".")[0]
        if base == "HMMA":
            b_src = writer.get(regs[2][0], (-1, ""))[1]
            group = "mma P V" if "MT88" in b_src else "mma S" if b_src.startswith("LDSM") else "mma other"
            waited = num(r.get("stall_wait", "0")) + num(r.get("stall_short_sb", "0"))
            last = max(writer.get(regs[1][0], (-1, "?")), writer.get(regs[2][0], (-1, "?")))
            producers[group][last[1].split(".")[0]] += waited
        elif base == "LDSM":
            group = "ldmatrix.trans (V)" if "MT88" in op else "ldmatrix (Q, K)"
        elif base in SOFTMAX_OPS:
            group = "softmax arithmetic"
        elif base in ("LDGSTS", "LDGDEPBAR", "DEPBAR") or (base == "STS" and "RZ" in r["Source"]) or \
                r["Source"].strip().startswith("@!PT"):
            group = "global->shared copies"
        elif base == "BAR":
            group = "barrier"
        elif base in ("BRA", "EXIT", "BSYNC", "BSSY", "WARPSYNC"):
            group = "branch"
        elif base in ("LDL", "STL"):
            group = "spill"
        else:
            group = "integer, address, other"
        samples[group] += num(r["Warp Stall Sampling (All Samples)"])
        executed[group] += num(r["Instructions Executed"])
        # LDSM.x4 writes 4 registers, HMMA 4 accumulators; anything else is counted by its first register.
        width = 4 if base in ("LDSM", "HMMA") else 1
        if regs and regs[0] and base not in ("STS", "STG", "RED", "REDG", "BAR", "BRA", "LDGSTS"):
            for k in range(width):
                writer[regs[0][0] + k] = (i, op)
    return samples, executed, producers


def compare_groups(ks):
    fwd = [(n, rows) for n, rows in ks.items() if "fwd_kernel" in n]
    if len(fwd) != 2:
        raise SystemExit(f"--groups wants two forward kernels in the report, found {len(fwd)}")
    (name_a, rows_a), (name_b, rows_b) = fwd
    sa, ea, pa = work_groups(rows_a)
    sb, eb, pb = work_groups(rows_b)
    ta, tb = sum(sa.values()), sum(sb.values())
    short = lambda n: re.sub(r"[(]int[)]|[(]bool[)]", "", n)[:110]  # noqa: E731
    print(f"A = {short(name_a)}\nB = {short(name_b)}")
    print(f"{'group':26} {'samples A':>10} {'samples B':>10} {'A - B':>8} {'% of B':>7}  {'instructions A / B, M':>22}")
    for g in sorted(set(sa) | set(sb), key=lambda g: -(sa[g] + sb[g])):
        print(f"{g:26} {sa[g]:10d} {sb[g]:10d} {sa[g] - sb[g]:8d} {100 * (sa[g] - sb[g]) / tb:7.1f}  "
              f"{ea[g] / 1e6:10.2f} / {eb[g] / 1e6:8.2f}")
    print(f"{'total':26} {ta:10d} {tb:10d} {ta - tb:8d} {100 * (ta - tb) / tb:7.1f}  "
          f"{sum(ea.values()) / 1e6:10.2f} / {sum(eb.values()) / 1e6:8.2f}")
    for g in ("mma S", "mma P V"):
        fmt = lambda c: ", ".join(f"{op} {n}" for op, n in c.most_common(3) if n)  # noqa: E731
        print(f"{g}: wait + short_sb samples by the opcode that last wrote an operand: A {fmt(pa[g])}; "
              f"B {fmt(pb[g])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--kernels", default="fa2::bwd_kernel,fa2::fwd_kernel,dq_dk_dv,flash_fwd_kernel",
                    help="comma list of substrings; kernels matching none are skipped")
    ap.add_argument("--reasons", default="lg,barrier,long_sb,mio,short_sb",
                    help="stall reasons (ncu's stall_* columns) to list the top instructions of")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--groups", action="store_true", help="compare the two forward kernels by group of work")
    a = ap.parse_args()
    if a.groups:
        return compare_groups(kernels(a.csv))
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
