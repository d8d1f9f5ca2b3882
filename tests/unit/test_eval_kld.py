"""``trellm eval kld``: the metrics (a model against itself is exactly KL 0 with
full agreement; a perturbed copy is not), the students the quality panel compares
(EXL3 directories, INT8, round-to-nearest), the JSON / markdown output, the CLI's
errors, and the shipped texts."""
from __future__ import annotations

import json

import pytest
import torch

from trellm.entrypoints.cli import main
from trellm.eval.kld import ModelSpec, compare, load_model, windows
from trellm.eval.rtn import RTNSpec, parse_rtn, rtn_weight


@pytest.fixture(autouse=True)
def one_thread():
    # Small matmuls on a shared 2-core machine: a second thread only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trellm.eval.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def text_ids():
    from trellm.data import data_path

    # The byte tokenizer: one token per byte of the shipped evaluation text.
    return list(data_path("eval.txt").read_bytes()[:1024])


def test_model_against_itself_is_exactly_zero(tiny, text_ids):
    teacher = load_model(ModelSpec(tiny, "none", "teacher"), device="cpu")
    same = load_model(ModelSpec(tiny, "none"), device="cpu")
    r = compare(teacher, same, text_ids, context=128, progress=False)
    assert (r.kl_mean, r.kl_median, r.kl_p99, r.kl_max) == (0.0, 0.0, 0.0, 0.0)
    assert r.top1_agreement == 1.0 and r.ppl_teacher == r.ppl_student
    tok = teacher.tokenizer
    bos = tok.bos_token_id if tok is not None and tok.add_bos_token else None
    chunks = windows(text_ids, 128, bos)  # BOS or not, as compare() decides it
    assert r.tokens == sum(len(w) - 1 for w in chunks) and r.windows == len(chunks) >= 8
    assert 1 < r.ppl_teacher < 1e4 and r.method == "dense" and r.bpw == 32.0  # float32 weights as run


def test_quantized_students_move_the_distribution(tiny, text_ids):
    teacher = load_model(ModelSpec(tiny, "none", "teacher"), device="cpu")
    results = {}
    for q in ("int8", "rtn4", "rtn2"):
        student = load_model(ModelSpec(tiny, q), device="cpu")
        results[q] = compare(teacher, student, text_ids, context=128, progress=False, keep_per_token=True)
    int8, rtn4, rtn2 = results["int8"], results["rtn4"], results["rtn2"]
    assert (int8.method, rtn4.method, rtn2.method) == ("int8", "rtn4g32", "rtn2g32")
    assert int8.bpw == pytest.approx(8 + 16 / 128) and rtn4.bpw == 4.625 and rtn2.bpw == pytest.approx(2.5625)
    # Finer rounding, smaller divergence; every per-token KL is a proper divergence (>= 0).
    assert 0 < int8.kl_mean < rtn4.kl_mean < rtn2.kl_mean
    assert rtn2.top1_agreement < rtn4.top1_agreement <= int8.top1_agreement < 1.0
    assert all(float(r.per_token_kl.min()) > -1e-6 for r in results.values())
    assert rtn4.kl_median <= rtn4.kl_p99 <= rtn4.kl_max


def test_rtn_rounds_each_group_to_its_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 96, generator=g)
    q = rtn_weight(w, RTNSpec(4, 32))
    for row in range(8):
        for grp in range(3):
            orig, got = w[row, 32 * grp:32 * grp + 32], q[row, 32 * grp:32 * grp + 32]
            assert torch.unique(got).numel() <= 16
            step = float(orig.max() - orig.min()) / 15
            assert float((got - orig).abs().max()) <= 0.5 * step * 1.01 + 1e-6
    # A group that does not span 0 still rounds to its own range (the grid then runs
    # from 0 to its max): 1.0 / 1.1 once all came back as 0.1.
    w2 = torch.cat([torch.full((1, 16), 1.0), torch.full((1, 16), 1.1)], dim=1)
    assert float((rtn_weight(w2, RTNSpec(4, 32)) - w2).abs().max()) <= 0.5 * 1.1 / 15 * 1.01
    assert parse_rtn("rtn4") == RTNSpec(4, 32) and parse_rtn("rtn3g128") == RTNSpec(3, 128)
    assert parse_rtn("int8") is None
    with pytest.raises(ValueError, match="group"):
        rtn_weight(w, RTNSpec(4, 64))


def test_windows_keep_bos_and_drop_tiny_tails():
    ids = list(range(100, 300))
    plain = windows(ids, 64, None)
    assert [len(w) for w in plain] == [64, 64, 64, 8] and torch.equal(plain[1][:2], torch.tensor([164, 165]))
    with_bos = windows(ids, 64, 1)
    assert all(int(w[0]) == 1 for w in with_bos) and [len(w) for w in with_bos] == [64, 64, 64, 12]
    assert windows(ids[:5], 64, None) == []


def test_cli_writes_json_and_markdown(tiny, tmp_path, capsys):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = main(["eval", "kld", "--teacher", tiny, "--student", tiny, "--student", tiny,
                 "--student-quantization", "none", "--student-quantization", "rtn4", "--label", "self",
                 "--label", "rtn", "--max-tokens", "600", "--context", "128", "--device", "cpu", "--quiet",
                 "--out-json", str(out_json), "--out-md", str(out_md)])
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["text_tokens"] == 600 and report["context"] == 128 and report["dtype"] == "float32"
    assert report["teacher"]["quantization"] == "none" and report["machine"]["device"] == "cpu"
    fields = {"teacher", "student", "student_model", "student_quantization", "method", "bpw", "stored_bpw", "tokens",
              "windows",
              "context", "kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement", "ppl_teacher",
              "ppl_student", "seconds"}
    assert [set(r) for r in report["results"]] == [fields, fields]
    self_row, rtn_row = report["results"]
    assert (self_row["student"], self_row["kl_mean"], self_row["top1_agreement"]) == ("self", 0.0, 1.0)
    assert rtn_row["student"] == "rtn" and rtn_row["kl_mean"] > 0
    table = out_md.read_text()
    assert "| self | dense | 32.000 | 32.000 | 0.00000 |" in table and "| rtn | rtn4g32 | 4.625 | 4.625 |" in table
    assert table.splitlines()[0] in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--student", "A", "--student", "B", "--student-quantization", "none", "--student-quantization", "none",
      "--student-quantization", "none"], "2 students but 3"),
    (["--student-quantization", "bogus"], "unsupported --quantization"),
    (["--student-quantization", "rtn9"], "RTN needs 2..8 bits"),
    (["--context", "8"], "--context"),
])
def test_cli_errors_are_one_line(tiny, capsys, argv, fragment):
    code = main(["eval", "kld", "--teacher", tiny, "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 1 and fragment in err and "Traceback" not in err


def test_shipped_texts(default_gguf):
    from trellm.data import data_path
    from trellm.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.load(default_gguf)
    text = data_path("eval.txt").read_text(encoding="utf-8")
    assert len(tok.encode(text, add_special_tokens=False)) >= 50_000
    assert "def " in text and "import " in text  # code
    assert "Notes on Baking Bread at Altitude" in text and "The Lighthouse" not in text  # disjoint prose
    calibration = data_path("calibration.txt").read_text(encoding="utf-8")
    assert len(tok.encode(calibration, add_special_tokens=False)) >= 32 * 512  # the default rows x cols
    assert "Python Software Foundation" in data_path("LICENSE-PSF.txt").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="no shipped data file"):
        data_path("missing.txt")
