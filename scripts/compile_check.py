#!/usr/bin/env python3
"""Compile every kernel launch the kernel tests make, for sm_90 (H100 / H200), on a
machine without a GPU: errors that Triton's interpreter does not see
(trellm/kernels/compile_check.py says why).

    TRITON_INTERPRET=1 TRELLM_RECORD_LAUNCHES=/tmp/launches.jsonl python -m pytest tests/kernels
    python scripts/compile_check.py /tmp/launches.jsonl [--jobs 2] [--only gemv] [--set PTX=true]

Run the second step without TRITON_INTERPRET. Prints one line per distinct launch that
fails and a summary; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("launches", help="the JSON-lines file the tests recorded")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="only launches whose module or kernel name contains this")
    ap.add_argument("--capability", type=int, default=90)
    ap.add_argument("--set", action="append", default=[],
                    help="NAME=VALUE (JSON): compile with this constexpr or launch option wherever the kernel has it; e.g. PTX=true, "
                         "exl3_mma's GPU path, which the interpreter records as false")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: this step runs the compiler")
    from tqdm import tqdm

    from trellm.kernels.compile_check import compile_launch, with_overrides

    override = {k: json.loads(v) for k, v in (item.split("=", 1) for item in a.set)}
    with open(a.launches) as f:
        keys = sorted({with_overrides(line.strip(), override) for line in f if line.strip() and a.only in line})
    failed = 0
    with ProcessPoolExecutor(a.jobs) as pool:
        results = pool.map(compile_launch, keys, [a.capability] * len(keys))
        for key, err in tqdm(zip(keys, results), total=len(keys), desc=f"sm_{a.capability}", unit="launch"):
            if err is not None:
                failed += 1
                print(f"FAILED {key[:300]}\n  {err.replace(chr(10), chr(10) + '  ')}", flush=True)
    print(f"{len(keys) - failed} of {len(keys)} distinct launches compiled for sm_{a.capability}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
