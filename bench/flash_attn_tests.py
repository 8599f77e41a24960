"""flash-attn 2.8.3's own test file, run through fa2's drop-ins: how much of flash-attn's suite passes with
`from flash_attn import ...` pointing at fa2.

    git clone --depth 1 --branch v2.8.3 https://github.com/Dao-AILab/flash-attention /tmp/flash-attention
    python bench/flash_attn_tests.py /tmp/flash-attention --sample 20000 --seed 0 \
        --out bench/results/<gpu>-<date>-flash-attn-tests.json
    python bench/flash_attn_tests.py /tmp/flash-attention --functions test_flash_attn_kvcache --sample 2000

It runs the checkout's tests/test_flash_attn.py unchanged, in this process, with a shim package `flash_attn` first on
sys.path: its __init__ and flash_attn_interface are fa2.integrations.flash_attn's functions (and _get_block_size_n),
and every other submodule the file imports (bert_padding, layers.rotary, ops.triton.rotary) is the checkout's own
Python source. flash-attn's compiled extension is never imported, installed or not. The file is theirs: it is read
from the checkout, never copied into this repository.

What the checkout needs: tests/test_flash_attn.py and the flash_attn/ Python sources (a clone as above; the GPU
machine has no network, so carry the checkout there). The test file imports einops and, through
flash_attn.layers.rotary, triton (which torch's CUDA wheels bring); the script says so if either is missing.

--sample N runs a stratified sample of N items: the collected items are grouped by test function and each function
gets its share of N in proportion to its item count (at least one), drawn with --seed; without --sample every
collected item runs (flash-attn 2.8.3's file has about 509k, days of GPU time). --functions restricts collection to
some test functions (a comma list), which also makes collection faster. Collecting the whole file takes minutes.

It prints and writes (--out, JSON) the counts: passed, failed and skipped, per test function, and failures and skips
by reason (the exception's type and first line, digits folded to #), so what fails for a feature fa2 lacks is told
apart from a numerical failure (AssertionError) at a glance. Extra arguments after `--` go to pytest."""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
import time

SHIM_INIT = '''"""flash_attn, as fa2's drop-ins (bench/flash_attn_tests.py): the functions are fa2's, every other
submodule is the flash-attn checkout's own Python source."""
__version__ = "2.8.3"
__path__.append({checkout!r})

from flash_attn.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                             flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
'''
SHIM_INTERFACE = '''"""flash_attn.flash_attn_interface, as fa2's drop-ins (bench/flash_attn_tests.py)."""
from fa2.integrations.flash_attn import (_get_block_size_n, flash_attn_func, flash_attn_kvpacked_func,
                                         flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                                         flash_attn_with_kvcache)
'''


def write_shim(checkout: str) -> str:
    """A directory holding the shim package flash_attn; returns it (to go first on sys.path)."""
    root = tempfile.mkdtemp(prefix="fa2-flash-attn-shim-")
    package = os.path.join(root, "flash_attn")
    os.makedirs(package)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(SHIM_INIT.format(checkout=os.path.join(checkout, "flash_attn")))
    with open(os.path.join(package, "flash_attn_interface.py"), "w") as f:
        f.write(SHIM_INTERFACE)
    return root


def first_line(report) -> str:
    """The first line of a failure's message or a skip's reason."""
    if report.skipped:
        longrepr = report.longrepr
        text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        text = text.removeprefix("Skipped: ")
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def reason_of(report) -> str:
    """A failure's or skip's reason, for counting: its first line with digits folded to # so that items differing
    only in shapes count together."""
    return re.sub(r"\d+", "#", first_line(report))[:200]


