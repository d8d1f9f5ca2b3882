"""What every bench result file carries besides its figures, and the writers for
JSON and markdown, shared by the benches."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def machine_info() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def run_header(bench: str, model: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line as typed, when, where and with which trellm: enough to rerun it."""
    import trellm

    args = list(sys.argv[1:] if argv is None else argv)
    return {"bench": bench, "command": "trellm " + shlex.join(_redacted(args)),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
            "model": model, "trellm_version": trellm.__version__}


def _redacted(args: list[str]) -> list[str]:
    """The arguments with an API key's value hidden: result files get shared."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def write_json(path: str | Path, data: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2) + "\n")


def emit(result: dict, markdown: str, out: str | None, png: str | None, plot) -> None:
    """Print the table, draw ``plot(result, png)`` (beside ``out`` unless ``png`` is given)
    and write the JSON to ``out``; either file is skipped when it has no path."""
    print(markdown)
    png = png or (str(Path(out).with_suffix(".png")) if out else None)
    if png:
        plot(result, png)
        print(f"wrote {png}")
    if out:
        write_json(out, result)
        print(f"wrote {out}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 1) -> str:
    """A figure for a table; '–' where there is none (not measured, not applicable)."""
    return "–" if x is None else f"{x:.{digits}f}"
