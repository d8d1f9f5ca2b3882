#!/usr/bin/env python3
"""Instruction counts of recorded kernel launches compiled for sm_90, on a machine
without a GPU: a proxy for kernels bound by instruction issue (the EXL3 decode kernels:
docs/benchmarks/gpu/README.md), to compare variants before a device run.

    TRITON_INTERPRET=1 TRELLM_RECORD_LAUNCHES=/tmp/l.jsonl python -m pytest tests/kernels/test_exl3_kernels.py -k mma
    python scripts/sass_stats.py /tmp/l.jsonl --only _mma_kernel --where K=4 --where AFF=true

Per distinct launch: its constexprs, the instruction count, the registers a thread takes
(which bound the warps an SM holds), and each loop's (a backward branch's) body size with
its opcode histogram for the largest.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("launches")
    ap.add_argument("--only", default="", help="kernel name (substring)")
    ap.add_argument("--where", action="append", default=[], help="NAME=VALUE a constexpr must have (JSON value)")
    ap.add_argument("--set", action="append", default=[],
                    help="NAME=VALUE: compile with this constexpr or launch option (num_warps) instead (e.g. PTX=true: "
                         "the interpreter records PTX=false)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--capability", type=int, default=90)
    a = ap.parse_args()
    from trellm.kernels.compile_check import loops, opcode, registers_of, sass_of, with_overrides

    want = {k: json.loads(v) for k, v in (w.split("=", 1) for w in a.where)}
    override = {k: json.loads(v) for k, v in (w.split("=", 1) for w in a.set)}
    keys = []
    for line in sorted(set(open(a.launches).read().split("\n"))):
        if not line.strip():
            continue
        _, kernel, _, consts, _ = json.loads(line)
        if a.only in kernel and all(dict(consts).get(k) == v for k, v in want.items()):
            keys.append(with_overrides(line, override))
    keys = sorted(set(keys))
    print(f"{len(keys)} distinct launches match; showing {min(len(keys), a.limit)}")
    for key in keys[:a.limit]:
        module, kernel, _, consts, opts = json.loads(key)
        rows = sass_of(key, a.capability)
        instrs = [text for label, text in rows if not label]
        spans = loops(rows)
        print(f"\n{kernel} {dict(consts)} {dict(opts)}: {len(instrs)} instructions, {registers_of(key, a.capability)} "
              f"registers a thread; loop bodies {[hi - lo + 1 for lo, hi in spans]}")
        if spans:
            lo, hi = spans[-1]
            ops = collections.Counter(opcode(t) for t in instrs[lo:hi + 1])
            print("  largest loop:", ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))


if __name__ == "__main__":
    main()
