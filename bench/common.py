"""What bench.py and prof.py share: the FLOP formula, timing, loading a given build of fa2._C, the correctness gate
(the tests' own reference and rule), and the results rows.

Nothing here needs a GPU at import time: torch is imported where a function needs it, so `--help` and `--dry-run`
work on any machine.
"""
import atexit
import datetime
import glob
import importlib.util
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

DTYPE_NAMES = ("bf16", "fp16")
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # FlashAttention-2's convention: bwd = 5 GEMMs vs fwd's 2


def dtype(name):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def flops(batch, nheads, seqlen_q, seqlen_k, hdim, causal, mode="fwd"):
    """FlashAttention-2's FLOP count: fwd 4 * B * H * Nq * Nk * d (two GEMMs, 2 FLOPs per multiply-add), halved for
    causal; bwd 2.5x, fwd+bwd 3.5x. Recomputation in the backward is not counted."""
    return 4 * batch * nheads * seqlen_q * seqlen_k * hdim / (2 if causal else 1) * MODE_FLOPS[mode]


def csv_list(text, cast=str, allowed=None, name=""):
    """'a,b,c' -> [cast(a), cast(b), cast(c)]; exits with a message naming the option if an item is not allowed."""
    items = [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"{name}: {bad} not in {list(allowed)}")
    return items


def bools(text, name="--causal"):
    return [c == "true" for c in csv_list(str(text).lower(), allowed=("false", "true"), name=name)]


# ------------------------------------------------------------------------------------------------- timing
def time_ms(fn):
    """Median ms of one call: triton.testing.do_bench (CUDA events around each call, L2 flushed before every rep),
    25 ms of warm-up, then 100 ms of reps. The same timer as the incumbents' anchors (../shared/anchors)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def per_call_us(fn, n=300):
    """Wall µs per call of n back-to-back calls: the host's time per call once the GPU keeps up."""
    import torch
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_of(fn):
    """fn captured once in a CUDA graph (after a warm-up call on a side stream), replayed once."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def kernel_us(fn, n=100):
    """GPU µs per call of fn's kernels alone: fn captured once in a CUDA graph, the graph replayed n times."""
    return replay_us(graph_of(fn), n)


def replay_us(graph, n=100):
    """GPU µs per replay of a captured CUDA graph, n replays back to back."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def paired_inputs(fa2, batch, seqlen, nheads, hdim, dt, causal, backend):
    """q, k, v, dout (batch, seqlen, nheads, hdim) on the GPU, fa2's forward of them (out, lse), and the same inputs
    transposed for SDPA with its forward on `backend` (an SDPBackend) kept for autograd: (q, k, v, dout, out, lse,
    (qt, kt, vt), out_t)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=dt) for _ in range(3))
    dout = torch.randn_like(q)
    out, lse = fa2.fwd(q, k, v, causal=causal)
    qkv_t = tuple(t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        out_t = F.scaled_dot_product_attention(*qkv_t, is_causal=causal)
    return q, k, v, dout, out, lse, qkv_t, out_t


def require_gpu(tool):
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool}: needs a CUDA GPU (torch.cuda.is_available() is False)")


# ------------------------------------------------------------------------------------------- builds of fa2._C
def module_files(build_dir):
    """{module file name: [paths to concatenate]} of a folder holding fa2._C: whole `_C*.so` files (a CMake build dir,
    an installed package) or the 15 MB parts `_C*.so.00`, `.01`, ... that bench/verify.sh leaves in $OUT."""
    found = {}
    for path in sorted(glob.glob(os.path.join(build_dir, "_C*.so*"))):
        name = os.path.basename(path)
        whole = re.fullmatch(r"(_C.*\.so)", name)
        part = re.fullmatch(r"(_C.*\.so)\.(\d+)", name)
        if whole:
            found[whole.group(1)] = [path]
        elif part and not (found.get(part.group(1)) and len(found[part.group(1)]) == 1
                           and found[part.group(1)][0].endswith(".so")):
            found.setdefault(part.group(1), []).append(path)
    return found


