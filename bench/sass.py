"""The machine code of a built module, per (arch, kernel), for showing that a change left the kernels alone.

    python3 bench/sass.py dump fa2/_C.abi3.so old.json.gz     # cuobjdump -sass, one entry per (arch, kernel)
    python3 bench/sass.py compare old.json.gz new.json.gz     # identical / same modulo parameter offsets / differs

A kernel's SASS is kept without addresses and encodings. "Same modulo parameter offsets" means the instructions are
identical once the constant-bank offsets of kernel parameters (c[0x0][0x...]) and branch targets are blanked: the
kernel reads the same fields of a parameter struct whose layout moved. Other kernels are diffed line by line
(difflib), and the count of differing instructions and places says how far the change reached. Needs cuobjdump.
"""
import argparse
import difflib
import gzip
import json
import re
import subprocess
import sys

ARCH = re.compile(r"arch = (sm_\d+\w*)")
FUNC = re.compile(r"^\s*Function : (\S+)")
INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
TARGET = re.compile(r"^((?:@!?U?P\w+ )?(?:BRA|BSSY|CALL\.REL(?:\.NOINC)?|JMP|BRX)\S*\s.*?)0x[0-9a-f]+")


def normal(instructions: list) -> list:
    """Parameter offsets and branch targets blanked: what stays is what the kernel computes and in which order."""
    return [TARGET.sub(r"\1#", PARAM.sub("c[0x0][#]", i)) for i in instructions]


def dump(module: str) -> dict:
    text = subprocess.run(["cuobjdump", "-sass", module], check=True, capture_output=True, text=True).stdout
    kernels, arch, name = {}, "?", None
    for line in text.splitlines():
        if m := ARCH.search(line):
            arch, name = m.group(1), None
        elif m := FUNC.match(line):
            name = f"{arch} {m.group(1)}"
            kernels[name] = []
        elif name and (m := INSTR.search(line)):
            kernels[name].append(m.group(1))
    return kernels


def compare(old: dict, new: dict, show: int = 0) -> int:
    same = moved = n_differ = 0
    differs, only_old, only_new = [], sorted(set(old) - set(new)), sorted(set(new) - set(old))
    for name in sorted(set(old) & set(new)):
        a, b = normal(old[name]), normal(new[name])
        if old[name] == new[name]:
            same += 1
        elif a == b:
            moved += 1
        else:
            ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            changed = [(tag, i1, i2, j1, j2) for tag, i1, i2, j1, j2 in ops if tag != "equal"]
            lines = sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in changed)
            n_differ += 1
            differs.append(f"{name}: {len(a)} -> {len(b)} instructions, {lines} in {len(changed)} places differ")
            for tag, i1, i2, j1, j2 in changed[:show]:
                differs.append(f"    {tag} at {i1}: {a[i1:i2]} -> {b[j1:j2]}")
    print(f"{same} identical, {moved} identical modulo parameter offsets, {n_differ} differ, "
          f"{len(only_old)} only in old, {len(only_new)} only in new (of {len(old)} old, {len(new)} new kernels)")
    for line in differs + [f"only in old: {n}" for n in only_old] + [f"only in new: {n}" for n in only_new]:
        print("  " + line)
    return 0 if not (n_differ or only_old or only_new) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("module")
    d.add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--show", type=int, default=0, help="print each differing kernel's first SHOW changes")
    args = ap.parse_args()
    if args.cmd == "dump":
        kernels = dump(args.module)
        with gzip.open(args.out, "wt") as f:
            json.dump(kernels, f)
        print(f"{len(kernels)} kernels, {sum(map(len, kernels.values()))} instructions -> {args.out}")
        return 0
    with gzip.open(args.old, "rt") as f, gzip.open(args.new, "rt") as g:
        return compare(json.load(f), json.load(g), args.show)


if __name__ == "__main__":
    sys.exit(main())
