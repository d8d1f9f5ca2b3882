"""Quality panel: EXL3 at several bit widths, INT8 and round-to-nearest int4 (g32),
each measured by KL divergence against the dense teacher on the shipped eval text.

    .venv/bin/python scripts/quality_panel.py --out results/quality      # GPU machine
    .venv/bin/python scripts/quality_panel.py --out /tmp/panel --smoke   # CPU, tiny random model

1. ``trellm quantize`` at every ``--bits`` (parallel processes on one GPU: the
   quantizer's LDLQ stages are sequential, so one process alone leaves the GPU idle
   much of the time). Each has a log in OUT/logs/; an output directory that is
   already complete is reused, an unfinished one resumes.
2. ``trellm eval kld`` logic in this process: the teacher (the model with
   ``--quantization none``: the default GGUF's Q4_1 weights dequantized, in float32)
   against each EXL3 directory (decoded once into dense weights, so the numbers
   measure the format, not a kernel), ``--quantization int8`` and ``rtn4`` (4 bits,
   groups of 32, fp16 scale + 4-bit zero per group: 4.625 bpw).
3. OUT/panel.json (everything), OUT/panel.md (the table), OUT/panel.png (KL vs bpw,
   log scale). A step that fails is a row saying so, never a silent gap.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="", help="model to quantize and teach (default: the embedded SmolLM2-135M)")
    p.add_argument("--bits", default=None, help="comma-separated EXL3 bit widths (default 2,3,4,5,6,8)")
    p.add_argument("--head-bits", type=int, default=6)
    p.add_argument("--jobs", type=int, default=None,
                   help="quantizations at once (default: all of them on CUDA, 1 on the CPU)")
    p.add_argument("--calib-rows", type=int, default=None)
    p.add_argument("--calib-cols", type=int, default=None)
    p.add_argument("--max-eval-tokens", type=int, default=None, help="default: all of eval.txt (~83k tokens)")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--exl3-quantization", default="none",
                   help="how the EXL3 students load: none (decoded to dense, default) or auto (EXL3 kernels)")
    p.add_argument("--no-baselines", action="store_true", help="skip INT8 and RTN")
    p.add_argument("--smoke", action="store_true", help="CPU run on a tiny random model, in about a minute")
    return p.parse_args(argv)


def settings(a: argparse.Namespace) -> dict:
    """The panel's sizes: full defaults, or tiny ones for --smoke (explicit flags win)."""
    smoke = a.smoke
    s = {"bits": [4, 6] if smoke else [2, 3, 4, 5, 6, 8], "calib_rows": 4 if smoke else 32,
         "calib_cols": 64 if smoke else 512, "max_eval_tokens": 1024 if smoke else None,
         "context": 128 if smoke else 512, "device": "cpu" if smoke else a.device,
         "extra": ["--scale-samples", "1", "--wrap-window", "8", "--threads", "1"] if smoke else []}
    if a.bits:
        s["bits"] = [int(b) for b in a.bits.split(",")]
    for key in ("calib_rows", "calib_cols", "max_eval_tokens", "context"):
        if getattr(a, key) is not None:
            s[key] = getattr(a, key)
    return s


