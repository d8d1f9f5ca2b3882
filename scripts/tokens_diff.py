"""Compare the greedy tokens of engine runs (scripts/gpu_exl3_check.py's engine JSON):
for each run against the first, the positions of the single stream and of the aggregate
requests where the tokens agree, up to the first difference (a near-tie on random weights
diverges once and never comes back, so "equal up to" is the measure); where the first run
recorded its log-prob margins, the margin at the first difference (a near-tie: close to 0).

    python3 scripts/tokens_diff.py A/gpu-exl3.json B/gpu-exl3.json [...]
"""
from __future__ import annotations

import json
import sys


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def runs(path: str) -> dict[str, dict]:
    return {f"{path}:{name}": r for name, r in json.load(open(path)).get("engine", {}).items()
            if "single_token_ids" in r}


def compare(base: dict, other: dict) -> dict:
    n = _prefix(base['single_token_ids'], other['single_token_ids'])
    out = {"single": f"{n}/{len(base['single_token_ids'])}"}
    margins = base.get("single_margins") or []
    if n < len(base["single_token_ids"]) and n < len(margins):
        # the base run's top-1 minus top-2 log-prob where the runs part: a near-tie is ~0
        out["single_margin_at_first_difference"] = margins[n]
        out["single_smallest_margin_before"] = min((m for m in margins[:n] if m is not None), default=None)
    for key in base:
        if key.endswith("_token_ids") and key != "single_token_ids" and key in other:
            pre = [_prefix(a, b) for a, b in zip(base[key], other[key])]
            full = sum(p == len(a) for p, a in zip(pre, base[key]))
            out[key] = f"{full}/{len(pre)} requests equal (shortest common prefix {min(pre, default=0)})"
    return out


def main(paths: list[str]) -> None:
    import os

    missing = [p for p in paths if not os.path.exists(p)]
    if missing:  # a run cut short (or not asked for): compare the others
        print(f"tokens_diff: no such file: {', '.join(missing)}", file=sys.stderr)
    allruns = {k: v for p in paths if p not in missing for k, v in runs(p).items()}
    if len(allruns) < 2:
        sys.exit("tokens_diff: need two engine runs with token ids")
    (base_name, base), *rest = allruns.items()
    report = {"base": base_name, "against": {name: compare(base, r) for name, r in rest}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
