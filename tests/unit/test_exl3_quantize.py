"""The EXL3 quantizer: the Viterbi against brute force on a small trellis, packing
against the reference decoder, one linear end to end (error falls with bits), and a
tiny 2-layer model quantized, loaded by trellm, and resumed after a crash.

The trellis has 2^16 states whatever K is, so every 256-weight tile costs tens of
milliseconds on this CPU: the model here is the smallest the format allows (every
linear 128 wide), with few calibration tokens and a short wrap window."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from trellm.quant.exl3.codebook import codebook_table
from trellm.quant.exl3.quantize_linear import (LinearQuantOptions, LinearToQuantize, TileCoder, pack_trellis,
                                               prepare_hessian, quantize_linears, rows_to_tiles, tiles_to_rows)
from trellm.quant.exl3.reference import decode_tiles, dense_weight, trellis_states
from trellm.quant.exl3.viterbi import Trellis, ViterbiOptions, open_walk, tail_biting, walk_cost
from trellm.quant.exl3.weight import EXL3Weight

FAST = ViterbiOptions(wrap_window=8)
"""The same algorithm with a shorter wrap-finding pass (8 of 256 steps): cheaper tests."""


@pytest.fixture(autouse=True)
def one_thread():
    # Two threads on a shared 2-core machine spin against each other in these
    # memory-bound steps (measured 10-40x slower); one is as fast as it gets here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the Viterbi -------------------------------------------------------------------------------


def _all_walks(trellis: Trellis, steps: int) -> torch.Tensor:
    """Every walk of ``steps`` steps: [start nodes x symbol sequences, steps] states."""
    mask = (1 << trellis.state_bits) - 1
    symbols = torch.tensor(list(itertools.product(range(trellis.fan), repeat=steps)))
    walks = []
    for node in range(trellis.nodes):
        s = torch.full((symbols.shape[0],), node)
        states = []
        for t in range(steps):
            s = ((s << trellis.bits) | symbols[:, t]) & mask
            states.append(s)
        walks.append(torch.stack(states, 1))
    return torch.cat(walks)


@pytest.mark.parametrize("track", ["indices", "recompute"])
def test_viterbi_finds_the_brute_force_optimum(track):
    trellis, steps = Trellis(bits=2, state_bits=6), 6
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1 << trellis.state_bits, generator=g)
    targets = torch.randn(5, steps, generator=g)
    walks = _all_walks(trellis, steps)
    costs = (table[walks][None] - targets[:, None]).square().sum(-1)   # [tiles, walks]
    options = ViterbiOptions(track=track)
    free = open_walk(targets, table, trellis, options)
    torch.testing.assert_close(walk_cost(free, targets, table), costs.min(1).values.double())
    node = 5
    closed_through = ((walks[:, 0] >> trellis.bits) == node) & ((walks[:, -1] & (trellis.nodes - 1)) == node)
    through = open_walk(targets, table, trellis, options, start=torch.full((5,), node))
    assert bool(((through[:, 0] >> trellis.bits) == node).all()) and bool(((through[:, -1] & 15) == node).all())
    torch.testing.assert_close(walk_cost(through, targets, table), costs[:, closed_through].min(1).values.double())
    rings = (walks[:, 0] >> trellis.bits) == (walks[:, -1] & (trellis.nodes - 1))
    ring = tail_biting(targets, table, trellis, options)
    assert bool(((ring[:, 0] >> trellis.bits) == (ring[:, -1] & (trellis.nodes - 1))).all())  # closed
    got = walk_cost(ring, targets, table)
    best = costs[:, rings].min(1).values.double()
    # Two passes (wrap node from a first pass, then the best ring through it) are exact
    # given the node (checked above) but a heuristic over all rings: on 6-step rings that
    # share every state they can miss; on 256-step tiles the wrap is a local decision.
    assert bool((got >= best - 1e-6).all())
    assert float(got.sum()) < 0.5 * float(costs[:, rings].median(1).values.sum())


def test_viterbi_beats_greedy_on_exl3_tiles_and_float16_costs_agree():
    g = torch.Generator().manual_seed(1)
    targets = torch.randn(6, 256, generator=g) * 0.9
    table = codebook_table("mul1").float()
    exact = tail_biting(targets, table, Trellis(2), FAST)
    half = tail_biting(targets, table, Trellis(2), ViterbiOptions(wrap_window=8, cost_dtype=torch.float16))
    cost, cost_half = walk_cost(exact, targets, table), walk_cost(half, targets, table)
    assert float(cost_half.sum()) <= 1.01 * float(cost.sum())
    # The CUDA bookkeeping (each node's best predecessor) finds the same walks as the CPU's.
    indices = tail_biting(targets[:2], table, Trellis(2), ViterbiOptions(wrap_window=8, track="indices"))
    assert torch.equal(indices, exact[:2])
    # Greedy: from the wrap state, take the best next symbol at each step.
    state = exact[:, -1].clone()
    greedy = []
    for t in range(256):
        cands = ((state[:, None] << 2) | torch.arange(4)) & 0xFFFF
        pick = (table[cands] - targets[:, t:t + 1]).square().argmin(1, keepdim=True)
        state = cands.gather(1, pick).view(-1)
        greedy.append(state)
    assert float(cost.sum()) < 0.6 * float(walk_cost(torch.stack(greedy, 1), targets, table).sum())


# ---- packing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_round_trips_through_the_reference_decoder(bits):
    g = torch.Generator().manual_seed(bits)
    symbols = torch.randint(0, 1 << bits, (3, 5, 256), generator=g)
    # The ring's states: each the 16 bits ending at weight t, wrapping around.
    bitstream = ((symbols[..., None] >> torch.arange(bits - 1, -1, -1)) & 1).reshape(3, 5, -1)
    ring = torch.cat([bitstream, bitstream], -1)
    ends = torch.arange(1, 257) * bits + 256 * bits
    window = ring[..., (ends[:, None] - 16 + torch.arange(16)[None, :]) % (256 * bits)]
    states = (window << torch.arange(15, -1, -1)).sum(-1)
    packed = pack_trellis(states, bits)
    assert packed.dtype == torch.int16 and packed.shape == (3, 5, 16 * bits)
    assert torch.equal(trellis_states(packed), states)


def test_encoded_tiles_decode_in_place():
    """Viterbi states -> packed trellis -> reference decode gives the coder's values,
    each back at its row-major position."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(16, 32, generator=g)
    coder = TileCoder(3, "mcg", torch.device("cpu"), FAST)
    states = coder.encode(rows_to_tiles(rows))
    assert torch.equal(tiles_to_rows(rows_to_tiles(rows)), rows)
    packed = pack_trellis(states, 3).view(1, 2, 48)
    decoded = decode_tiles(packed, "mcg")[0]                       # [2, 16, 16] row-major tiles
    assert torch.equal(decoded.permute(1, 0, 2).reshape(16, 32), tiles_to_rows(coder.decode(states)))
    assert float((tiles_to_rows(coder.decode(states)) - rows).square().mean()) < 0.05


