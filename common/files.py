"""The cache folder, atomic file writes and run-folder locks, shared by data loading,
encoders, checkpoints and runs."""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

import numpy as np

from flt.common.errors import DeviceError, FltError, short

T = TypeVar("T")
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The cache folder: ``$FLT_CACHE`` (when set and not empty) or ``~/.cache/flt``."""
    return Path(os.environ.get("FLT_CACHE") or Path.home() / ".cache" / "flt")


def read_cache(path: Path, read: Callable[[Path], T]) -> T | None:
    """read(path) of a cache file, or None where it is missing or cannot be read.

    A cache only saves work: a file cut short, damaged or in another version's format is
    rebuilt by the caller (with a warning naming it), never a reason to stop a run.
    """
    if not path.is_file():
        return None
    try:
        return read(path)
    except Exception as exc:  # whatever the reader (NumPy, torch, json) raises on a bad file
        log.warning("cache file %s cannot be read (%s: %s); rebuilding it", path, type(exc).__name__, short(str(exc)))
        return None


def write_cache(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """write_atomic for a cache file; a cache folder that cannot be written (read-only,
    a file, a full disk) costs the next run the same work again, so it is a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, write)
    except OSError as exc:
        log.warning("cannot write the cache file %s (%s); going on without it", path, exc.strerror or exc)


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


def npz_writer(arrays: dict[str, np.ndarray]) -> Callable[[IO[bytes]], object]:
    """Writes `arrays` as an uncompressed .npz into a file: a reload is then a plain read
    (well under a second for CIFAR-10)."""
    # numpy's stubs type **arrays as if a key could be allow_pickle (a bool)
    return lambda f: np.savez(f, **arrays)  # type: ignore[arg-type]


def save_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    """Write an uncompressed .npz under a temporary name, then rename into place: the
    rename makes concurrent loaders see either nothing or a complete file."""
    write_atomic(path, npz_writer(arrays))


def write_atomic(path: Path, write: Callable[[IO[bytes]], object], first_wins: bool = False) -> None:
    """Call write(file) on a temporary file beside `path`, then rename it into place.

    `first_wins`: where a whole file already sits at `path` by then (another process wrote
    it meanwhile), keep that one. Processes that memory-map the file then all map one
    copy; a rename over it would leave the first process mapping a deleted file of its own.
    The folder must exist: a run folder deleted mid-run is never made again here.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
        except OSError as exc:  # a full disk: name the file meant, not a file object's None
            exc.filename = exc.filename or str(path)
            raise
        if not first_wins:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # never replaces: FileExistsError where a file is there
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: the last writer wins
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def append_line(path: Path, text: str) -> None:
    """Append `text` and a newline to the file, closed again at once. A file kept open
    would fail twice on a full disk: the flush, then its close on the way out, whose error
    names no file (a file object's never does)."""
    try:
        with open(path, "a") as f:
            f.write(text + "\n")
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise


LOCK_NAME = ".lock"  # in a run folder: held by the process writing into it


def require_run_folder(run_dir: Path) -> None:
    """Stop a run whose folder was deleted by hand mid-run: the next write would make it
    again (the method's folder, its artifacts) and fill it with the rest of a run whose
    first rounds are gone. The lock file, made when the run began, tells."""
    if not (run_dir / LOCK_NAME).is_file():
        raise folder_removed(run_dir)


def folder_removed(run_dir: Path | str) -> DeviceError:
    return DeviceError(f"the run folder {run_dir} was removed while the run wrote into it; run the command again")


@contextmanager
def folder_lock(folder: Path, what: str, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive lock on a run folder while the block runs. A second run, or a
    `--resume`, aimed at a folder a live run is writing would write over its config and
    partition and append to its metrics; it is refused instead, naming the folder and the
    process holding it (`what`: the option that named the folder). `check` runs once the
    lock is held and before this process's id is written into it, so a folder it refuses
    is left as it was. The kernel drops the lock when its holder exits, however it exits,
    so a killed run leaves none behind."""
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never write through a link
    except OSError as exc:
        raise FltError(f"{what}: cannot lock the folder {folder}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise FltError(
            f"{what}: {folder} is in use by another flt run"
            + (f" (process {holder})" if holder.isdigit() else "")
            + "; wait for it to end, or choose another folder"
        ) from None
    except OSError as exc:  # a file system without locks (some network mounts): run unguarded
        log.warning(
            "%s: cannot lock %s (%s); a second run there would not be refused", what, folder, exc.strerror or exc
        )
    try:
        check()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
