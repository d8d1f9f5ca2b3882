"""The tokenizer: a ``tokenizers.Tokenizer`` plus the special-token facts around it.

Two sources. A Hugging Face directory carries ``tokenizer.json`` (the full
pipeline) and ``tokenizer_config.json`` (special tokens, BOS policy, template).
A GGUF carries only the vocabulary, merges and token types under llama.cpp's
keys; ``from_gguf`` rebuilds the pipeline the way transformers' GGUF conversion
does, so both give the same ids as the reference for the same file.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from trellm.loader.checkpoint import read_json_object
from trellm.loader.errors import ModelLoadError, first_line
from trellm.tokenizer.chat_template import render_chat_template

_GIL_FREE_CHARS = 4096
"""Longer texts are encoded through ``encode_batch``, which releases the GIL: a plain
``encode`` of a 1.5 MB prompt holds it for seconds, freezing a server's event loop."""

# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre``, as in transformers' GGUF
# conversion. Anything else uses GPT-2's regex (ByteLevel's built-in), which is
# what transformers does too -- e.g. for SmolLM2's "smollm".
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


class Tokenizer:
    """Text <-> token ids, special tokens, and chat-template rendering."""

    def __init__(self, hf: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, unk_token_id: int | None = None,
                 pad_token_id: int | None = None, extra_eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None):
        self.hf = hf
        """The underlying ``tokenizers.Tokenizer`` (its post-processor adds BOS/EOS as configured)."""
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (eos_token_id, *extra_eos_token_ids) if i is not None)
        """Ids that end generation: the tokenizer's EOS plus generation_config's."""
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        special = {i for i, tok in hf.get_added_tokens_decoder().items() if tok.special}
        special |= {i for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id) if i is not None}
        self.all_special_ids: list[int] = sorted(special)
        self._special = frozenset(special)
        self._literal_hf: tokenizers.Tokenizer | None = None
        self.add_bos_token: bool = (bos_token_id is not None
                                    and bos_token_id in hf.encode("", add_special_tokens=True).ids)
        """Whether ``encode(..., add_special_tokens=True)`` starts with BOS."""

    # ---- token strings ---------------------------------------------------------------

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.hf.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    # ---- encode / decode -------------------------------------------------------------

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens: added special tokens plus BOS/EOS/UNK/PAD."""
        return self._special

    @property
    def special_token_strings(self) -> list[str]:
        return [t for t in (self.hf.id_to_token(i) for i in self.all_special_ids) if t]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encoding(text, add_special_tokens).ids

    def encoding(self, text: str, add_special_tokens: bool = True, literal: bool = False) -> tokenizers.Encoding:
        """The ``tokenizers.Encoding`` (ids and character offsets). ``literal``: special-
        token text is tokenized as ordinary text instead of becoming control tokens."""
        hf = self._literal() if literal else self.hf
        if len(text) > _GIL_FREE_CHARS:
            return hf.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return hf.encode(text, add_special_tokens=add_special_tokens)

    def _literal(self) -> tokenizers.Tokenizer:
        # A copy rather than toggling ``encode_special_tokens`` on the shared one: a
        # server tokenizes from several threads at once.
        if self._literal_hf is None:
            literal = tokenizers.Tokenizer.from_str(self.hf.to_str())
            literal.encode_special_tokens = True
            self._literal_hf = literal
        return self._literal_hf

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    literal_content: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered with the chat template.

        ``literal_content`` (the default): special-token text typed into a message
        (``<|im_end|>``, ``</s>``) is tokenized as ordinary text, so content cannot
        forge a turn or an end of text; the template's own special tokens stay
        control tokens. False: the rendered string is tokenized as a whole, special
        tokens parsed everywhere (transformers' ``apply_chat_template(tokenize=True)``).
        """
        if not literal_content:
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            return self.encode(text, add_special_tokens=False)
        from trellm.tokenizer.chat_encoding import encode_chat

        return encode_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprob ``bytes``): a byte-level
        BPE piece through GPT-2's table, a SentencePiece ``<0xHH>`` byte as that byte;
        else the token's decoded text. A token holding part of a UTF-8 character thus
        gives its own bytes, not those of U+FFFD."""
        piece = self.hf.id_to_token(token_id)
        if piece is not None and token_id not in self._special:
            if isinstance(self.hf.decoder, decoders.ByteLevel) and set(piece) <= _BYTE_OF.keys():
                return bytes(_BYTE_OF[c] for c in piece)
            m = _SP_BYTE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if skip_special_tokens:
            # tokenizers skips only *added* special tokens; BOS/EOS that live in the
            # base vocabulary must go too.
            ids = [i for i in ids if i not in self._special]
        if len(ids) > _GIL_FREE_CHARS:  # as in ``encoding``: the batch call releases the GIL
            return self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.hf.id_to_token(ids)
        return [self.hf.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for ``messages`` (ValueError when there is no usable template)."""
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                     "unk_token": self._token(self.unk_token_id) or "",
                     "pad_token": self._token(self.pad_token_id) or "", **kwargs}
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **variables)

    # ---- constructors ----------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """A tokenizer from a Hugging Face directory, a tokenizer.json, or a GGUF file."""
        p = Path(path)
        if p.is_file() and _has_gguf_magic(p):
            return cls.from_gguf(p)
        return cls.from_hf_dir(p)

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF describes (a ``gguf.GGUFReader`` or a path)."""
        reader = _open_reader(reader_or_path)
        meta = _Meta(reader)
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{meta.source}: GGUF file has no tokenizer vocabulary")
        types = meta.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            hf = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [],
                                 meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            hf = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"),
                                    meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.unknown_token_id"),
                                    meta.get("tokenizer.ggml.add_space_prefix", True))
        else:
            raise ModelLoadError(f"{meta.source}: unsupported GGUF tokenizer model {kind!r} "
                                 f"(supported: gpt2 byte-level BPE, llama SentencePiece BPE)")
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id")
               for k in ("bos", "eos", "unknown", "padding")}
        _add_gguf_special_tokens(hf, tokens, types, byte_level=kind == "gpt2",
                                 named=[i for i in ids.values() if i is not None])
        # Older SentencePiece files lack the flag and llama.cpp then adds BOS.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        _set_post_processor(hf, _tok(tokens, ids["bos"]), ids["bos"], bool(add_bos),
                            _tok(tokens, ids["eos"]), ids["eos"],
                            bool(meta.get("tokenizer.ggml.add_eos_token", False)))
        return cls(hf, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                   unk_token_id=ids["unknown"], pad_token_id=ids["padding"],
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | Path, generation_config: dict | None = None) -> "Tokenizer":
        """A tokenizer from a directory (or a tokenizer.json with its sidecar files beside it)."""
        p = Path(path)
        tok_file, folder = (p, p.parent) if p.is_file() else (p / "tokenizer.json", p)
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises bare Exception on bad JSON
            raise ModelLoadError(f"{tok_file} is not a valid tokenizer.json: {first_line(e)}") from e
        cfg = _read_json(folder / "tokenizer_config.json") or {}
        if generation_config is None:
            generation_config = _read_json(folder / "generation_config.json") or {}
        names = {k: _token_content(cfg.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")}
        ids = {k: (hf.token_to_id(v) if v is not None else None) for k, v in names.items()}
        gen_eos = _as_id_list(generation_config.get("eos_token_id"))
        if ids["eos"] is None and gen_eos:
            ids["eos"] = gen_eos[0]
        if ids["bos"] is None:
            ids["bos"] = generation_config.get("bos_token_id")
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            # An explicit flag overrides tokenizer.json's post-processor, as in transformers.
            _set_post_processor(hf, names["bos"], ids["bos"], bool(cfg.get("add_bos_token")),
                                names["eos"], ids["eos"], bool(cfg.get("add_eos_token")))
        return cls(hf, bos_token_id=ids["bos"], eos_token_id=ids["eos"], unk_token_id=ids["unk"],
                   pad_token_id=ids["pad"], extra_eos_token_ids=gen_eos,
                   chat_template=_hf_chat_template(folder, cfg))


# ---- GGUF helpers ----------------------------------------------------------------------


class _Meta:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: Any):
        self.reader = reader
        self.source = str(getattr(reader, "path", "GGUF"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()


def _open_reader(reader_or_path: Any) -> Any:
    import gguf

    from trellm.loader.gguf_file import GGUFReaderView

    if isinstance(reader_or_path, (gguf.GGUFReader, GGUFReaderView)):
        return reader_or_path
    try:
        return GGUFReaderView(reader_or_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {reader_or_path}: {first_line(e)}") from e


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _tok(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF = {ch: b for b, ch in _bytes_to_unicode().items()}
"""GPT-2's printable character -> the byte it spells."""
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token with characters outside the byte alphabet is stored as raw text by
    # some converters; respell its UTF-8 bytes so BPE can reach it.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                       unk_id: int | None, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral v1) the way transformers' LlamaTokenizer builds it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None:
            raise ModelLoadError("GGUF SentencePiece tokenizer has neither merges nor scores")
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    hf = tokenizers.Tokenizer(models.BPE(vocab, pairs, unk_token=_tok(tokens, unk_id),
                                         fuse_unk=True, byte_fallback=True))
    # transformers ignores add_space_prefix; llama.cpp honours it, and so do we.
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    hf.decoder = decoders.Sequence(steps)
    return hf


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a scored vocabulary: every split of a token into two
    tokens, best token score first (transformers' ``generate_merges``)."""
    found = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        found.extend(local)
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _add_gguf_special_tokens(hf: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                             byte_level: bool, named: list[int]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED plain added tokens,
    so both are matched whole in text instead of being split by BPE."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    vocab = hf.get_vocab(with_added_tokens=False)
    control = {i for i, t in enumerate(types) if t == _CONTROL} | set(named)
    # In a byte-level vocabulary a "control" token spelled outside the byte alphabet
    # is a converter mislabel; adding it would grow the vocabulary past the model's.
    special = [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(control)
               if 0 <= i < len(tokens) and (alphabet is None or set(tokens[i]) <= alphabet)]
    user = [AddedToken(tokens[i], normalized=False, special=False)
            for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] in vocab]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)


def _set_post_processor(hf: tokenizers.Tokenizer, bos: str | None, bos_id: int | None, add_bos: bool,
                        eos: str | None, eos_id: int | None, add_eos: bool) -> None:
    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    hf.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# ---- Hugging Face helpers --------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, None when there is no such file (read_json_object's errors)."""
    return read_json_object(path) if path.is_file() else None


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _hf_chat_template(folder: Path, cfg: dict) -> str | None:
    """The template: chat_template.jinja, then chat_template.json, then tokenizer_config."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja} is not readable UTF-8 text: {first_line(e)}") from e
    side = _read_json(folder / "chat_template.json") or {}
    template = side.get("chat_template", cfg.get("chat_template"))
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
