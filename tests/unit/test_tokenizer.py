"""Our tokenizer and chat templates against transformers' on the same files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trellm.loader.errors import ModelLoadError
from trellm.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\tand\ttabs",
    "line one\nline two\n\nline four\n",
    "\n\n\n",
    "   \t \n ",
    "",
    "a",
    "def square(x):\n    return x ** 2  # comment\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    "import numpy as np\nnp.array([1, 2, 3]).sum()",
    "12345 678.90 -3.5e10 0x1F 1,000,000",
    "3.14159265358979323846",
    "The year 2024 had 366 days.",
    "emoji 🤖🎉 and 👩‍👩‍👧 family",
    "中文测试，你好世界。",
    "日本語のテキストです",
    "한국어 텍스트",
    "café naïve résumé Ångström façade",
    "Ünïcödé ßtraße",
    "Привет, мир!",
    "مرحبا بالعالم",
    "don't I'll we've they're it's",
    "ALL CAPS TEXT AND MiXeD cAsE",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|> spaced <|im_end|>",
    "<repo_name>trellm<file_sep>main.py",
    "URL: https://example.com/path?q=1&r=2#frag",
    "email me at someone@example.org!!!",
    "~!@#$%^&*()_+`-={}|[]\\:\";'<>?,./",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "multi\nline\n\ncontent 😀"},
     {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def gguf_file(default_gguf) -> Path:
    return Path(default_gguf)


@pytest.fixture(scope="module")
def ours(gguf_file) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_file)


@pytest.fixture(scope="module")
def ref(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours, ref, text):
    assert ours.encode(text) == ref.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trips(ours, ref, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens(ours, ref):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_id == ref.eos_token_id == 2
    assert ours.eos_token_ids == frozenset({2})
    assert ours.add_bos_token is False
    assert set(ours.all_special_ids) == set(range(17))
    assert ours.convert_ids_to_tokens([1, 2, 19556]) == ["<|im_start|>", "<|im_end|>", "Hello"]
    assert ours.convert_ids_to_tokens(0) == "<|endoftext|>"
    # Special tokens are matched whole, never split by BPE.
    assert ours.encode("<|im_start|>") == [1]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, ref, messages):
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    no_prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


def test_chat_template_content_parts(ours):
    plain = [{"role": "user", "content": "line a\nline b"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "line a"},
                                          {"type": "text", "text": "line b"}]}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)


def test_chat_template_errors(ours):
    bare = Tokenizer(ours.hf, eos_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer(ours.hf, eos_token_id=2, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ messages[0]['content'] }}"))
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    broken = Tokenizer(ours.hf, eos_token_id=2, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sandboxed(ours):
    evil = Tokenizer(ours.hf, eos_token_id=2,
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError):
        evil.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_globals(ours):
    t = Tokenizer(ours.hf, bos_token_id=1, eos_token_id=2, chat_template=(
        "{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}{{ eos_token }}"))
    out = t.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert out == '<|im_start|>[{"role": "user", "content": "<é>"}]4<|im_end|>'


def test_hf_dir_tokenizer_matches(tmp_path, ours, ref):
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == ref.encode(text)
    assert hf.eos_token_id == 2 and hf.bos_token_id == 1
    assert hf.eos_token_ids == frozenset({0, 2})
    assert hf.chat_template == ref.chat_template
    msgs = CONVERSATIONS[2]
    assert hf.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    # Tokenizer.load dispatches on content: the directory and the GGUF file.
    assert Tokenizer.load(tmp_path).encode("hi there") == ours.encode("hi there")


def test_hf_dir_add_bos_flag_overrides_post_processor(tmp_path, ref):
    ref.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos_token
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- a SentencePiece ("llama") GGUF vocabulary, built here --------------------------------


def _write_sentencepiece_gguf(path: Path) -> None:
    import gguf

    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "el", "ll", "lo", "\u2581w",
              "or", "ld", "\u2581he", "llo", "\u2581hello", "\u2581wor", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path)
    ours = Tokenizer.from_gguf(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "hello", " hello  world", "held", "wold é!", "hello\nworld"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert ours.encode("hello")[0] == 1  # SentencePiece files default to adding BOS


def test_unsupported_gguf_tokenizer(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "[UNK]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(path)


def test_token_bytes_rebuild_the_text_byte_for_byte(ours):
    # OpenAI's logprob "bytes": a token holding part of a UTF-8 character gives its own
    # bytes (the emoji below is split over two tokens), so joining them rebuilds the text.
    text = "Emojis: \U0001f600\U0001f603 caf\u00e9 \u65e5\u672c\u8a9e"
    ids = ours.encode(text, add_special_tokens=False)
    pieces = [ours.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(len(p) and p != "\ufffd".encode() and "\ufffd" in ours.decode([i]) for p, i in zip(pieces, ids))
    assert ours.token_bytes(ours.eos_token_id) == ours.decode([ours.eos_token_id], skip_special_tokens=False).encode()