def stratified(items, n: int, seed: int):
    """n items drawn per test function in proportion to its item count (largest remainders first), at least one per
    function, each function's share drawn at random with `seed`."""
    groups = collections.defaultdict(list)
    for item in items:
        groups[item.originalname].append(item)
    if n >= len(items):
        return list(items)
    total = len(items)
    quota = {name: max(1, n * len(group) // total) for name, group in groups.items()}
    left = n - sum(quota.values())
    by_remainder = sorted(groups, key=lambda name: -(n * len(groups[name]) % total))
    for name in by_remainder[:max(left, 0)]:
        quota[name] += 1
    rng = random.Random(seed)
    chosen = set()
    for name, group in sorted(groups.items()):
        chosen.update(id(item) for item in rng.sample(group, min(quota[name], len(group))))
    return [item for item in items if id(item) in chosen]


class Counter:
    """The pytest plugin: samples at collection, counts each item's outcome (its call phase, or the setup's where
    that failed or skipped)."""

    def __init__(self, sample, seed):
        self.sample, self.seed = sample, seed
        self.collected = self.selected = 0
        self.counts = collections.Counter()
        self.by_function = collections.defaultdict(collections.Counter)
        self.reasons = {"failed": collections.Counter(), "skipped": collections.Counter()}
        self.examples = {}
        self.failed = []  # every failed item's id with its message's first line (failures are few)

    def pytest_collection_modifyitems(self, session, config, items):
        self.collected = len(items)
        if self.sample is not None:
            keep = stratified(items, self.sample, self.seed)
            kept = {id(item) for item in keep}
            config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
            items[:] = keep
        self.selected = len(items)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "passed" if report.passed else "skipped" if report.skipped else "failed"
            self.counts[outcome] += 1
            self.by_function[report.nodeid.split("::")[-1].split("[")[0]][outcome] += 1
            if outcome != "passed":
                reason = reason_of(report)
                if outcome == "failed":
                    self.failed.append(f"{report.nodeid.split('::')[-1]}: {first_line(report)}")
                self.reasons[outcome][reason] += 1
                self.examples.setdefault(reason, report.nodeid.split("::")[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkout", help="a flash-attn 2.8.3 source checkout (holding tests/test_flash_attn.py)")
    p.add_argument("--sample", type=int, default=None, help="run a stratified sample of this many items")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    p.add_argument("--functions", default=None, help="comma list of test functions to collect (default: all)")
    p.add_argument("--out", default=None, help="write the counts here as JSON")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (e.g. -- -k ... --tb=long)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # What follows `--` goes to pytest whatever options came before it (argparse alone would take the positional
    # pytest_args together with the checkout and refuse the rest).
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    checkout = os.path.abspath(args.checkout)
    test_file = os.path.join(checkout, "tests", "test_flash_attn.py")
    if not os.path.isfile(test_file) or not os.path.isdir(os.path.join(checkout, "flash_attn")):
        p.error(f"{checkout} is not a flash-attn checkout: it needs tests/test_flash_attn.py and flash_attn/")
    for module, why in (("einops", "the test file imports it (pip install einops)"),
                        ("triton", "flash_attn.layers.rotary imports it (torch's CUDA wheels bring it)"),
                        ("fa2", "the drop-ins under test (install fa2, or run with PYTHONPATH=python)")):
        try:
            __import__(module)
        except ImportError as e:
            print(f"flash_attn_tests.py: cannot import {module} ({e}): {why}", file=sys.stderr)
            return 2
    if "flash_attn" in sys.modules:
        print("flash_attn_tests.py: flash_attn is imported already; run this script in a fresh process",
              file=sys.stderr)
        return 2
    import pytest

    import fa2

    sys.path.insert(0, write_shim(checkout))
    nodes = [test_file] if not args.functions else [f"{test_file}::{name}" for name in args.functions.split(",")]
    counter = Counter(args.sample, args.seed)
    start = time.time()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", os.path.dirname(test_file), *nodes,
                        *pytest_args], plugins=[counter])
    result = {
        "flash_attn_checkout": checkout, "fa2": fa2.build_info(), "pytest_exit_code": int(code),
        "seconds": round(time.time() - start, 1), "collected": counter.collected, "selected": counter.selected,
        "sample": args.sample, "seed": args.seed, "functions": args.functions, "counts": dict(counter.counts),
        "by_function": {name: dict(c) for name, c in sorted(counter.by_function.items())},
        "failed_by_reason": dict(counter.reasons["failed"].most_common()),
        "skipped_by_reason": dict(counter.reasons["skipped"].most_common()),
        "example_of_reason": counter.examples,
        "failed_items": counter.failed,
    }
    try:
        import torch
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # the counts matter more than the device's name
        result["device"] = None
    print(f"\n# flash-attn's tests through fa2: {counter.selected} of {counter.collected} items run: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counter.counts.items())))
    for name, c in sorted(counter.by_function.items()):
        print(f"{name:45} " + "  ".join(f"{k} {c[k]:6}" for k in ("passed", "failed", "skipped")))
    for outcome in ("failed", "skipped"):
        for reason, count in counter.reasons[outcome].most_common(20):
            print(f"{outcome:8} {count:7}  {reason}  (e.g. {counter.examples[reason]})")
    for line in counter.failed[:50]:
        print(f"FAILED {line}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"# counts written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
