"""Summary statistics for benchmark samples: mean and percentiles.

Generic over any list of floats (latencies in ms, tok/s, ...), so every bench
reports the same shape. Pure Python: a bench client need not import numpy.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between the two
    nearest ranks: numpy's default ("linear") method, so figures match other tools.

    Raises ValueError on an empty sequence or a ``q`` outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Count, mean, p50/p90/p99, min and max of one metric's samples."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(values: Iterable[float]) -> Summary | None:
    """The summary of ``values``; None when there are none (JSON null, not NaN,
    which strict JSON readers refuse)."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    return Summary(count=len(vals), mean=math.fsum(vals) / len(vals), p50=percentile(vals, 50),
                   p90=percentile(vals, 90), p99=percentile(vals, 99), min=min(vals), max=max(vals))


def summary_dict(values: Iterable[float]) -> dict[str, float | int] | None:
    """``summarize(values)`` as a plain dict (or None), for JSON results."""
    s = summarize(values)
    return s.as_dict() if s is not None else None
