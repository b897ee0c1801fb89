"""The run folder's `run.log`: what the server warned about, and when.

The terminal shows warnings as they come, and a long run's warnings (a device lost,
replies rejected, a deadline that kept nobody) scroll away or leave with the terminal.
`run.log` keeps every warning and error of the emulator's loggers, timestamped, beside the
results, with a line for how the run (and each resume of it) started and ended. A run
killed outright (SIGKILL) leaves a `started` line with no end after it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flt.common.errors import FltError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextmanager
def run_log(path: Path, command: str) -> Iterator[None]:
    """Append the `flt` loggers' warnings and errors to `path` while the body runs."""
    handler = logging.FileHandler(path, encoding="utf-8")  # appends: a resume goes on below
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = logging.getLogger("flt")
    logger.addHandler(handler)
    _line(handler, f"started: {command}")
    try:
        yield
    except BaseException as exc:
        _line(handler, f"stopped: {ending(exc)}")
        raise
    else:
        _line(handler, "finished")
    finally:
        logger.removeHandler(handler)
        handler.close()


def ending(exc: BaseException) -> str:
    """How a run that raised `exc` ended, in the words the terminal uses."""
    if isinstance(exc, KeyboardInterrupt):
        from flt.common.interrupts import Terminated

        return "terminated" if isinstance(exc, Terminated) else "interrupted"
    if isinstance(exc, FltError):
        return f"error: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _line(handler: logging.Handler, text: str) -> None:
    """A line of the log's own, whatever the handler's level."""
    record = {"name": "flt.run", "levelname": "INFO", "levelno": logging.INFO, "msg": text}
    handler.handle(logging.makeLogRecord(record))
