"""kernels/compile_check.py's launch description (no Triton needed); the compile step
itself is tested where Triton is installed (tests/kernels/test_gemv.py)."""
from __future__ import annotations

import json

import pytest
import torch

from trellm.kernels.compile_check import Launch, describe


def _kernel(x_ptr, counter_ptr, n, big, eps, flag, BLOCK: "tl.constexpr", MODE: "tl.constexpr" = 2,
            OPT: "tl.constexpr" = None):
    """A stand-in with a kernel's parameter kinds (the annotations are what Triton sees)."""


def test_describe_types_arguments_and_keeps_constexpr_values():
    x = torch.empty(2, 3, dtype=torch.bfloat16)
    c = torch.zeros(1, dtype=torch.int32)
    launch = describe(_kernel, (x, c, 7, 2**40, 1e-5, True), {"BLOCK": 64, "num_warps": 4, "launch_pdl": True})
    assert launch.signature == (("x_ptr", "*bf16"), ("counter_ptr", "*i32"), ("n", "i32"), ("big", "i64"),
                                ("eps", "fp32"), ("flag", "i1"), ("BLOCK", "constexpr"), ("MODE", "constexpr"),
                                ("OPT", "constexpr"))
    assert launch.constexprs == (("BLOCK", 64), ("MODE", 2), ("OPT", None))
    assert launch.options == (("launch_pdl", True), ("num_warps", 4))
    assert (launch.module, launch.kernel) == (__name__, "_kernel")
    module, kernel, sig, consts, opts = json.loads(launch.key())
    assert Launch(module, kernel, tuple(map(tuple, sig)), tuple(map(tuple, consts)),
                  tuple(map(tuple, opts))).key() == launch.key()


def test_describe_names_what_it_cannot_type():
    with pytest.raises(TypeError, match="no value for BLOCK"):
        describe(_kernel, (None, None, 1, 1, 1.0, False), {})
    with pytest.raises(TypeError, match="no Triton type"):
        describe(_kernel, ("text", None, 1, 1, 1.0, False), {"BLOCK": 1})


def test_loops_finds_back_edges_and_opcodes_drop_predicates_and_modifiers():
    from trellm.kernels.compile_check import loops, opcode

    rows = [("", "S2R R0, SR_TID.X"), ("LBB0", ""), ("", "IMAD.WIDE R2, R0, 0x4, R4"), ("LBB1", ""),
            ("", "LDG.E R6, desc[UR4][R2.64]"), ("", "@P0 BRA LBB1"), ("", "@!P1 BRA LBB0"), ("", "BRA LBB2"),
            ("LBB2", ""), ("", "EXIT")]
    assert loops(rows) == [(2, 3), (1, 4)]  # LBB1's body (LDG, BRA), then LBB0's around it; LBB2 is forward
    assert [opcode(t) for _, t in rows if t][:4] == ["S2R", "IMAD", "LDG", "BRA"]


def test_with_overrides_sets_constexprs_and_options_the_kernel_has():
    from trellm.kernels.compile_check import with_overrides

    key = describe(_kernel, (None, None, 1, 1, 1.0, False), {"BLOCK": 8, "num_warps": 2}).key()
    _, _, sig, consts, opts = json.loads(with_overrides(key, {"MODE": 5, "num_warps": 4, "ABSENT": 1}))
    assert consts == [["x_ptr", None], ["counter_ptr", None], ["BLOCK", 8], ["MODE", 5], ["OPT", None]]
    assert opts == [["num_warps", 4]]
    assert sig == json.loads(key)[2]
