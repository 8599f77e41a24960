"""The loops of fa2's kernels in SASS, without a GPU: per basic block, how many instructions of each kind
it issues, which source lines they come from, and where registers spill (LDL/STL).

    python bench/sass_loops.py build/dev/_C*.so --kernel fwd_kernel.*ILi128E
    python bench/sass_loops.py fwd_hdim128_bf16.o --kernel fwd --blocks

Reads a .so, .o or .cubin; every sm_XX cubin in it is disassembled with line info (`cuobjdump -xelf`, then
`nvdisasm -g -c`). The two tools ship with the CUDA toolkit; where it lacks them (the dev box's toolkit has
neither), `pip download --no-deps nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump` gives wheels whose
nvidia/cu13/bin/ holds both (13.5 reads sm_80 and sm_90): unzip them and pass --bin DIR or put DIR on PATH.
A loop is a backward branch; the innermost long ones are the mainloops. Counts are static (one pass through
each block), so a block on a rarely taken path (mask, rescale) counts like the hot path: --blocks shows the
blocks and the branches between them.
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"\s*(\.L_x_\d+):")
SOURCE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
FUNC = re.compile(r"^\.text\.(\S+):")


def tool(name, bindir):
    path = os.path.join(bindir, name) if bindir else shutil.which(name)
    if not path or not os.path.exists(path):
        sys.exit(f"sass_loops: {name} not found (--bin DIR, or PATH); see this file's docstring")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help=".so, .o or .cubin")
    ap.add_argument("--kernel", default="fwd_kernel|bwd_kernel", help="regex on the demangled kernel name")
    ap.add_argument("--arch", default="sm_90", help="only cubins of this arch ('' for all)")
    ap.add_argument("--blocks", action="store_true", help="also each basic block of each loop")
    ap.add_argument("--top", type=int, default=20, help="opcodes listed per loop")
    ap.add_argument("--bin", default=None, help="directory holding cuobjdump and nvdisasm")
    a = ap.parse_args()
    for name, insns in disassemble(a.binary, a.bin).items():
        pretty = demangle(name.split(" [")[0]) + " [" + name.split(" [")[1]
        if not re.search(a.kernel, pretty) or (a.arch and f"[{a.arch}]" not in pretty):
            continue
        print(f"{pretty}: {len(insns)} instructions")
        report(insns, a.blocks, a.top)


if __name__ == "__main__":
    main()
