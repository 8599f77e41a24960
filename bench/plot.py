"""Plot a bench.py results file: TFLOP/s against seqlen, one panel per (hdim, causal, mode), a line per impl.

    python bench/plot.py bench/results/<file>.jsonl                       # -> bench/results/<file>-bf16.png
    python bench/plot.py bench/results/<file>.jsonl --dtype fp16 -o fp16.png
    python bench/plot.py bench/results/<file>.jsonl --shapes "batch 1, 32 heads"   # an inference sweep

Rows are grouped into shape families: "16k tokens, hidden 2048" (the default sweep: batch * seqlen = 16384,
nheads * hdim = 2048) or "batch B, H heads" (--batch/--nheads runs); one family per figure. Where a file holds
several runs of the same point, the last one wins. Runs on a CPU-only machine (matplotlib, Agg backend).
"""
import argparse
import collections
import json
import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAPER = "16k tokens, hidden 2048"
ORDER = {"fa2": 0, "sdpa_flash": 1, "sdpa_cudnn": 2}


def family(r):
    if r["batch"] * r["seqlen"] == 16384 and r["nheads"] * r["hdim"] == 2048:
        return PAPER
    return f"batch {r['batch']}, {r['nheads']} heads"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a bench.py .jsonl file")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--shapes", default=None, help=f"shape family to plot (default: '{PAPER}' if present)")
    ap.add_argument("-o", "--output", default=None, help="PNG path (default: next to the results file)")
    args = ap.parse_args()

    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    rows = [r for r in rows if r["dtype"] == args.dtype]
    families = collections.Counter(family(r) for r in rows)
    if not families:
        raise SystemExit(f"plot.py: no {args.dtype} rows in {args.results}")
    shapes = args.shapes or (PAPER if PAPER in families else families.most_common(1)[0][0])
    if shapes not in families:
        raise SystemExit(f"plot.py: no rows for shapes '{shapes}'; the file has {sorted(families)}")
    rows = [r for r in rows if family(r) == shapes]

    # (hdim, causal, mode) -> impl -> seqlen -> TFLOP/s (None where the impl failed: a gap in its line)
    panels = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in rows:
        panels[(r["hdim"], r["causal"], r["mode"])][r["impl"]][r["seqlen"]] = r["tflops"]
    keys = sorted(panels, key=lambda p: ({"fwd": 0, "bwd": 1, "fwdbwd": 2}.get(p[2], 3), p[0], p[1]))
    cols = min(4, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        d, causal, mode = key
        for impl, pts in sorted(panels[key].items(), key=lambda kv: (ORDER.get(kv[0], 9), kv[0])):
            xs = sorted(pts)
            ys = [pts[x] if pts[x] is not None else math.nan for x in xs]
            ax.plot(xs, ys, marker="o", label=impl, linewidth=2.2 if impl == "fa2" else 1.2)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for pts in panels[key].values() for x in pts})
        ax.set_xticks(ticks, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in ticks])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode}, hdim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    devices = sorted({r["device"] for r in rows})
    dates = sorted({r["date"][:10] for r in rows})
    fig.suptitle(f"{', '.join(devices)} ({', '.join(dates)}): {args.dtype}, {shapes}; FA2 FLOP formula")
    fig.tight_layout()
    out = args.output or str(pathlib.Path(args.results).with_suffix("")) + f"-{args.dtype}.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
