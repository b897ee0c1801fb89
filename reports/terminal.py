"""Progress a person can read: one bar redrawn in place on a terminal, a plain line every
few steps elsewhere (CI logs, files), so a long run neither floods nor goes silent.

Anything that reports progress takes a `progress` callable (`print` by default). A
`Display` is such a callable that also draws bars; `step()` uses the bar when it is given
a Display and falls back to printing every `every`-th step (and the last) otherwise.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 20
Progress = Callable[[str], object]  # what takes progress lines: `print`, a Display, a list's append
_ACTIVE: Display | None = None  # the terminal's Display, for code that is not handed one


def active() -> Progress:
    """The Display the command line installed, else `print`."""
    return _ACTIVE or print


def end_line() -> str:
    """What a line printed after a stop must start with: nothing, or a newline on a terminal
    that may hold the shell's `^C` echo (a bar's line, with the echo, is erased instead)."""
    erased = _ACTIVE.done() if _ACTIVE else False
    return "\n" if sys.stderr.isatty() and not erased else ""


def every_for(n: int, lines: int = 10) -> int:
    """How often to print a plain line so that `n` steps give about `lines` lines."""
    return max(1, round(n / lines))


def bar(i: int, n: int, width: int = BAR_WIDTH) -> str:
    filled = round(width * i / n) if n else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def duration(seconds: float) -> str:
    """'45 s', '12 min', '3 h 05 min': how long, at a glance."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def step(
    progress: Progress, i: int, n: int, line: str, unit: str = "step", every: int | None = None, force: bool = False
) -> None:
    """Step `i` of `n` is done; `line` describes it. `force` prints it however often
    lines are thinned (e.g. a round with an arrival)."""
    if isinstance(progress, Display):
        progress.step(i, n, line, unit, every, force)
    elif force or i == n or i % (every or every_for(n)) == 0:
        progress(line)


class Display:
    """The terminal. Calling it prints a permanent line; `step` draws a bar for the step
    under way (on a terminal) or prints a plain line every few steps (anywhere else)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.status = ""  # the bar now on screen ("" = none)
        self._clock: dict[str, tuple[int, float]] = {}  # unit -> (first step, its start)
        self.copies: list[Callable[[str], object]] = []  # also given every permanent line (a run's log)

    def __call__(self, text: object) -> None:
        self._erase()
        self.stream.write(f"{text}\n")
        self._draw(self.status)
        for copy in self.copies:
            copy(str(text))

    def step(
        self, i: int, n: int, line: str, unit: str = "step", every: int | None = None, force: bool = False
    ) -> None:
        tail = self.tail(i, n, unit)
        if not self.tty:
            if force or i == n or i % (every or every_for(n)) == 0:
                self(self.decorate(line + tail, unit))
            return
        if i == n or force:  # what the step did stays on screen
            self._erase()
            self.status = ""
            self(self.decorate(line, unit))
        if i < n:  # the time left first: a narrow terminal cuts the line's end
            self.status = self.decorate(f"{bar(i, n)} {tail.strip() + ' | ' if tail else ''}{line.strip()}", unit)
            self._draw(self.status)

    def decorate(self, text: str, unit: str) -> str:
        """Hook: a suite adds where it stands to every progress line."""
        return text

    def tail(self, i: int, n: int, unit: str) -> str:
        """What follows a progress line: the time left for these steps (none after the last)."""
        left = self.time_left(i, n, unit)
        return "" if left is None or i == n else f"  ~{duration(left)} left"

    def time_left(self, i: int, n: int, unit: str) -> float | None:
        """Seconds left for the remaining steps at this run of steps' pace (a new run of
        steps starts when `i` goes back to 1, or to where a resumed run picks up)."""
        now = time.monotonic()
        first, start = self._clock.get(unit, (None, now))
        if first is None or i <= first:
            self._clock[unit] = (i, now)  # time starts at the first step's end
            return None
        return (now - start) / (i - first) * (n - i)

    def install(self) -> Display:
        """Make this the terminal for code that reports progress without being handed a
        callable (e.g. the encoder's pretraining inside a strategy)."""
        global _ACTIVE
        _ACTIVE = self
        return self

    def done(self) -> bool:
        """Leave the terminal clean (no bar left on the last line); True if a bar was erased."""
        erased = self.tty and bool(self.status)
        self._erase()
        self.status = ""
        return erased

    def _draw(self, text: str) -> None:
        if self.tty and text:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + text[:width] + "\x1b[K")  # never wrap: \r must reach its start
        self.stream.flush()

    def _erase(self) -> None:
        if self.tty and self.status:
            self.stream.write("\r\x1b[K")
