"""fa2's profiling entry point. docs/profiling.md has the recipes (Nsight Systems, Nsight Compute, SASS).

    python bench/prof.py kernel --mode bwd --hdim 128 --seqlen 4096   # one fa2 config in NVTX "profile" ranges
    python bench/prof.py vs-flash --mode bwd --hdims 64,128           # one fa2 and one FA2 (SDPA-flash) call each
    python bench/prof.py source source.csv.gz [--groups]              # where warps stall, per SASS instruction
    python bench/prof.py sass build/dev/_C.abi3.so --kernel "fwd_kernel<.*<128,"  # mainloop SASS, no GPU
    python bench/prof.py step --compile                               # a training step under torch.profiler
    python bench/prof.py parts --mode bwd                             # per-kernel time, fa2 and SDPA-cuDNN

kernel and vs-flash are targets for ncu (or nsys); run alone they print a sanity time only: bench/bench.py is where
timings come from. `ncu` command lines are in each mode's --help; bench/verify.sh's ncu mode runs vs-flash and source
on the GPU box.
"""
import argparse
import collections
import csv
import glob
import gzip
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


# ------------------------------------------------------------------------------------------------------ kernel
def run_kernel(a):
    import torch
    common.require_gpu("prof.py kernel")
    fa2 = common.load(a.build)
    b, h = a.batch or max(1, 16384 // a.seqlen), a.nheads or max(1, 2048 // a.hdim)
    dtype = common.dtype(a.dtype)
    q, k, v = (torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=dtype, requires_grad=a.mode == "fwdbwd")
               for _ in range(3))
    with torch.no_grad():
        out, lse = fa2.fwd(q, k, v, causal=a.causal)
    dout = torch.randn_like(out)

    def call():
        if a.mode == "fwd":
            fa2.fwd(q, k, v, causal=a.causal, out=out)
        elif a.mode == "bwd":
            fa2.bwd(dout, q, k, v, out, lse, causal=a.causal, deterministic=a.deterministic)
        else:
            torch.autograd.grad(fa2.attention(q, k, v, causal=a.causal), (q, k, v), dout)

    for _ in range(a.warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.iters):
        with torch.cuda.nvtx.range("profile"):
            call()
    end.record()
    torch.cuda.synchronize()
    print(f"{a.mode} {a.dtype} hdim {a.hdim} seqlen {a.seqlen} batch {b} nheads {h} causal {a.causal}: "
          f"{start.elapsed_time(end) / max(1, a.iters):.3f} ms per call (mean of {a.iters}; a sanity check only)")
    return 0


# ---------------------------------------------------------------------------------------------------- vs-flash
def run_vs_flash(a):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    common.require_gpu("prof.py vs-flash")
    fa2 = common.load(a.build)
    for d in common.csv_list(a.hdims, int):
        b, n, h = max(1, 16384 // a.seqlen), a.seqlen, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=common.dtype(a.dtype)) for _ in range(3))
        do = torch.randn_like(q)
        o, lse = fa2.fwd(q, k, v, causal=a.causal)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
        if a.mode == "fwd":
            continue
        fa2.bwd(do, q, k, v, o, lse, causal=a.causal)
        torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
    torch.cuda.synchronize()
    return 0


# ------------------------------------------------------------------------------------------------------ source
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


def run_source(a):
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
    return 0


# -------------------------------------------------------------------------------------------------------- sass
INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"\s*(\.L_x_\d+):")
SOURCE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
FUNC = re.compile(r"^\.text\.(\S+):")


def tool(name, bindir):
    path = os.path.join(bindir, name) if bindir else shutil.which(name)
    if not path or not os.path.exists(path):
        sys.exit(f"prof.py sass: {name} not found (--bin DIR, or PATH); see `prof.py sass --help`")
    return path


def disassemble(binary, bindir):
    """{function name: [(addr, opcode, text, 'file:line', label or None)]} over every cubin in `binary`."""
    funcs = {}
    with tempfile.TemporaryDirectory() as tmp:
        if binary.endswith(".cubin"):
            cubins = [binary]
        else:
            subprocess.run([tool("cuobjdump", bindir), "-xelf", "all", os.path.abspath(binary)], cwd=tmp,
                           check=True, capture_output=True)
            cubins = sorted(glob.glob(os.path.join(tmp, "*.cubin")))
        for cubin in cubins:
            text = subprocess.run([tool("nvdisasm", bindir), "-g", "-c", cubin], check=True, capture_output=True,
                                  text=True).stdout
            arch = re.search(r"sm_\d+", os.path.basename(cubin))
            name, src, label = None, None, None
            for line in text.splitlines():
                if m := FUNC.match(line.strip()):
                    name = f"{m.group(1)} [{arch.group(0) if arch else '?'}]"
                    funcs[name] = []
                elif m := SOURCE.match(line):
                    src = f"{os.path.basename(m.group(1))}:{m.group(2)}"
                elif m := LABEL.match(line):
                    label = m.group(1)
                elif (m := INSN.match(line)) and name:
                    txt = m.group(2)
                    bare = re.sub(r"^@!?U?P\w+\s+", "", txt)
                    funcs[name].append((int(m.group(1), 16), bare.split()[0].split(".")[0] if bare else "", txt,
                                        src, label))
                    label = None
    return funcs


