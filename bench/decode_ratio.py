"""Time over time of two KV-cache decode steps, alternated in rounds (default: the rotary append over the plain one):

    python bench/decode_ratio.py [--impls fa2_append,fa2_rotary] [--batches 1,2,4,8,16,32,64] [--seqlens-k 1024,16384]
                                 [--hdims 128]

Each round replays each step's CUDA graph 100 times (GPU time of its kernels alone) and calls it 300 times back to
back (host time per call); the medians of the rounds and the range of the per-round ratios are printed as JSON lines.
A few-percent difference on a 10-50 µs step is below bench.py decode's spread between processes; alternating both
steps in one process is what resolves it (docs/tuning.md#pdl). The steps are bench.py's kvcache_fn (GQA 32/8, bf16);
`--impls fa2_kvcache,fa2_paged --hdims 64,96,...` gives the paged cache over the unpaged one at each head dim.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import common  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="fa2_append,fa2_rotary", help="two of bench.py's KV-cache steps: base,other")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--seqlens-k", default="1024,16384")
    p.add_argument("--hdims", default="128")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    import torch
    common.require_gpu("decode_ratio.py")
    fa2 = common.load(None)
    base, other = common.csv_list(a.impls, allowed=bench.KVCACHE_IMPLS, name="--impls")
    meta = dict(device=common.device_name(), date=common.now(), mode="decode", dtype="bf16", causal=False, seqlen=1,
                nheads=32, nheads_k=8)
    shapes = [(d, b, sk) for d in common.csv_list(a.hdims, int) for b in common.csv_list(a.batches, int)
              for sk in common.csv_list(a.seqlens_k, int)]
    for d, b, sk in shapes:
        q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fns = {i: bench.kvcache_fn(i, fa2, q, k, v) for i in (base, other)}
        graphs = {i: common.graph_of(f) for i, f in fns.items()}
        gpu, host = {i: [] for i in fns}, {i: [] for i in fns}
        for _ in range(a.rounds):
            for i in fns:
                gpu[i].append(common.replay_us(graphs[i]))
                host[i].append(common.per_call_us(fns[i]))
        g = {i: statistics.median(x) for i, x in gpu.items()}
        h = {i: statistics.median(x) for i, x in host.items()}
        ratios = [o / s for o, s in zip(gpu[other], gpu[base])]
        print(json.dumps(dict(**meta, hdim=d, batch=b, seqlen_k=sk, gpu_us={i: round(x, 3) for i, x in g.items()},
                              gpu_ratio=round(g[other] / g[base], 4),
                              gpu_ratio_range=[round(min(ratios), 4), round(max(ratios), 4)],
                              host_us={i: round(x, 2) for i, x in h.items()},
                              host_ratio=round(h[other] / h[base], 4))), flush=True)
        del q, k, v, graphs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
