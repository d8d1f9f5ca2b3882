"""Tests for trellm.engine.output_processor: detokenization, stop strings, n>1."""
from __future__ import annotations

from typing import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trellm.engine.output_processor import IncrementalDetokenizer, OutputProcessor
from trellm.engine.types import EngineCoreOutput, RequestOutput, TokenLogprobs
from trellm.sampling_params import SamplingParams

EMOJI_TEXT = "Hi 😀 café 🎉 naïve! 你好 👩‍💻 done"


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE small enough that emoji and CJK split into several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello world, café crème brûlée naïve déjà vu", "the quick brown fox jumps",
              "stop here STOP there, done"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<tool>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


class PieceTokenizer:
    """Each id is a fixed string piece; ids in ``special`` are special tokens."""

    def __init__(self, pieces: Sequence[str], special: Sequence[str] = ()) -> None:
        self.pieces = list(pieces) + list(special)
        self.special = {len(pieces) + i for i in range(len(special))}
        self.index = {p: i for i, p in enumerate(self.pieces)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids
                       if not (skip_special_tokens and i in self.special))

    def ids(self, *pieces: str) -> list[int]:
        return [self.index[p] for p in pieces]


PIECES = ["a", "b", " ", "hello", "ST", "OP", "STOP", "world", "x", "!", "S", "T", "O", "P"]
SPECIAL = ["<eos>", "<sep>"]


@pytest.fixture
def pt() -> PieceTokenizer:
    return PieceTokenizer(PIECES, SPECIAL)


def stream(proc: OutputProcessor, child: str, tokens: list[int], finish: str | None = "length",
           chunk: int = 1, stop_reason=None) -> tuple[list[RequestOutput], list[list[str]]]:
    """Feed ``tokens`` ``chunk`` at a time (the last step carries ``finish``); stop
    feeding once the processor asks for the child to be stopped."""
    outs, stops = [], []
    for start in range(0, len(tokens), chunk):
        last = start + chunk >= len(tokens)
        eco = EngineCoreOutput(child, tuple(tokens[start:start + chunk]),
                               finish_reason=finish if last else None,
                               stop_reason=stop_reason if last else None)
        res, stop = proc.process([eco])
        outs.extend(res)
        stops.append(stop)
        if stop:
            break
    return outs, stops


def assert_append_only(outs: list[RequestOutput], index: int = 0) -> None:
    prev = ""
    for o in outs:
        text = o.outputs[index].text
        assert text.startswith(prev), (prev, text)
        prev = text


# ---------------------------------------------------------------- detokenization
@pytest.mark.parametrize("chunk", [1, 3])
def test_bpe_emoji_never_leaks_replacement_char(bpe: Tokenizer, chunk: int):
    ids = bpe.encode(EMOJI_TEXT).ids
    assert len(ids) > len(EMOJI_TEXT) // 2  # multibyte chars really are split
    assert any("\ufffd" in bpe.decode(ids[:i]) for i in range(1, len(ids)))
    proc = OutputProcessor(bpe)
    proc.add_request("r", None, bpe.encode("Hello").ids, SamplingParams())
    outs, _ = stream(proc, "r", ids, chunk=chunk)
    for o in outs:
        assert "\ufffd" not in o.outputs[0].text
    assert_append_only(outs)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == EMOJI_TEXT == bpe.decode(ids)
    assert final.outputs[0].token_ids == ids


def test_streaming_deltas_equal_final_text(bpe: Tokenizer):
    ids = bpe.encode("the quick 🦊 jumps over déjà vu 🎉🎉").ids
    proc = OutputProcessor(bpe)
    proc.add_request("r", "p", [5, 6], SamplingParams())
    outs, _ = stream(proc, "r", ids)
    deltas, seen = [], 0
    for o in outs:
        deltas.append(o.outputs[0].text[seen:])
        seen = len(o.outputs[0].text)
    assert "".join(deltas) == outs[-1].outputs[0].text == bpe.decode(ids)
    assert all(o.prompt == "p" and o.prompt_token_ids == [5, 6] for o in outs)