def quantize_all(model: str, out: Path, s: dict, head_bits: int, jobs: int) -> dict:
    """Run ``trellm quantize`` for every bit width, ``jobs`` at a time; per width the
    directory, exit status, seconds and log file."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    todo, running, done = list(s["bits"]), {}, {}
    while todo or running:
        while todo and len(running) < jobs:
            bits = todo.pop(0)
            target = out / f"exl3-{bits}bit"
            if _complete(target):
                done[bits] = {"dir": str(target), "returncode": 0, "seconds": 0.0, "reused": True}
                continue
            log = open(logs / f"quantize-{bits}bit.log", "w")
            cmd = [sys.executable, "-m", "trellm.entrypoints.cli", "quantize", model, "--bits", str(bits),
                   "--head-bits", str(head_bits), "--out", str(target), "--device", s["device"],
                   "--calib-rows", str(s["calib_rows"]), "--calib-cols", str(s["calib_cols"]), *s["extra"]]
            running[bits] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log,
                             time.perf_counter(), target)
            print(f"quantizing to {bits} bits -> {target} (log: {log.name})", flush=True)
        for bits, (proc, log, t0, target) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                done[bits] = {"dir": str(target), "returncode": proc.returncode,
                              "seconds": round(time.perf_counter() - t0, 1), "reused": False, "log": log.name}
                print(f"  {bits} bits: exit {proc.returncode} after {done[bits]['seconds']} s", flush=True)
                del running[bits]
        time.sleep(0.5)
    return done


def _complete(target: Path) -> bool:
    config = target / "config.json"
    return config.is_file() and not (target / ".trellm-quant").exists() and \
        "quantization_config" in json.loads(config.read_text())


def evaluate(model: str, quantized: dict, s: dict, a: argparse.Namespace) -> list[dict]:
    """Teacher once, then every student; a student that fails is a row with its error."""
    from trellm.eval.cli import eval_text
    from trellm.eval.kld import ModelSpec, check_same_tokenizer, compare, load_model

    teacher = load_model(ModelSpec(model, "none", "teacher"), s["device"], "float32", s["context"])
    text = eval_text(None)
    ids = teacher.tokenizer.encode(text, add_special_tokens=False)[:s["max_eval_tokens"]]
    students = [ModelSpec(q["dir"], a.exl3_quantization, f"EXL3 {b}-bit") for b, q in sorted(quantized.items())
                if q["returncode"] == 0]
    rows = [{"label": f"EXL3 {b}-bit", "method": "exl3",
             "error": f"quantize exited {q['returncode']}, see {q.get('log')}"}
            for b, q in sorted(quantized.items()) if q["returncode"] != 0]
    if not a.no_baselines:
        students += [ModelSpec(model, "int8", "INT8 (per-row)"), ModelSpec(model, "rtn4", "RTN int4 g32")]
    for spec in students:
        try:
            student = load_model(spec, s["device"], "float32", s["context"])
            check_same_tokenizer(teacher, student, text)
            r = compare(teacher, student, ids, s["context"], progress=True).as_dict()
            rows.append({"label": spec.label, **r})
        except Exception as e:  # one broken student must not hide the others' results
            rows.append({"label": spec.label, "method": spec.quantization, "error": f"{type(e).__name__}: {e}"})
        print(f"  {rows[-1]['label']}: " + (f"KL {rows[-1]['kl_mean']:.5f}" if "kl_mean" in rows[-1]
                                            else rows[-1]["error"]), flush=True)
    return rows


def markdown(report: dict) -> str:
    q = report["quantize"]
    lines = [f"# Quality panel: {report['model']}", "",
             "| student | method | bpw | stored bpw | KL mean | KL median | KL p99 | top-1 agree | PPL | quantize s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ok = sorted((r for r in report["rows"] if "kl_mean" in r), key=lambda r: r["bpw"] or 0)
    for r in ok:
        bits = next((b for b, v in q.items() if v["dir"] == r.get("student_model")), None)
        secs = f"{q[bits]['seconds']:.0f}" if bits is not None and not q[bits]["reused"] else "-"
        bpw, stored = (("-" if v is None else f"{v:.3f}") for v in (r["bpw"], r["stored_bpw"]))
        lines.append(f"| {r['label']} | {r['method']} | {bpw} | {stored} | {r['kl_mean']:.5f} | {r['kl_median']:.5f} | "
                     f"{r['kl_p99']:.4f} | {100 * r['top1_agreement']:.2f}% | {r['ppl_student']:.3f} | {secs} |")
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['method']} | - | - | failed: {r['error'][:120]} | | | | | |")
    first = ok[0] if ok else {}
    lines += ["", f"Teacher: {report['model']} loaded with `--quantization none` (float32); its perplexity "
                  f"{first.get('ppl_teacher', float('nan')):.3f}. {report['settings']['eval_tokens']} tokens of "
                  f"trellm/data/eval.txt in windows of {report['settings']['context']}; KL(teacher || student) in "
                  "nats per token.",
              "bpw counts decoder linears only: EXL3 = K + 16-bit suh/svh (spec: K + 16 (in + out) / (in out)); "
              "INT8 = 8 + a 16-bit scale per row; RTN = 4 + (16-bit scale + 4-bit zero) / 32. Stored bpw adds EXL3's "
              "padding of every dimension to a multiple of 128. EXL3 heads are quantized at "
              f"{report['settings']['head_bits']} bits; INT8 and RTN keep the head dense.",
              f"Wall time {report['seconds']:.0f} s on {report['machine'].get('gpu', report['machine']['platform'])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from trellm.eval.plots import plot_kld_vs_bpw

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = settings(a)
    model = a.model
    if a.smoke:
        from trellm.eval.tiny_model import write_tiny_model

        model = str(write_tiny_model(out / "tiny-model"))
        torch.set_num_threads(1)  # small ops on a small CPU: a second thread mostly contends
    elif not model:
        from trellm.default_model import default_model_path

        model = str(default_model_path())
    cuda = s["device"] == "cuda" or (s["device"] == "auto" and torch.cuda.is_available())
    jobs = a.jobs or (len(s["bits"]) if cuda else 1)
    quantized = quantize_all(model, out, s, a.head_bits, jobs)
    t_quant = time.perf_counter() - t0
    rows = evaluate(model, quantized, s, a)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          **({"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {})},
              "model": model,
              "settings": {**{k: v for k, v in s.items() if k != "extra"}, "head_bits": a.head_bits, "jobs": jobs,
                           "eval_tokens": next((r["tokens"] for r in rows if "tokens" in r), 0)},
              "quantize": quantized, "rows": rows,
              "quantize_seconds": round(t_quant, 1), "seconds": round(time.perf_counter() - t0, 1)}
    (out / "panel.json").write_text(json.dumps(report, indent=2))  # bit widths become string keys
    (out / "panel.md").write_text(markdown(report))
    plot_kld_vs_bpw(rows, f"KL vs bits per weight: {Path(model).name}", out / "panel.png")
    print(markdown(report))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
