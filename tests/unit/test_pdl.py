"""Programmatic dependent launch (kernels/_triton.py): when it is asked for, and that every
kernel of the decode graph takes the ``PDL`` switch and waits on its predecessor first."""
from __future__ import annotations

import ast
import pathlib

import pytest

from trellm.kernels import _triton

DECODE_KERNELS = [
    ("trellm.kernels.rmsnorm", "_rms_norm_kernel"),
    ("trellm.kernels.rope_kv", "_rope_kv_kernel"),
    ("trellm.kernels.activation", "_silu_and_mul_kernel"),
    ("trellm.kernels.gemv", "_gemv_kernel"),
    ("trellm.kernels.paged_attention", "_decode_split_kernel"),
    ("trellm.kernels.paged_attention", "_decode_reduce_kernel"),
    ("trellm.kernels.exl3_decode", "_in_kernel"),
    ("trellm.kernels.exl3_decode", "_out_kernel"),
    ("trellm.kernels.exl3_fast", "_split_kernel"),
    ("trellm.kernels.exl3_fast", "_fast_kernel"),
    ("trellm.kernels.exl3_row", "_row_kernel"),
    ("trellm.kernels.exl3_mma", "_mma_kernel"),
    ("trellm.kernels.int8_gemv", "_reduce_kernel"),
]


READ_BEFORE_WAIT = {"_gemv_kernel"}
"""Kernels that load their (read-only) weight before the wait."""


@pytest.fixture
def fresh_pdl(monkeypatch):
    monkeypatch.setattr(_triton, "_PDL", {})
    yield monkeypatch
    _triton._PDL.clear()


def test_off_unless_asked(fresh_pdl):
    fresh_pdl.delenv("TRELLM_PDL", raising=False)
    assert _triton.pdl_kwargs() == {}


def test_asked_but_no_cuda_device(fresh_pdl):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this checks a machine without a CUDA device")
    fresh_pdl.setenv("TRELLM_PDL", "1")
    assert _triton.pdl_kwargs() == {}


def test_never_in_the_interpreter(fresh_pdl):
    fresh_pdl.setenv("TRELLM_PDL", "1")
    fresh_pdl.setenv("TRITON_INTERPRET", "1")
    assert not _triton.pdl_enabled()


@pytest.mark.parametrize("module,name", DECODE_KERNELS)
def test_decode_kernels_take_the_switch(module, name):
    # Read from the source, not imported: exl3_row / exl3_mma need Triton at import.
    path = pathlib.Path(_triton.__file__).parent / f"{module.rsplit('.', 1)[1]}.py"
    fn = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
    args = fn.args.args
    defaults = dict(zip([a.arg for a in args[len(args) - len(fn.args.defaults):]], fn.args.defaults))
    assert "PDL" in defaults and ast.unparse(defaults["PDL"]) == "False", f"{name}: no PDL=False parameter"
    assert ast.unparse(args[-1].annotation) == "tl.constexpr"
    stmts = fn.body
    if isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
        stmts = stmts[1:]  # the docstring
    if name in READ_BEFORE_WAIT:  # reads only the weight before the wait
        wait = next(i for i, st in enumerate(stmts) if ast.unparse(st) == "pdl_begin(PDL)")
        before = "\n".join(ast.unparse(st) for st in stmts[:wait])
        assert "x_ptr" not in before and "y_ptr" not in before and "w_ptr" in before
        stmts = stmts[wait:]
    assert ast.unparse(stmts[0]) == "pdl_begin(PDL)", f"{name}: its first statement is not the PDL wait"