def test_partial_char_flushed_at_finish(bpe: Tokenizer):
    ids = bpe.encode("ok 😀").ids
    cut = ids[:-1]  # the emoji's last byte never arrives
    proc = OutputProcessor(bpe)
    proc.add_request("r", None, [], SamplingParams())
    outs, _ = stream(proc, "r", cut)
    assert all("\ufffd" not in o.outputs[0].text for o in outs[:-1])
    assert outs[-1].outputs[0].text == bpe.decode(cut)  # flushed, U+FFFD and all
    assert outs[-1].outputs[0].text.startswith("ok ")


def test_detokenizer_buffer_stays_bounded(bpe: Tokenizer):
    ids = bpe.encode("hello world " * 300).ids
    d = IncrementalDetokenizer(bpe, [], True)
    text = "".join(d.add(t) for t in ids) + d.flush()
    assert text == "hello world " * 300
    assert len(d._ids) < 300


def test_skip_special_tokens(pt: PieceTokenizer):
    tokens = pt.ids("a", "<sep>", "b")
    for skip, expected in ((True, "ab"), (False, "a<sep>b")):
        proc = OutputProcessor(pt)
        proc.add_request("r", None, [], SamplingParams(skip_special_tokens=skip))
        outs, _ = stream(proc, "r", tokens)
        assert outs[-1].outputs[0].text == expected


def test_eos_text_not_in_output(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(skip_special_tokens=False))
    outs, _ = stream(proc, "r", pt.ids("a", "b", "<eos>"), finish="stop")
    out = outs[-1].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", None)
    assert out.token_ids == pt.ids("a", "b", "<eos>")


# ---------------------------------------------------------------- stop strings
@pytest.mark.parametrize("include, expected", [(False, "hello "), (True, "hello STOP")])
def test_stop_string_cut_exactly(pt: PieceTokenizer, include: bool, expected: str):
    proc = OutputProcessor(pt)
    params = SamplingParams(stop=("STOP",), include_stop_str_in_output=include)
    proc.add_request("r", None, [], params)
    tokens = pt.ids("hello", " ", "STOP", " ", "world")
    outs, stops = stream(proc, "r", tokens, finish=None)
    assert stops == [[], [], ["r"]]
    out = outs[-1].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", "STOP")
    assert out.token_ids == tokens[:3]
    assert outs[-1].finished and not proc.has_request("r")
    assert_append_only(outs)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(pt: PieceTokenizer, include: bool):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("STOP",), include_stop_str_in_output=include))
    outs, stops = stream(proc, "r", pt.ids("a", "S", "T", "O", "P", "b"), finish=None)
    assert stops[-1] == ["r"] and len(stops) == 5
    if not include:  # nothing that could start the stop string is ever shown
        assert all("S" not in o.outputs[0].text for o in outs)
    assert outs[-1].outputs[0].text == ("aSTOP" if include else "a")
    assert_append_only(outs)


def test_stop_string_in_multi_token_step_drops_later_tokens(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("STOP",)))
    tokens = pt.ids("a", "ST", "OP", "b", "x")
    outs, stops = proc.process([EngineCoreOutput("r", tuple(tokens))])
    assert stops == ["r"]
    out = outs[0].outputs[0]
    assert (out.text, out.token_ids) == ("a", tokens[:3])
    # Tokens the scheduler produced before it saw the stop are ignored.
    assert proc.process([EngineCoreOutput("r", (0,))]) == ([], [])


def test_stop_string_never_completes_is_released(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("STOP", "xx")))
    tokens = pt.ids("a", " ", "ST", "O", "b", "ST")
    outs, stops = stream(proc, "r", tokens)
    assert all(s == [] for s in stops)
    texts = [o.outputs[0].text for o in outs]
    full = "a STObST"
    for i, t in enumerate(texts[:-1]):  # 3 chars (len("STOP") - 1) held back
        shown = len(pt.decode(tokens[:i + 1])) - 3
        assert t == full[:max(shown, 0)]
    assert texts[-1] == full
    assert outs[-1].outputs[0].finish_reason == "length"
    assert_append_only(outs)


def test_stop_string_ignored_before_min_tokens(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("a",), min_tokens=2))
    outs, stops = stream(proc, "r", pt.ids("a", "b", "a", "b"), finish=None)
    assert stops[-1] == ["r"] and len(stops) == 3
    assert outs[-1].outputs[0].text == "ab"


