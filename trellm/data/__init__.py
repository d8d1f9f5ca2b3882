"""Text shipped with trellm: calibration text for the quantizer and the evaluation text
for ``trellm eval kld`` (sources and licences in README.md beside them)."""
from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def data_path(name: str) -> Path:
    """Path of a shipped data file; ValueError names the ones there are."""
    path = _HERE / name
    if not path.is_file():
        have = sorted(p.name for p in _HERE.glob("*.txt"))
        raise ValueError(f"no shipped data file {name!r} (have: {', '.join(have)})")
    return path
