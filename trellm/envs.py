"""The one place trellm reads environment variables.

Everything else asks these functions, so the full list of knobs is visible here
and tests can monkeypatch the environment without hunting for readers.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE_DIR = "~/.cache/trellm"
DEFAULT_LOG_LEVEL = "INFO"


def cache_dir() -> Path:
    """Where downloaded artifacts (the default model) live: ``TRELLM_CACHE_DIR``."""
    return Path(os.environ.get("TRELLM_CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()


def api_key() -> str | None:
    """Bearer token the server requires (``TRELLM_API_KEY``); None = no auth."""
    # An empty value means "unset": exporting TRELLM_API_KEY= must not lock
    # everyone out with an empty-string key.
    return os.environ.get("TRELLM_API_KEY") or None


def log_level() -> str:
    """Logging level name (``TRELLM_LOG_LEVEL``), upper-cased, default INFO."""
    return (os.environ.get("TRELLM_LOG_LEVEL") or DEFAULT_LOG_LEVEL).strip().upper()


def triton_interpret() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``):
    lets the kernel tests run without a GPU. Triton itself reads the same variable."""
    return os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0")


def pdl_mode() -> str:
    """Programmatic dependent launch (kernels/_triton.py; sm_90+ only): ``TRELLM_PDL`` unset
    (``auto``): on for the kernels checked with it on the GPU (the bf16 decode graph's, int8's);
    ``1``: on for every kernel that takes it (EXL3 too); ``0``: off."""
    raw = os.environ.get("TRELLM_PDL", "").strip().lower()
    for mode, words in (("auto", ("", "auto")), ("off", ("0", "off", "false", "no")),
                        ("all", ("1", "on", "true", "yes", "all"))):
        if raw in words:
            return mode
    raise ValueError(f"TRELLM_PDL={raw!r:.20}: use auto (the default), 1 / on (all kernels) or 0 / off")


def gemv_prefetch_blocks() -> int:
    """Weight blocks our skinny GEMM loads up front, before its PDL wait
    (kernels/gemv.py): ``TRELLM_GEMV_PREFETCH``, 0 (the default), 1, 2, 4 or 8 (a power of
    two: the kernel's up-front load is one power-of-two tile)."""
    raw = os.environ.get("TRELLM_GEMV_PREFETCH", "").strip() or "0"
    if raw not in ("0", "1", "2", "4", "8"):
        raise ValueError(f"TRELLM_GEMV_PREFETCH={raw!r:.20}: use 0, 1, 2, 4 or 8")
    return int(raw)


def gemv_norm() -> bool:
    """Whether the qkv and gate_up projections' GEMV may take the RMSNorm before them (and
    the residual add before that: kernels/gemv.py, ``gemv_rms_norm``; calibrated per shape
    like the GEMV itself): ``TRELLM_GEMV_NORM`` 1, or 0 (the default)."""
    raw = os.environ.get("TRELLM_GEMV_NORM", "").strip() or "0"
    if raw not in ("0", "1"):
        raise ValueError(f"TRELLM_GEMV_NORM={raw!r:.20}: use 0 or 1")
    return raw == "1"


def record_launches_path() -> str | None:
    """Tests under Triton's interpreter: the file every kernel launch is recorded in, for
    scripts/compile_check.py (``TRELLM_RECORD_LAUNCHES``); unset: none."""
    return os.environ.get("TRELLM_RECORD_LAUNCHES") or None


def pdl_trigger() -> str:
    """When a PDL kernel lets its successor launch (kernels/_triton.py): ``TRELLM_PDL_TRIGGER``
    ``late`` (the default: after its wait) or ``early`` (before it)."""
    raw = os.environ.get("TRELLM_PDL_TRIGGER", "").strip().lower() or "late"
    if raw not in ("late", "early"):
        raise ValueError(f"TRELLM_PDL_TRIGGER={raw!r:.20}: use late (the default) or early")
    return raw