# ---- one linear ---------------------------------------------------------------------------------


def _quantize_one(w: torch.Tensor, bias, hessian, bits: int) -> tuple[EXL3Weight, float]:
    options = LinearQuantOptions(bits=bits, codebook="mul1", viterbi=FAST, scale_samples=4)
    (q,) = quantize_linears([(LinearToQuantize("m.proj", w, bias), hessian)], options)
    assert q.tensors["m.proj.trellis"].shape == (w.shape[1] // 16, w.shape[0] // 16, 16 * bits)
    part = EXL3Weight.from_tensors({k.removeprefix("m.proj."): v for k, v in q.tensors.items()}, *w.shape[::-1])
    return part, q.proxy_error


def test_linear_error_falls_with_bits_and_with_hessian_feedback():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g) / 128 ** 0.5
    w[:, 7] *= 8  # an outlier input channel: what the Hessian and the row scales are for
    bias = torch.randn(128, generator=g)
    x = torch.randn(512, 128, generator=g) @ (torch.eye(128) + 0.5 * torch.randn(128, 128, generator=g))
    hessian = prepare_hessian(x.t() @ x, 512, seed=1)

    def output_error(part: EXL3Weight) -> float:
        return float((x @ (dense_weight(part) - w).t()).square().sum() / (x @ w.t()).square().sum())

    errors = {}
    for bits in (3, 5):
        part, proxy = _quantize_one(w, bias, hessian, bits)
        assert part.codebook == "mul1" and torch.equal(part.bias, bias.half())
        errors[bits] = output_error(part)
        # The logged proxy error is the output error on the calibration inputs (damped H).
        assert abs(errors[bits] - proxy) < 0.2 * errors[bits]
    # Each bit divides the error by about 4 (rate-distortion: 4^-K).
    assert errors[3] < 0.03 and errors[5] < errors[3] / 8
    # The same weight without a Hessian (identity: no feedback, no input weighting) does worse.
    blind, _ = _quantize_one(w, bias, prepare_hessian(torch.eye(128), 1, seed=1), 3)
    assert errors[3] < 0.8 * output_error(blind)


# ---- a whole model ----------------------------------------------------------------------------------


