"""Rebuild trellm/data/{calibration,eval}.txt and LICENSE-PSF.txt.

Sources (trellm/data/README.md has the details and licences):

* original prose written for trellm (scripts/text_data/*.txt, Apache-2.0 with trellm);
* the Python Language Reference text that CPython ships as ``pydoc_data/topics.py``
  (PSF License; the topics are split alternately between the two files);
* CPython standard-library modules, different ones for each file (PSF License).

Prose and code sections are interleaved so that any prefix of either file (the
quantizer's calibration rows, ``trellm eval kld --max-tokens``) holds both.

    .venv/bin/python scripts/build_text_data.py
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "trellm" / "data"
SRC = Path(__file__).resolve().parent / "text_data"

EVAL_MODULES = ["textwrap.py", "fractions.py", "heapq.py", "shlex.py", "graphlib.py", "queue.py", "bisect.py",
                "json/decoder.py"]
CALIBRATION_MODULES = ["calendar.py", "string.py", "functools.py", "csv.py", "glob.py", "fnmatch.py",
                       "reprlib.py", "colorsys.py"]


def prose_sections(path: Path) -> list[str]:
    """An essay file split at its titles (a title is a line followed by a blank line
    and preceded by one, or the first line)."""
    lines = path.read_text(encoding="utf-8").strip().split("\n")
    sections, current = [], []
    for i, line in enumerate(lines):
        is_title = (i == 0 or not lines[i - 1].strip()) and i + 1 < len(lines) and not lines[i + 1].strip() \
            and line.strip() and not line.endswith((".", ",", ":"))
        if is_title and current and any(s.strip() for s in current):
            sections.append("\n".join(current).strip())
            current = []
        current.append(line)
    sections.append("\n".join(current).strip())
    return sections


def topics(parity: int) -> list[str]:
    from pydoc_data.topics import topics as all_topics

    return [all_topics[k].strip() for i, k in enumerate(sorted(all_topics)) if i % 2 == parity]


def modules(names: list[str]) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(lib / n).read_text(encoding="utf-8").strip() for n in names]


def interleave(prose: list[str], code: list[str]) -> str:
    """Sections in an order that keeps the share of code near its overall share."""
    total_prose, total_code = sum(map(len, prose)), sum(map(len, code))
    share = total_code / (total_prose + total_code)
    out, done_code, done = [], 0, 0
    prose, code = list(prose), list(code)
    while prose or code:
        take_code = code and (not prose or done_code < share * done)
        piece = code.pop(0) if take_code else prose.pop(0)
        done_code += len(piece) if take_code else 0
        done += len(piece)
        out.append(piece)
    return "\n\n\n".join(out) + "\n"


def main() -> int:
    prose_eval = prose_sections(SRC / "eval_prose.txt")
    prose_cal = prose_sections(SRC / "calibration_prose.txt")
    # The original prose first, then the reference text, so every prefix starts with plain English.
    (DATA / "eval.txt").write_text(interleave(prose_eval + topics(1), modules(EVAL_MODULES)), encoding="utf-8")
    (DATA / "calibration.txt").write_text(interleave(prose_cal + topics(0), modules(CALIBRATION_MODULES)),
                                          encoding="utf-8")
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    (DATA / "LICENSE-PSF.txt").write_text(licence.read_text(encoding="utf-8"), encoding="utf-8")
    print(f"built from Python {sys.version.split()[0]} at {sysconfig.get_paths()['stdlib']}")
    try:
        from trellm.default_model import default_model_path
        from trellm.tokenizer.tokenizer import Tokenizer

        tok = Tokenizer.load(default_model_path())
        for name in ("calibration.txt", "eval.txt"):
            text = (DATA / name).read_text(encoding="utf-8")
            print(f"{name}: {len(text)} characters, {len(tok.encode(text, add_special_tokens=False))} tokens "
                  f"(default model's tokenizer)")
    except Exception as e:  # token counts are a report, not part of the build
        print(f"(token counts unavailable: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
