"""Compile the Triton kernels for the GPU on a machine without one.

Why: Triton's interpreter (how the kernel tests run on the CPU) executes a kernel's
Python, not its compiled form, so some errors only the compiler sees pass there: a
loop-carried name retyped inside the loop (the GEMV's prefetch did not compile for
sm_90 while its interpreter tests passed; docs/benchmarks/gpu/README.md, 2026-12-07
fourth session), a constexpr used as a value, an unsupported cast. The compiler itself
needs no GPU: Triton's wheel brings ptxas.

Two steps, so the launches compiled are exactly those the tests make:

1. ``record_launches(path)`` (tests/kernels/conftest.py, ``TRELLM_RECORD_LAUNCHES=path``
   with ``TRITON_INTERPRET=1``): every interpreted launch appends its kernel, argument
   types, constexpr values and launch options to ``path`` (JSON lines).
2. ``scripts/compile_check.py path`` (no interpreter): each distinct launch compiled for
   ``GPUTarget("cuda", 90, 32)``, the H100 / H200; the failures listed.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import torch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
           torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
"""Launch keywords that are compile options, not kernel arguments."""


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler needs it: no values, only their types (and the
    constexprs' values)."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    """(parameter, Triton type: "*bf16", "i32", "fp32", ... or "constexpr")."""
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]

    def key(self) -> str:
        return json.dumps([self.module, self.kernel, self.signature, self.constexprs, self.options])


def _arg_type(value) -> str | None:
    """The Triton type of a runtime argument; None: passed as a constexpr (None values)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return None
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def describe(fn, args: tuple, kwargs: dict) -> Launch:
    """The Launch of ``fn`` (the kernel's Python function) called with args / kwargs."""
    params = list(inspect.signature(fn).parameters.values())
    sig, consts = [], []
    for i, p in enumerate(params):
        value = args[i] if i < len(args) else kwargs.get(p.name, p.default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"{fn.__name__}: no value for {p.name}")
        kind = None if "constexpr" in str(p.annotation) else _arg_type(value)
        sig.append((p.name, kind or "constexpr"))
        if kind is None:
            consts.append((p.name, value))
    opts = tuple(sorted((k, v) for k, v in kwargs.items() if k in OPTIONS))
    return Launch(fn.__module__, fn.__name__, tuple(sig), tuple(consts), opts)


def record_launches(path: str) -> None:
    """Append every interpreted launch's ``describe`` to ``path`` (JSON lines)."""
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    if getattr(cls.run, "_trellm_recording", False):
        return
    run = cls.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        with open(path, "a") as f:
            f.write(describe(self.fn, args, kwargs).key() + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._trellm_recording = True
    cls.run = recording_run


def with_overrides(key: str, override: dict) -> str:
    """A recorded launch (``Launch.key``) with some constexprs or launch options set
    otherwise (e.g. exl3_mma's PTX, which the interpreter records as False)."""
    module, kernel, signature, constexprs, options = json.loads(key)
    return json.dumps([module, kernel, signature, [[k, override.get(k, v)] for k, v in constexprs],
                       [[k, override.get(k, v)] for k, v in options]])


def _compile(key: str, capability: int):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, signature, constexprs, options = json.loads(key)
    fn = getattr(importlib.import_module(module), kernel)
    names = [name for name, _ in signature]
    src = ASTSource(fn=fn, signature=dict(signature),
                    constexprs={(names.index(name),): value for name, value in constexprs})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(options))


def compile_launch(key: str, capability: int = 90) -> str | None:
    """Compile one recorded launch (``Launch.key``) for CUDA ``capability``; None when it
    compiles, else the error's last lines. Needs Triton without the interpreter."""
    try:
        _compile(key, capability)
    except Exception as e:  # every compiler error is a finding, whatever its class
        return "\n".join(str(e).strip().splitlines()[-6:])
    return None


def registers_of(key: str, capability: int = 90) -> int | None:
    """Registers a thread of the recorded launch takes (``cuobjdump -res-usage`` on its
    cubin; the cuobjdump in Triton's wheel), None where that tool is missing."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(_compile(key, capability).asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", out)
    return int(found.group(1)) if found else None


def sass_of(key: str, capability: int = 90) -> list[tuple[str, str]]:
    """The recorded launch's SASS as (label or "", instruction) rows, labels on their own
    rows (Triton's disassembler: control codes, a tab, the instruction; "LBB3:" labels)."""
    from triton.tools.disasm import get_sass

    rows = []
    for line in get_sass(_compile(key, capability).asm["cubin"]).splitlines():
        line = line.strip()
        if line.endswith(":") and "\t" not in line and " " not in line:
            rows.append((line[:-1], ""))
        elif "\t" in line:
            rows.append(("", line.split("\t", 1)[1].strip().rstrip(";").strip()))
    return rows


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers: "@P0 IMAD.WIDE ..." -> "IMAD"."""
    words = text.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def loops(rows: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """Back-edges of ``sass_of`` rows: (first, last) instruction indices of each loop body
    (a branch to a label above it), innermost first by size."""
    instrs, where = [], {}
    for label, text in rows:
        if label:
            where[label] = len(instrs)
        else:
            instrs.append(text)
    found = []
    for i, text in enumerate(instrs):
        if opcode(text) == "BRA":
            target = text.split()[-1]
            if target in where and where[target] <= i:
                found.append((where[target], i))
    return sorted(found, key=lambda span: span[1] - span[0])