def demangle(name):
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() or name
    except OSError:
        return name


def report(insns, show_blocks, top):
    labels = {ins[4]: ins[0] for ins in insns if ins[4]}
    loops = []
    for addr, op, txt, _, _ in insns:
        target = re.search(r"(\.L_x_\d+)", txt)
        if op == "BRA" and target and labels.get(target.group(1), addr) < addr:
            loops.append((labels[target.group(1)], addr))
    loops = [lp for lp in loops if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in loops)]  # outermost
    for begin, end in loops:
        body = [ins for ins in insns if begin <= ins[0] <= end]
        ops = collections.Counter(ins[1] for ins in body)
        print(f"  loop {begin:#x}-{end:#x}: {len(body)} instructions; "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(top)))
        for ins in body:
            if ins[1] in ("LDL", "STL"):
                print(f"    spill {ins[0]:#06x} {ins[2][:48]:48} {ins[3]}")
        if not show_blocks:
            continue
        blocks, cur = [], []
        for ins in body:
            if ins[4] and cur:
                blocks.append(cur)
                cur = []
            cur.append(ins)
        blocks.append(cur)
        for blk in blocks:
            ops = collections.Counter(ins[1] for ins in blk)
            srcs = collections.Counter(ins[3] for ins in blk)
            print(f"    block {blk[0][0]:#06x} {blk[0][4] or '':9} {len(blk):4}: "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))
            print(f"{'':26}from " + ", ".join(f"{k} {v}" for k, v in srcs.most_common(4)))
            if blk[-1][1] == "BRA":
                print(f"{'':26}ends {blk[-1][2][:60]}")


def run_sass(a):
    names, matched = [], 0
    for name, insns in disassemble(a.binary, a.bin).items():
        pretty = demangle(name.split(" [")[0]) + " [" + name.split(" [")[1]
        names.append(pretty)
        if not re.search(a.kernel, pretty) or (a.arch and f"[{a.arch}]" not in pretty):
            continue
        matched += 1
        print(f"{pretty}: {len(insns)} instructions")
        report(insns, a.blocks, a.top)
    if not matched:  # say so, with what there is (the regex sees demangled names)
        print(f"prof.py sass: no kernel matches --kernel {a.kernel!r}{' and --arch ' + a.arch if a.arch else ''}; "
              f"{len(names)} functions, e.g.:\n  " + "\n  ".join(sorted(names)[:8]), file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------------- parts
PARTS_DOC = """Per-kernel GPU time (torch.profiler, the mean of 10 calls) of one fa2.fwd or fa2.bwd call and of the same
call through SDPA's cuDNN backend, at the sweep's shapes (16k tokens, hidden 2048): a call's fixed passes (the
backward's D = rowsum(dO * O) and dQ conversion) beside its main kernel, for both."""


def run_parts(a):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    common.require_gpu("prof.py parts")
    fa2 = common.load(a.build)
    dt = common.dtype(a.dtype)
    print(common.header("prof.py parts", fa2))
    print(f"# {a.mode}, {a.dtype}: us per call, total then its kernels (the 4 longest)")
    for d in common.csv_list(a.hdims, int):
        for n in common.csv_list(a.seqlens, int):
            for causal in (False, True):
                q, k, v, do, o, lse, (qt, kt, vt), ot = common.paired_inputs(
                    fa2, 16384 // n, n, 2048 // d, d, dt, causal, SDPBackend.CUDNN_ATTENTION)

                def cudnn_fwd():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                calls = ({"fa2": lambda: fa2.fwd(q, k, v, causal=causal), "sdpa_cudnn": cudnn_fwd} if a.mode == "fwd"
                         else {"fa2": lambda: fa2.bwd(do, q, k, v, o, lse, causal=causal),
                               "sdpa_cudnn": lambda: torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2),
                                                                         retain_graph=True)})
                for name, fn in calls.items():
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(10):
                            fn()
                        torch.cuda.synchronize()
                    per_kernel = defaultdict(float)
                    for e in prof.events():
                        if e.device_type == torch.autograd.DeviceType.CUDA:
                            per_kernel[e.name] += e.device_time_total / 10
                    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:4]
                    print(f"d{d} {n:>5} {'causal' if causal else 'full  '} {name:>10}: {sum(per_kernel.values()):8.1f}  "
                          + "; ".join(f"{demangle(kn)[:44]} {us:.1f}" for kn, us in top), flush=True)
                del q, k, v, do, o, lse, qt, kt, vt, ot
                torch.cuda.empty_cache()
    return 0


