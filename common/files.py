"""The cache folder and atomic file writes, shared by data loading, encoders and checkpoints."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from flt.common.errors import FltError


def cache_dir() -> Path:
    """The cache folder: ``$FLT_CACHE`` (when set and not empty) or ``~/.cache/flt``."""
    return Path(os.environ.get("FLT_CACHE") or Path.home() / ".cache" / "flt")


def make_folder(path: Path, what: str, mode: int = 0o777) -> Path:
    """mkdir -p for a folder the user names (`what`: the option or field that named it):
    a path that cannot be made (under a file, read-only, no permission) is the user's
    to fix, so it is one line naming the field, not a traceback."""
    if path.exists() and not path.is_dir():
        raise FltError(f"{what}: {path} is a file, not a folder")
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise FltError(f"{what}: cannot create the folder {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FltError(f"{what}: the folder {path} is not writable")
    return path


def save_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    """Write an uncompressed .npz under a temporary name, then rename into place.

    Uncompressed so a reload is a plain read (well under a second for CIFAR-10);
    the rename makes concurrent loaders see either nothing or a complete file.
    """
    # numpy's stubs type **arrays as if a key could be allow_pickle (a bool)
    write_atomic(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call write(file) on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