def test_stop_string_when_engine_finishes_same_step(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("!",)))
    outs, stops = proc.process([EngineCoreOutput("r", tuple(pt.ids("a", "!")), finish_reason="length")])
    assert stops == []  # the scheduler already ended it
    out = outs[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a", "stop", "!")


# ---------------------------------------------------------------- n > 1, logprobs, bookkeeping
def test_n_children_aggregated(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    params = SamplingParams(n=3, stop=("!",))
    proc.add_request("p", "prompt", [1], params, child_ids=["p-0", "p-1", "p-2"])
    a, b, x, bang, eos = pt.ids("a", "b", "x", "!", "<eos>")
    outs, stops = proc.process([EngineCoreOutput("p-0", (a,)), EngineCoreOutput("p-1", (b,)),
                                EngineCoreOutput("p-2", (x,))])
    assert len(outs) == 1 and outs[0].request_id == "p" and not outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    outs, stops = proc.process([EngineCoreOutput("p-0", (a,), finish_reason="length"),
                                EngineCoreOutput("p-1", (bang,))])
    assert stops == ["p-1"] and not outs[0].finished
    outs, stops = proc.process([EngineCoreOutput("p-2", (eos,), finish_reason="stop")])
    final = outs[0]
    assert final.finished and stops == []
    got = [(c.text, c.finish_reason, c.stop_reason) for c in final.outputs]
    assert got == [("aa", "length", None), ("b", "stop", "!"), ("x", "stop", None)]
    assert final.metrics["arrival"] <= final.metrics["first_token"] <= final.metrics["finished"]
    assert not proc.has_request("p") and not proc.has_request("p-0")


def test_logprobs_accumulate(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [0, 1, 2], SamplingParams(logprobs=1, prompt_logprobs=0))
    lp = [TokenLogprobs(0, -0.5, 1, ((0, -0.5),)), TokenLogprobs(1, -1.0, 2, ((0, -0.2),))]
    plp = (None, TokenLogprobs(1, -2.0, 3), TokenLogprobs(2, -0.1, 1))
    proc.process([EngineCoreOutput("r", (), new_prompt_logprobs=plp[:2])])
    outs, _ = proc.process([EngineCoreOutput("r", (0,), (lp[0],), new_prompt_logprobs=plp[2:])])
    outs2, _ = proc.process([EngineCoreOutput("r", (1,), (lp[1],), finish_reason="length")])
    assert outs[0].outputs[0].logprobs == lp[:1]  # earlier snapshot is not mutated
    out = outs2[0]
    assert out.outputs[0].logprobs == lp
    assert out.outputs[0].cumulative_logprob == pytest.approx(-1.5)
    assert out.prompt_logprobs == list(plp)


def test_no_logprobs_requested(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams())
    outs, _ = proc.process([EngineCoreOutput("r", (0,), finish_reason="length")])
    o = outs[0]
    assert o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None
    assert o.prompt_logprobs is None


def test_abort_and_has_request(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("p", None, [], SamplingParams(n=2), child_ids=["c0", "c1"])
    assert proc.has_request("p") and proc.has_request("c1")
    proc.process([EngineCoreOutput("c0", (0,), finish_reason="length")])
    assert proc.abort("c1") == ["c1"]
    assert not proc.has_request("p") and not proc.has_request("c0")
    assert proc.process([EngineCoreOutput("c1", (0,))]) == ([], [])
    assert proc.abort("p") == []


def test_abort_finish_reason_from_engine(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams(stop=("STOP",)))
    proc.process([EngineCoreOutput("r", tuple(pt.ids("a", "b", "S")))])
    outs, _ = proc.process([EngineCoreOutput("r", (), finish_reason="abort")])
    out = outs[0].outputs[0]
    assert out.finish_reason == "abort" and out.text == "abS" and outs[0].finished


def test_duplicate_request_rejected(pt: PieceTokenizer):
    proc = OutputProcessor(pt)
    proc.add_request("r", None, [], SamplingParams())
    with pytest.raises(ValueError):
        proc.add_request("r", None, [], SamplingParams())
