"""Ctrl-C held back while a message is half sent or half read.

ZeroMQ sends and reads a multipart message one frame per call, and Python raises
KeyboardInterrupt between any two calls. An interrupt there leaves the head of a message
on the socket; ZeroMQ then appends the next message sent (the shutdown a stopped run
sends its devices) to that head, and the device reads one malformed message and never
its shutdown. Blocking SIGINT with pthread_sigmask does not help in a process that has
other threads (ZeroMQ's I/O threads, torch's pool): the kernel hands the signal to one of
them and Python still raises it in the main thread. So the Python-level handler is
swapped for one that only records the signal, and the signal is raised again at the end
of the block.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block whole; a SIGINT that arrives inside it is delivered when it ends."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # only the main thread sets handlers; None: a handler Python did not install
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # to whatever handler was there: KeyboardInterrupt by default