def load(build_dir=None):
    """fa2, with the _C module of `build_dir` if given (a standalone CMake build dir, an installed fa2/ folder, a
    folder of module parts, or a folder holding a whole fa2/ package, which is then used as it is): this checkout's python/fa2 next to that module, in a temporary folder put first on
    sys.path. One build per process: the fa2 ops are registered once per process, so two builds cannot share one."""
    if build_dir is None:
        import fa2
        return fa2
    if os.path.isfile(os.path.join(build_dir, "fa2", "__init__.py")):
        # A whole package (an older tree's python/fa2 with its module): its Python layer matches its op schemas.
        sys.path.insert(0, os.path.abspath(build_dir))
        import fa2
        if not os.path.abspath(fa2.__file__).startswith(os.path.abspath(build_dir)):
            raise SystemExit(f"load: fa2 came from {fa2.__file__}, not from {build_dir}")
        return fa2
    files = module_files(build_dir)
    if not files:
        raise SystemExit(f"load: no _C*.so (or _C*.so.NN parts) in {build_dir}")
    root = tempfile.mkdtemp(prefix="fa2-build-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    pkg = os.path.join(root, "fa2")
    shutil.copytree(REPO / "python" / "fa2", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    for name, parts in files.items():
        if len(parts) == 1 and parts[0].endswith(".so"):
            os.symlink(os.path.abspath(parts[0]), os.path.join(pkg, name))
        else:
            with open(os.path.join(pkg, name), "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out)
    sys.path.insert(0, root)
    import fa2
    loaded = getattr(fa2.ops, "_C", None)
    if loaded is None or not os.path.abspath(loaded.__file__).startswith(root):
        raise SystemExit(f"load: fa2 came from {fa2.__file__}, _C {getattr(loaded, '__file__', None)} "
                         f"({getattr(fa2.ops, '_IMPORT_ERROR', '')}), not from {build_dir}")
    return fa2


# ------------------------------------------------------------------------------------ correctness: tests' rule
def tolerance():
    """fa2.testing: FlashAttention's 2x rule, the one the test suite holds every kernel to. Where load() put an older
    tree's whole package without fa2.testing first on sys.path, this checkout's python/fa2/testing.py, loaded from its
    file (the rule is pure torch)."""
    try:
        import fa2.testing as tol
        return tol
    except ImportError:
        spec = importlib.util.spec_from_file_location("fa2_testing", REPO / "python" / "fa2" / "testing.py")
        tol = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tol)
        return tol


CHECK_SHAPES = [(1, 1, 1, 4, 4), (2, 113, 203, 4, 4), (2, 128, 128, 8, 2), (1, 1000, 1000, 8, 2)]  # b, sq, sk, h, hk


def reference_check(fa2, hdims, dtype_name, bwd=True, shapes=CHECK_SHAPES, log=print, device="cuda"):
    """fa2.fwd (out, lse) and fa2.bwd (dq, dk, dv) against fa2.reference.attention_ref with fa2.testing's rule,
    as tests/test_fwd.py and tests/test_bwd.py hold them, on a few odd shapes (MHA and GQA, causal and not). A gate
    for a benchmark (a build that is wrong is not timed as if it were right), not a replacement for the tests.
    Returns True if every check passed; prints one line per failure."""
    import torch
    from fa2.reference import attention_ref
    tol = tolerance()
    dt = dtype(dtype_name)
    ok, count = True, 0
    for d in hdims:
        for b, sq, sk, h, hk in shapes:
            for causal in (False, True):
                tag = f"{dtype_name} d{d} b{b} {sq}x{sk} h{h}:{hk} causal={causal}"
                q = torch.randn(b, sq, h, d, device=device, dtype=dt)
                k, v = (torch.randn(b, sk, hk, d, device=device, dtype=dt) for _ in range(2))
                try:
                    out = tol.poison(torch.empty_like(q))
                    out, lse = fa2.fwd(q, k, v, causal=causal, out=out)
                    tol.assert_written(out, name=f"out {tag}")
                    ref64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=causal)
                    ref_low, _ = attention_ref(q, k, v, causal=causal, upcast=False)
                    _, lse32 = attention_ref(q, k, v, causal=causal, dtype=torch.float32)
                    tol.assert_close_to_ref(out, ref64, ref_low, name=f"out {tag}")
                    tol.assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")
                    count += 2
                    if bwd:
                        dout = torch.randn_like(q)
                        got = fa2.bwd(dout, q, k, v, out, lse, causal=causal)
                        refs = []
                        for upcast in (True, False):
                            cast = (lambda t: t.double()) if upcast else (lambda t: t)
                            leaves = [cast(t).detach().clone().requires_grad_() for t in (q, k, v)]
                            o, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
                            refs.append(torch.autograd.grad(o, leaves, cast(dout)))
                        scale = max((r.abs().max().item() for r in refs[0] if r.numel()), default=0.0)
                        for name, g, r64, rl in zip(("dq", "dk", "dv"), got, *refs):
                            tol.assert_close_to_ref(g, r64, rl, name=f"{name} {tag}", scale=scale)
                        count += 3
                except (AssertionError, RuntimeError, ValueError) as e:
                    ok = False
                    log(f"FAIL {str(e).splitlines()[0][:300]}")
    if device == "cuda":
        torch.cuda.synchronize()
    log(f"reference check ({count} tensors, fa2.testing's rule): {'PASS' if ok else 'FAIL'}")
    return ok


# ---------------------------------------------------------------------------------------------- results rows
def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_name():
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def slug(device):
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def default_out(device, date, suffix=""):
    """bench/results/<gpu>-<date><suffix>.jsonl"""
    return RESULTS / f"{slug(device)}-{date[:10]}{suffix}.jsonl"


class Rows:
    """Appends one JSON object per measurement to a .jsonl file (None: nowhere), each with the keys every bench mode
    shares: impl, mode, dtype, hdim, causal, seqlen, batch, nheads, ms, tflops, device, date, bench."""
    KEYS = ("impl", "mode", "dtype", "hdim", "causal", "seqlen", "batch", "nheads", "ms", "tflops", "device", "date")

    def __init__(self, path, bench, device, date):
        self.path, self.bench, self.device, self.date = path, bench, device, date
        self.file = None
        if path is not None:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")

    def write(self, **row):
        row = {"device": self.device, "date": self.date, "bench": self.bench, **row}
        missing = [k for k in self.KEYS if k not in row]
        assert not missing, f"results row lacks {missing}: {row}"
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        return row

    def close(self):
        if self.file is not None:
            self.file.close()


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def header(tool, fa2=None):
    """The first line of every table: device, torch, cuDNN, fa2's build."""
    import torch
    info = ""
    if fa2 is not None:
        try:
            info = f", fa2 {fa2.build_info()}"
        except Exception as e:  # an unbuilt fa2: the SDPA columns still run
            info = f", fa2 not usable ({type(e).__name__})"
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    return f"# {tool}: {device_name()}, torch {torch.__version__}, cudnn {cudnn}{info}"