# -------------------------------------------------------------------------------------------------------- step
def run_step(a):
    import torch
    from torch.profiler import ProfilerActivity, profile
    common.require_gpu("prof.py step")
    fa2 = common.load(a.build)
    sys.path.insert(0, str(common.REPO / "examples"))
    import train_gpt

    dim, nheads, layers, vocab = 384, 6, 6, 110
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GPT {layers}x{dim} ({nheads} heads of "
          f"{dim // nheads}), batch {a.batch} x {a.seqlen}, bf16 autocast, compile={a.compile}")
    x = torch.randint(0, vocab, (a.batch, a.seqlen), device="cuda")
    for attention in ("fa2", "sdpa"):
        torch.manual_seed(0)
        model = train_gpt.GPT(vocab, dim=dim, nheads=nheads, layers=layers, seqlen=a.seqlen,
                              attention=attention).cuda()
        run = torch.compile(model, fullgraph=True) if a.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            host = (time.perf_counter() - t0) / a.steps * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.steps * 1e3
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        gpu = sum(e.self_device_time_total for e in events) / a.steps / 1e3
        print(f"\n## {attention}: {wall:.2f} ms/step wall, {host:.2f} ms/step host (until the last launch), "
              f"{gpu:.2f} ms/step of kernels")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:a.rows]:
            print(f"  {e.self_device_time_total / a.steps / 1e3:7.3f} ms  {e.count // a.steps:4d}x  {e.key[:110]}")

    q, k, v = (torch.randn(a.batch, a.seqlen, nheads, dim // nheads, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    print(f"\n## attention alone, {tuple(q.shape)} causal: GPU (graph replay) / eager wall, µs per call")
    for name, fn in (("fa2", lambda q, k, v: fa2.attention(q, k, v, causal=True)),
                     ("sdpa", lambda q, k, v: train_gpt.sdpa_attention(q, k, v))):
        def fwd():
            with torch.no_grad():
                fn(q, k, v)

        def fwdbwd():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        for mode, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
            print(f"  {name:5} {mode:8} {common.kernel_us(f, 50):8.1f} / {common.per_call_us(f, 50):8.1f}")
    return 0


# -------------------------------------------------------------------------------------------------- arguments
NCU_KERNEL = """Under Nsight Compute (warm-up calls first, outside any range; each profiled call in an NVTX range
"profile"):

    ncu --clock-control none --nvtx --nvtx-include "profile/" \\
        --kernel-name-base demangled --kernel-name regex:fa2:: --set full -o fa2_bwd_d128 \\
        python bench/prof.py kernel --mode bwd --hdim 128 --seqlen 4096

fa2's kernels: fa2::fwd_kernel<...>, fa2::bwd_preprocess_kernel, fa2::bwd_kernel<...>, fa2::bwd_dq_kernel<...>
(--deterministic) and fa2::bwd_convert_dq_kernel; the template arguments name the tile configuration.
`--launch-count 1` stops after the first kernel; `--import-source yes` embeds the source -lineinfo points at. Text
instead of a report: replace `--set full -o NAME` by `--section SpeedOfLight --section ComputeWorkloadAnalysis
--section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SourceCounters`."""

NCU_VS_FLASH = """One fa2 and one SDPA-flash (FlashAttention-2's own kernels) call per head dim on the same inputs, for ncu
to report both kernels side by side (no NVTX filter: autograd's backward runs on another thread; no warm-up, ncu
replays each kernel anyway):

    ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:bwd_kernel|dq_dk_dv" \\
        --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_ldsm.sum \\
        python bench/prof.py vs-flash --mode bwd --hdims 64,128

(forward: --mode fwd and regex:fwd_kernel|flash_fwd). bench/verify.sh ncu runs this with the stall metrics
docs/performance.md compares, and with NCU_SOURCE a --set full report's per-instruction page for `source`."""

SOURCE_DOC = """Reads the per-SASS-instruction page of an ncu report,

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz

(bench/verify.sh's ncu mode writes it with NCU_SOURCE=...) and prints for each kernel the warp-stall samples by
reason, by opcode, and the instructions that collect the most samples of --reasons. --groups puts the two forward
kernels of the report side by side instead (fa2's first, FA2's second): stall samples and executed instructions per
group of work (S = Q K^T MMAs, O += P V MMAs, their ldmatrix, softmax arithmetic, global->shared copies, ...), and
which instruction produced the operands the MMAs waited for. An MMA is put in a group by where its B operand came
from (ldmatrix for S, ldmatrix.trans for P V)."""

SASS_DOC = """Per loop of a kernel (a backward branch; the innermost long ones are the mainloops): how many instructions
of each kind it issues, which source lines they come from, and where registers spill (LDL/STL). Reads a .so, .o or
.cubin; every sm_XX cubin in it is disassembled with line info (`cuobjdump -xelf`, then `nvdisasm -g -c`). Where the
toolkit lacks the two tools, `pip download --no-deps nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump` gives wheels whose
nvidia/cu13/bin/ holds both (13.x reads sm_80 and sm_90): unzip them and pass --bin DIR or put DIR on PATH. Counts
are static (one pass through each block): --blocks shows the blocks and the branches between them."""

STEP_DOC = """examples/train_gpt.py's model, a few steps under torch.profiler for fa2 and for SDPA: GPU time per kernel (top
rows) and host vs device time per step; then fa2.attention alone on the step's shape, forward and forward+backward,
as GPU time (CUDA-graph replay) and eager wall time per call."""


def parser():
    ap = argparse.ArgumentParser(prog="prof.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True, metavar="MODE")

    def mode(name, help_line, doc, run):
        p = sub.add_parser(name, help=help_line, description=help_line + "\n\n" + doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=run)
        return p

    p = mode("kernel", "One fa2 configuration: warm-up calls, then --iters calls each in an NVTX range 'profile'.",
             NCU_KERNEL, run_kernel)
    p.add_argument("--mode", choices=["fwd", "bwd", "fwdbwd"], default="fwd",
                   help="fwd: fa2.fwd; bwd: fa2.bwd on a saved forward; fwdbwd: fa2.attention + autograd")
    p.add_argument("--dtype", choices=common.DTYPE_NAMES, default="bf16")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen (16k tokens)")
    p.add_argument("--nheads", type=int, default=None, help="default 2048 // hdim (hidden 2048)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--deterministic", action="store_true", help="bwd: the deterministic dQ path")
    p.add_argument("--warmup", type=int, default=2, help="calls before the profiled ones (not in a range)")
    p.add_argument("--iters", type=int, default=3, help="profiled calls, each in an NVTX range 'profile'")
    p.add_argument("--build", default=None, help="fa2._C of this folder (CMake build dir or _C*.so.NN parts)")

    p = mode("vs-flash", "One fa2 call and one SDPA-flash call per head dim on the same inputs (16k tokens, "
                         "hidden 2048), for ncu side by side.", NCU_VS_FLASH, run_vs_flash)
    p.add_argument("--build", default=None, help="fa2._C of this folder (CMake build dir or _C*.so.NN parts)")
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--dtype", choices=common.DTYPE_NAMES, default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd",
                   help="fwd: the forwards only (filter: regex:fwd_kernel|flash_fwd)")

    p = mode("source", "Where a kernel's warps stall, by reason, SASS opcode and instruction, from ncu's source page "
                       "as CSV (no GPU).", SOURCE_DOC, run_source)
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    p.add_argument("--kernels", default="fa2::bwd_kernel,fa2::fwd_kernel,dq_dk_dv,flash_fwd_kernel",
                   help="comma list of substrings; kernels matching none are skipped")
    p.add_argument("--reasons", default="lg,barrier,long_sb,mio,short_sb",
                   help="stall reasons (ncu's stall_* columns) to list the top instructions of")
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--groups", action="store_true", help="compare the two forward kernels by group of work")

    p = mode("sass", "The loops of fa2's kernels in SASS, without a GPU: instruction mix per loop and basic block, "
                     "source lines, spills.", SASS_DOC, run_sass)
    p.add_argument("binary", help=".so, .o or .cubin")
    p.add_argument("--kernel", default="fwd_kernel|bwd_kernel", help="regex on the demangled kernel name")
    p.add_argument("--arch", default="sm_90", help="only cubins of this arch ('' for all)")
    p.add_argument("--blocks", action="store_true", help="also each basic block of each loop")
    p.add_argument("--top", type=int, default=20, help="opcodes listed per loop")
    p.add_argument("--bin", default=None, help="directory holding cuobjdump and nvdisasm")

    p = mode("parts", "Per-kernel GPU time of one fa2 call and of SDPA-cuDNN's at the sweep's shapes (torch.profiler).",
             PARTS_DOC, run_parts)
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--dtype", choices=common.DTYPE_NAMES, default="bf16")
    p.add_argument("--build", default=None, help="fa2._C of this folder (CMake build dir or _C*.so.NN parts)")

    p = mode("step", "Where a training step's time goes: examples/train_gpt.py's GPT under torch.profiler, fa2 and "
                     "SDPA.", STEP_DOC, run_step)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--build", default=None, help="fa2._C of this folder (CMake build dir or _C*.so.NN parts)")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
