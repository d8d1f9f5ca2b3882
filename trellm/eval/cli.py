"""``trellm eval kld``: teacher vs one or more students on the shipped evaluation text.

    trellm eval kld --teacher MODEL --student DIR_A --student DIR_B \\
        --student-quantization auto --student-quantization none ...

Each ``--student`` is paired with the ``--student-quantization`` at the same position
(one value applies to all; none given: ``auto``). Without ``--student``, every
``--student-quantization`` is applied to the teacher's model, e.g. ``int8`` or
``rtn4`` (group-wise round-to-nearest, ``trellm/eval/rtn.py``). Results: a markdown
table on stdout, and JSON / markdown files with ``--out-json`` / ``--out-md``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="measure model quality")
    esub = e.add_subparsers(dest="eval_command", required=True)
    k = esub.add_parser("kld", help="KL divergence, top-1 agreement and perplexity of students vs a teacher")
    k.add_argument("--teacher", default="", help="teacher model (default: the embedded SmolLM2-135M)")
    k.add_argument("--teacher-quantization", default="none",
                   help="engine --quantization for the teacher (default: none, i.e. dense)")
    k.add_argument("--student", action="append", default=[], help="student model (repeatable)")
    k.add_argument("--student-quantization", action="append", default=[],
                   help="per student: an engine --quantization (auto, none, exl3, int8, ...) or rtnB[gG] "
                        "(round-to-nearest fake quant, e.g. rtn4 = 4 bits, groups of 32)")
    k.add_argument("--label", action="append", default=[], help="per student: its name in the table")
    k.add_argument("--text", default=None, help="evaluation text file (default: the shipped eval.txt)")
    k.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    k.add_argument("--context", type=int, default=512, help="tokens per window")
    k.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    k.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    k.add_argument("--out-json", default=None)
    k.add_argument("--out-md", default=None)
    k.add_argument("--quiet", action="store_true", help="no progress bars")
    k.set_defaults(func=run_kld)


def student_specs(a: argparse.Namespace):
    from trellm.eval.kld import ModelSpec

    quants = a.student_quantization
    models = a.student or [a.teacher] * max(1, len(quants))
    if len(quants) not in (0, 1, len(models)):
        raise ValueError(f"{len(models)} students but {len(quants)} --student-quantization values")
    if a.label and len(a.label) != len(models):
        raise ValueError(f"{len(models)} students but {len(a.label)} --label values")
    default = "auto" if a.student else "none"
    quants = quants if len(quants) == len(models) else (quants or [default]) * len(models)
    return [ModelSpec(m, q, a.label[i] if a.label else None) for i, (m, q) in enumerate(zip(models, quants))]


def eval_text(path: str | None) -> str:
    if path is None:
        from trellm.data import data_path

        path = data_path("eval.txt")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read evaluation text {path}: {e}") from None


def run_kld(a: argparse.Namespace) -> int:
    from trellm.eval.kld import ModelSpec

    if a.context < 16 or (a.max_tokens is not None and a.max_tokens < a.context):
        raise ValueError("--context must be >= 16 and --max-tokens at least one context")
    report = evaluate_kld(ModelSpec(a.teacher, a.teacher_quantization, "teacher"), student_specs(a),
                          text_path=a.text, max_tokens=a.max_tokens, context=a.context, device=a.device,
                          dtype=a.dtype, progress=not a.quiet)
    report["command"] = "trellm " + " ".join(sys.argv[1:])
    table = markdown_table(report)
    print(table)
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(report, indent=2))
    if a.out_md:
        Path(a.out_md).write_text(table + "\n")
    return 0


def evaluate_kld(teacher_spec, specs, text_path: str | None = None, max_tokens: int | None = None,
                 context: int = 512, device: str = "auto", dtype: str = "float32", progress: bool = True) -> dict:
    """Load the teacher once, then each student in turn; the report as a JSON-ready dict."""
    import torch

    from trellm.eval.kld import check_same_tokenizer, compare, load_model

    text = eval_text(text_path)
    teacher = load_model(teacher_spec, device, dtype, context)
    if teacher.tokenizer is None:
        raise ValueError("the teacher has no tokenizer to encode the evaluation text")
    ids = teacher.tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    results = []
    for spec in specs:
        student = load_model(spec, device, dtype, context)
        check_same_tokenizer(teacher, student, text)
        results.append(compare(teacher, student, ids, context, progress).as_dict())
        del student
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": _machine(teacher.device),
            "teacher": {"model": teacher_spec.model or "embedded default", "quantization": teacher_spec.quantization,
                        "method": teacher.method},
            "text": text_path or "trellm/data/eval.txt", "text_tokens": len(ids), "context": context,
            "dtype": str(teacher.dtype).removeprefix("torch."), "results": results}


def _machine(device) -> dict:
    import torch

    out = {"platform": platform.platform(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def markdown_table(report: dict) -> str:
    rows = ["| student | method | bpw | stored bpw | KL mean | KL median | KL p99 | top-1 agree | PPL student | "
            "PPL teacher |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        bpw, stored = (("-" if v is None else f"{v:.3f}") for v in (r["bpw"], r["stored_bpw"]))
        rows.append(f"| {r['student']} | {r['method']} | {bpw} | {stored} | {r['kl_mean']:.5f} | "
                    f"{r['kl_median']:.5f} | "
                    f"{r['kl_p99']:.4f} | {100 * r['top1_agreement']:.2f}% | {r['ppl_student']:.3f} | "
                    f"{r['ppl_teacher']:.3f} |")
    note = (f"\n{report['text_tokens']} tokens of {report['text']}, windows of {report['context']}, "
            f"{report['dtype']} on {report['machine']['device']}; KL(teacher || student) in nats per token. "
            "bpw: decoder linears, scales included; stored bpw also counts EXL3's padding to 128-wide blocks.")
    return "\n".join(rows) + "\n" + note