# Decoder at 4 bits, head at 2: both K run through the model, and the bulk of the tiles
# (the decoder) takes the cheaper K on the CPU (fewer trellis nodes to keep).
QUANT_ARGS = ["--bits", "4", "--head-bits", "2", "--calib-rows", "4", "--calib-cols", "64", "--scale-samples", "1",
              "--wrap-window", "8", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trellm.eval.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """The tiny model through ``trellm quantize`` (the CLI, uninterrupted)."""
    from trellm.entrypoints.cli import main

    out = tmp_path_factory.mktemp("q") / "exl3"
    torch.set_num_threads(1)
    assert main(["quantize", str(tiny), "--out", str(out), *QUANT_ARGS]) == 0
    return out


def _logits(path, quantization: str, ids: list[int]) -> torch.Tensor:
    from trellm.eval.kld import ModelSpec, load_model, window_logits

    return window_logits(load_model(ModelSpec(str(path), quantization), device="cpu"), torch.tensor(ids))


def test_quantized_model_loads_and_matches_its_reconstruction(quantized, tiny):
    config = json.loads((quantized / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["head_bits"], qc["codebook"]) == ("exl3", 4.0, 2, "mul1")
    assert config["tie_word_embeddings"] is False and not (quantized / ".trellm-quant").exists()
    storage = json.loads((quantized / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["model.layers.1.mlp.down_proj"]["bits_per_weight"] == 4
    assert storage["lm_head"]["bits_per_weight"] == 2 and "mul1_multiplier" in storage["lm_head"]
    assert (quantized / "tokenizer.json").read_text() == (tiny / "tokenizer.json").read_text()
    from trellm.eval.kld import ModelSpec, load_model

    exl3 = load_model(ModelSpec(str(quantized), "auto"), device="cpu")
    assert exl3.method == "exl3" and 4 < exl3.bpw < 4.5 < exl3.stored_bpw  # + suh/svh; + padding of k/v
    assert [p.bits for p in exl3.model.layers[0].self_attn.qkv_proj.exl3_parts] == [4, 4, 4]
    assert [p.bits for p in exl3.model.lm_head.exl3_parts] == [2]
    ids = list(b"The tiny model reads bytes.")
    got = _logits(quantized, "auto", ids)
    # The same checkpoint decoded once into dense weights (W = suh Hb Wq Hb svh).
    dense = _logits(quantized, "none", ids)
    torch.testing.assert_close(got, dense, atol=2e-3, rtol=1e-3)
    source = _logits(tiny, "none", ids)
    # Quantized, not random: the next-token distributions stay close to the source model's.
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), source.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 1.0 and float(source.std()) > 0.5


def test_interrupted_run_resumes_to_the_same_output(quantized, tiny, tmp_path):
    from trellm.entrypoints.cli import build_parser
    from trellm.quant.exl3.quantize import quantize_model
    from trellm.quant.exl3.quantize_cli import options_from_args

    out = tmp_path / "exl3"
    options = options_from_args(build_parser().parse_args(["quantize", str(tiny), "--out", str(out), *QUANT_ARGS]))
    seen = []

    class Crash(Exception):
        pass

    def crash_after_first(i, resumed):
        seen.append((i, resumed))
        if i == 0 and not resumed:
            raise Crash  # as if the process were killed once layer 0 is saved

    with pytest.raises(Crash):
        quantize_model(str(tiny), out, options, on_layer_done=crash_after_first)
    assert sorted(p.name for p in (out / ".trellm-quant").iterdir()) == ["layer-000.safetensors", "manifest.json"]
    with pytest.raises(ValueError, match="other settings"):
        quantize_model(str(tiny), out, dataclasses.replace(options, bits=3))  # a different run: refused
    result = quantize_model(str(tiny), out, options, on_layer_done=crash_after_first)
    assert result.resumed_parts == 1 and seen == [(0, False), (0, True), (1, False)]
    want, got = load_file(str(quantized / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_quantize_cli_errors(capsys, tiny, tmp_path):
    from trellm.entrypoints.cli import main

    for argv, fragment in [(["--bits", "9"], "--bits"), (["--bits", "2", "--head-bits", "12"], "--head-bits")]:
        assert main(["quantize", str(tiny), "--out", str(tmp_path / "x"), *argv]) == 1
        assert fragment in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "junk.txt").write_text("x")
    assert main(["quantize", str(tiny), "--out", str(tmp_path / "full"), "--bits", "2"]) == 1
    assert "not empty" in capsys.readouterr().err


def test_calibration_hessians_see_every_projection_input(tiny):
    """The Hessians are sums of x^T x over exactly the inputs each projection of a layer
    receives (the model calls submodules through .forward, so a hook on __call__ would
    see nothing): counts equal the calibration tokens, sums equal the direct products."""
    from trellm.quant.exl3.quantize import Calibration, _dense_model, _open

    model = _dense_model(*_open(str(tiny)), torch.device("cpu"), 32)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    calib = Calibration(model, ids, torch.device("cpu"))
    layer = model.layers[0]
    groups = {"qkv": layer.self_attn.qkv_proj, "gate_up": layer.mlp.gate_up_proj}
    sums = calib.hessians(groups, lambda: calib.forward(layer))
    assert all("forward" not in m.__dict__ for m in groups.values())  # the recorders are gone
    x = layer.input_layernorm(calib.x)
    assert sums["qkv"][1] == 64
    torch.testing.assert_close(sums["qkv"][0], x.t() @ x, rtol=1e-4, atol=1e-3)
    assert sums["gate_up"][1] == 64 and float(sums["gate_up"][0].diagonal().min()) > 0
