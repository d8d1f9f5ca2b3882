"""Programmatic dependent launch (kernels/_triton.py): when it is on, and that every kernel
of the decode graph takes the ``PDL`` switch and waits on its predecessor first."""
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
    ("trellm.kernels.exl3_prologue", "_norm_in_kernel"),
    ("trellm.kernels.exl3_prologue", "_glu_in_kernel"),
    ("trellm.kernels.exl3_decode", "_out_kernel"),
    ("trellm.kernels.exl3_fast", "_split_kernel"),
    ("trellm.kernels.exl3_fast", "_fast_kernel"),
    ("trellm.kernels.exl3_row", "_row_kernel"),
    ("trellm.kernels.exl3_mma", "_mma_kernel"),
    ("trellm.kernels.int8_gemv", "_reduce_kernel"),
    ("trellm.kernels.int8_gemv", "_dot_kernel"),
    ("trellm.kernels.int8_gemv", "_fma_kernel"),
]


GPU_CHECKED = {"_rms_norm_kernel", "_rope_kv_kernel", "_silu_and_mul_kernel", "_gemv_kernel",
               "_decode_split_kernel", "_decode_reduce_kernel", "_dot_kernel", "_fma_kernel", "_reduce_kernel"}
"""The bf16 decode graph's kernels: scripts/gpu_bench.py's engine checks (transformers,
batch / chunk / prefix invariance) passed with PDL on (H100, 2026-12-07), so they take it by
default; int8's too (its GPU kernel tests with TRELLM_PDL=1, and the engine's greedy tokens
equal with PDL on and off, H100, 2026-12-07); the EXL3 kernels only with TRELLM_PDL=1
until their GPU kernel tests run with it."""

