"""Plot a bench.py results file: TFLOP/s against seqlen, one panel per (hdim, causal, mode), a line per impl.

    python bench/plot.py bench/results/<file>.jsonl [--dtype bf16] [-o bench/results/<file>.png]
"""
import argparse
import collections
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    rows = [r for r in rows if r["dtype"] == args.dtype and r["tflops"] and r["batch"] * r["seqlen"] >= 16384]
    panels = sorted({(r["hdim"], r["causal"], r["mode"]) for r in rows}, key=lambda p: (p[2], p[0], p[1]))
    cols = 4
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.2 * ((len(panels) + cols - 1) // cols)),
                             squeeze=False)
    for ax, (d, causal, mode) in zip(axes.flat, panels):
        series = collections.defaultdict(dict)
        for r in rows:
            if (r["hdim"], r["causal"], r["mode"]) == (d, causal, mode):
                series[r["impl"]][r["seqlen"]] = r["tflops"]  # later runs overwrite earlier ones
        for impl, pts in sorted(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=impl, linewidth=2 if impl == "fa2" else 1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, hdim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    device = rows[0]["device"] if rows else ""
    fig.suptitle(f"{device}, {args.dtype}, batch*seqlen = 16k, hidden 2048 (FA2 FLOP formula)")
    fig.tight_layout()
    out = args.output or str(pathlib.Path(args.results).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
