"""The run folder's `run.log`: what the server warned about, and when.

The terminal shows warnings as they come, and a long run's warnings (a device lost,
replies rejected, a deadline that kept nobody) scroll away or leave with the terminal.
`run.log` keeps every warning and error of the emulator's loggers, timestamped, beside the
results, with the run's permanent progress lines (method headers, the thinned round
lines, the table; never the bars) and a line for how the run (and each resume of it)
started and ended. A run killed outright (SIGKILL) leaves a `started` line with no end.
The data line a fresh run shows before its folder exists follows the `started` line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from flt.common.errors import FltError
from flt.common.interrupts import stopped
from flt.reports.terminal import Display, Progress

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextmanager
def run_log(path: Path, command: str, progress: Progress, *said: str) -> Iterator[Progress]:
    """Append the `flt` loggers' warnings and errors to `path` while the body runs, and
    the permanent lines of `progress` (not its bars): yields the progress to use. `said`:
    lines the run showed before its folder existed, kept after the `started:` line."""
    handler = logging.FileHandler(path, encoding="utf-8")  # appends: a resume goes on below
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = logging.getLogger("flt")
    logger.addHandler(handler)
    keep = partial(_line, handler)
    for text in (f"started: {command}", *said):
        _line(handler, text)
    if isinstance(progress, Display):
        progress.copies.append(keep)
    try:
        yield progress if isinstance(progress, Display) else _both(progress, keep)
    except BaseException as exc:
        _line(handler, f"stopped: {ending(exc)}")
        raise
    else:
        _line(handler, "finished")
    finally:
        if isinstance(progress, Display):
            progress.copies.remove(keep)
        logger.removeHandler(handler)
        handler.close()


def _both(progress: Progress, keep: Callable[[str], None]) -> Progress:
    def both(text: str) -> None:
        progress(text)
        keep(text)

    return both


def ending(exc: BaseException) -> str:
    """How a run that raised `exc` ended, in the words the terminal uses."""
    if isinstance(exc, KeyboardInterrupt):
        return stopped(exc)
    if isinstance(exc, FltError):
        return f"error: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _line(handler: logging.Handler, text: str) -> None:
    """A line of the run's own (its progress, its start and end), whatever the handler's
    level; a table starts on a line of its own, so that its columns line up."""
    msg = "\n" + text if "\n" in text else text
    record = {"name": "flt.run", "levelname": "INFO", "levelno": logging.INFO, "msg": msg}
    handler.handle(logging.makeLogRecord(record))
