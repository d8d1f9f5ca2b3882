"""What a model file gives the engine, whatever its format.

``open_checkpoint`` decides the format from the content (GGUF magic bytes, a
config.json in a directory), never from a file name alone, and returns a
``Checkpoint``: an HF-style config dict, a lazy iterator of HF-named tensors,
the tokenizer and the generation defaults.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from trellm.loader.errors import ModelLoadError, first_line

if TYPE_CHECKING:
    import torch

    from trellm.tokenizer.tokenizer import Tokenizer

DUMMY_PREFIX = "dummy:"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Checkpoint:
    """A model ready to be read: config now, tensors on demand."""

    hf_config: dict
    """Hugging Face config.json keys (architectures, hidden_size, ..., rope_scaling)."""
    tensors: Callable[[], Iterator[tuple[str, "torch.Tensor"]]]
    """Yields (HF parameter name, CPU tensor) once per call; e.g.
    ``model.layers.0.self_attn.q_proj.weight``. ``lm_head.weight`` only when untied."""
    tokenizer: "Tokenizer | None"
    """None when the checkpoint carries no tokenizer."""
    generation_config: dict = field(default_factory=dict)
    """generation_config.json keys (eos_token_id, temperature, ...); {} when absent."""
    source: str = ""
    """Where it came from, for messages."""
    dummy: bool = False
    """Config only: the model code makes random weights and ``tensors()`` raises."""
    tensor_types: dict[str, str] = field(default_factory=dict)
    """Storage type per HF tensor name as the file holds it (GGUF: 'Q4_1', 'F32', ...);
    {} for formats that do not record one."""


def open_checkpoint(model: str, load_workers: int = 4, keep_q4: bool = False) -> Checkpoint:
    """Open a GGUF file, an HF directory, or ``dummy:<config.json>``; '' = the default model.

    ``keep_q4`` (GGUF only): yield Q4_0/Q4_1 decoder-layer linear weights still
    quantized, as ``trellm.quant.gguf_int4.Q4Tensor``, instead of float32.

    Raises ``ModelLoadError`` with a one-line message for anything it cannot read.
    """
    if model == "":
        from trellm.default_model import default_model_path

        model = str(default_model_path())
    if model.startswith(DUMMY_PREFIX):
        return _open_dummy(Path(model[len(DUMMY_PREFIX):]).expanduser())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json "
                                 f"(not a Hugging Face model directory)")
        from trellm.loader.hf_loader import load_hf_dir

        return load_hf_dir(path, load_workers=load_workers)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path} is neither a file nor a directory")
    if _read_magic(path) != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes); pass a .gguf file, "
                             f"a Hugging Face directory or dummy:<config.json>")
    from trellm.loader.gguf_loader import load_gguf

    return load_gguf(path, keep_q4=keep_q4)


def _read_magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path`` or a one-line ModelLoadError."""
    if path.exists() and not path.is_file():
        # A FIFO or device would block or never end.
        raise ModelLoadError(f"{path} is not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    except RecursionError as e:
        raise ModelLoadError(f"{path} is not valid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise ModelLoadError(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def hf_dir_tokenizer(folder: Path, generation_config: dict) -> "Tokenizer | None":
    """The directory's tokenizer (None without tokenizer.json), or a one-line ModelLoadError."""
    from trellm.tokenizer.tokenizer import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_hf_dir(folder, generation_config)
    except ModelLoadError:
        raise
    except Exception as e:  # bad special-token ids / names in the tokenizer files
        raise ModelLoadError(f"{folder}: cannot build the tokenizer: {first_line(e)}") from e


def _open_dummy(config_path: Path) -> Checkpoint:
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"dummy model config {config_path} does not exist")
    config = read_json_object(config_path)
    folder = config_path.parent
    gen_path = folder / "generation_config.json"
    generation_config = read_json_object(gen_path) if gen_path.is_file() else {}
    tokenizer = hf_dir_tokenizer(folder, generation_config)

    def tensors() -> Iterator[tuple[str, "torch.Tensor"]]:
        raise ModelLoadError(f"dummy:{config_path} has no weights; the model makes random ones")

    return Checkpoint(hf_config=config, tensors=tensors, tokenizer=tokenizer,
                      generation_config=generation_config, source=f"dummy:{config_path}", dummy=True)
