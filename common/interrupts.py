"""Ctrl-C (and SIGTERM) held back while a message is half sent or half read.

ZeroMQ sends and reads a multipart message one frame per call, and Python raises
KeyboardInterrupt between any two calls. An interrupt there leaves the head of a message
on the socket; ZeroMQ then appends the next message sent (the shutdown a stopped run
sends its devices) to that head, and the device reads one malformed message and never
its shutdown. Blocking SIGINT with pthread_sigmask does not help in a process that has
other threads (ZeroMQ's I/O threads, torch's pool): the kernel hands the signal to one of
them and Python still raises it in the main thread. So the Python-level handler is
swapped for one that only records the signal, and the signal is raised again at the end
of the block.

SIGTERM (`kill`, a batch scheduler's time limit) stops a run the way Ctrl-C does once
`stop_on_sigterm` is installed: it raises `Terminated`, a KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM: the run stops as on Ctrl-C (devices told to shut down, results kept)."""


def stopped(stop: KeyboardInterrupt) -> str:
    """How a stop is named on the terminal and in run.log."""
    return "terminated" if isinstance(stop, Terminated) else "interrupted"


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise Terminated()


def stop_on_sigterm() -> None:
    """SIGTERM raises Terminated in the main thread (the default ends the process at once:
    no shutdown for the devices, no last line). Install it after the device zygote is
    forked, so device processes keep the default."""
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block whole; a SIGINT or SIGTERM that arrives inside it is delivered when
    it ends."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield  # only the main thread sets handlers; None: a handler Python did not install
        return
    caught: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):  # each once, in arrival order
            signal.raise_signal(signum)  # to whatever handler was there: KeyboardInterrupt for SIGINT