READ_BEFORE_WAIT = {
    "_gemv_kernel": ({"w_ptr"}, {"x_ptr", "y_ptr", "res_ptr", "ro_ptr"}),
    "_rope_kv_kernel": ({"slot_ptr", "pos_ptr", "cos_ptr", "sin_ptr"},
                        {"q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "q_out_ptr"}),
    "_decode_split_kernel": ({"seq_lens_ptr", "token_index_ptr", "block_table_ptr"},
                             {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "counter_ptr",
                              "xh_ptr", "suh_ptr"}),
}
"""Kernels that read, before the wait, what no kernel of the forward writes (their weight;
the step's metadata, copied in before the forward): (pointers read there, pointers that
must not appear there: the predecessor's outputs and the kernel's own)."""


@pytest.fixture
def fresh_pdl(monkeypatch):
    """A fresh decision on a machine that would qualify (Triton, a CUDA device of
    capability 9.0): each test then changes one thing and must see it off."""
    import torch

    monkeypatch.setattr(_triton, "_PDL", {})
    monkeypatch.setattr(_triton, "HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRELLM_PDL", raising=False)
    monkeypatch.delenv("TRELLM_PDL_TRIGGER", raising=False)
    yield monkeypatch
    _triton._PDL.clear()


def test_default_on_for_the_gpu_checked_kernels_only(fresh_pdl):
    assert _triton.pdl_kwargs() == {"PDL": True, "launch_pdl": True}
    assert _triton.pdl_kwargs(gpu_checked=False) == {}


def test_all_kernels_when_asked(fresh_pdl):
    fresh_pdl.setenv("TRELLM_PDL", "1")
    assert _triton.pdl_kwargs() == _triton.pdl_kwargs(gpu_checked=False) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_off_when_asked(fresh_pdl, value):
    fresh_pdl.setenv("TRELLM_PDL", value)
    assert _triton.pdl_kwargs() == _triton.pdl_kwargs(gpu_checked=False) == {}


@pytest.mark.parametrize("value", ["on", "TRUE", "yes", "all"])
def test_on_words(fresh_pdl, value):
    fresh_pdl.setenv("TRELLM_PDL", value)
    assert _triton.pdl_kwargs(gpu_checked=False) == {"PDL": True, "launch_pdl": True}


def test_unknown_value_is_an_error_naming_the_variable(fresh_pdl):
    fresh_pdl.setenv("TRELLM_PDL", "maybe")
    with pytest.raises(ValueError, match="TRELLM_PDL"):
        _triton.pdl_enabled()


def test_trigger_late_by_default_early_when_asked(fresh_pdl):
    assert _triton.pdl_kwargs()["PDL"] == 1
    _triton._PDL.clear()
    fresh_pdl.setenv("TRELLM_PDL_TRIGGER", " Early ")
    assert _triton.pdl_kwargs() == {"PDL": 2, "launch_pdl": True}
    fresh_pdl.setenv("TRELLM_PDL", "0")
    _triton._PDL.clear()
    assert _triton.pdl_kwargs() == {}


def test_unknown_trigger_is_an_error_naming_the_variable(fresh_pdl):
    fresh_pdl.setenv("TRELLM_PDL_TRIGGER", "soon")
    with pytest.raises(ValueError, match="TRELLM_PDL_TRIGGER"):
        _triton.pdl_enabled()


def test_off_before_sm90(fresh_pdl):
    import torch

    fresh_pdl.setenv("TRELLM_PDL", "1")
    fresh_pdl.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert _triton.pdl_kwargs() == {}


def test_off_without_triton_or_cuda(fresh_pdl):
    import torch

    fresh_pdl.setenv("TRELLM_PDL", "1")
    fresh_pdl.setattr(_triton, "HAS_TRITON", False)
    assert not _triton.pdl_enabled()
    _triton._PDL.clear()
    fresh_pdl.setattr(_triton, "HAS_TRITON", True)
    fresh_pdl.setattr(torch.cuda, "is_available", lambda: False)
    assert not _triton.pdl_enabled()


def test_never_in_the_interpreter(fresh_pdl):
    fresh_pdl.setenv("TRELLM_PDL", "1")
    fresh_pdl.setenv("TRITON_INTERPRET", "1")
    assert not _triton.pdl_enabled()


def _kernel_params(tree: ast.Module) -> dict[str, set[str]]:
    return {n.name: {a.arg for a in n.args.args} for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_pdl_launches_target_pdl_kernels():
    """Every ``kernel[grid](..., **pdl_kwargs(...))`` launches a kernel that takes PDL
    (looked up in the launching module, or the trellm.kernels module it imports the name
    from); every kernel listed above is launched so somewhere; and the default switch
    (``pdl_kwargs()``) goes only to GPU_CHECKED kernels, the rest pass gpu_checked=False."""
    root = pathlib.Path(_triton.__file__).parent
    trees = {p.stem: ast.parse(p.read_text()) for p in root.glob("*.py")}
    launched = set()
    for stem, tree in trees.items():
        own = _kernel_params(tree)
        imported = {alias.name: node.module.rsplit(".", 1)[1] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trellm.kernels.")
                    for alias in node.names}
        # ``kernel = _a_kernel if ... else _b_kernel`` then ``kernel[grid](...)``: both.
        aliases = {node.targets[0].id: [node.value.body.id, node.value.orelse.id] for node in ast.walk(tree)
                   if isinstance(node, ast.Assign) and len(node.targets) == 1
                   and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.IfExp)
                   and isinstance(node.value.body, ast.Name) and isinstance(node.value.orelse, ast.Name)}
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                    and isinstance(call.func.value, ast.Name)):
                continue
            for kw in call.keywords:
                switch = ast.unparse(kw.value)
                if kw.arg is None and switch.startswith("pdl_kwargs("):
                    for name in aliases.get(call.func.value.id, [call.func.value.id]):
                        params = own.get(name) or _kernel_params(trees[imported[name]]).get(name, set())
                        assert "PDL" in params, f"{stem}.py: {name} launched with pdl_kwargs() lacks PDL"
                        want = "pdl_kwargs()" if name in GPU_CHECKED else "pdl_kwargs(gpu_checked=False)"
                        assert switch == want, f"{stem}.py: {name} launched with {switch}, not {want}"
                        launched.add(name)
    assert {name for _, name in DECODE_KERNELS} <= launched


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
    if name in READ_BEFORE_WAIT:  # reads only what no kernel of the forward writes before the wait
        wait = next(i for i, st in enumerate(stmts) if ast.unparse(st) == "pdl_begin(PDL)")
        used = {n.id for st in stmts[:wait] for n in ast.walk(st) if isinstance(n, ast.Name)}
        allowed, forbidden = READ_BEFORE_WAIT[name]
        assert allowed <= used and not used & forbidden, (name, used & forbidden, allowed - used)
        stmts = stmts[wait:]
    assert ast.unparse(stmts[0]) == "pdl_begin(PDL)", f"{name}: its first statement is not the PDL wait"


@pytest.mark.parametrize("value,want", [("", 0), ("0", 0), (" 2 ", 2), ("8", 8)])
def test_gemv_prefetch_setting(monkeypatch, value, want):
    from trellm import envs

    monkeypatch.setenv("TRELLM_GEMV_PREFETCH", value)
    assert envs.gemv_prefetch_blocks() == want


@pytest.mark.parametrize("value", ["3", "9", "-1", "two"])
def test_gemv_prefetch_bad_values_name_the_variable(monkeypatch, value):
    from trellm import envs

    monkeypatch.setenv("TRELLM_GEMV_PREFETCH", value)
    with pytest.raises(ValueError, match="TRELLM_GEMV_PREFETCH"):
        envs.gemv_prefetch_blocks()
