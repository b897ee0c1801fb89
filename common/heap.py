"""Keep a long-lived process's memory to what it uses.

Triton: torch.func's first vmap imports torch._dynamo, which imports triton (about
70 MB of mapped library per process) only to learn whether it could compile kernels.
This project never compiles (no torch.compile), so `skip_triton` marks it absent.

The heap:

glibc raises its mmap threshold each time a large block is freed, so later batches and
model copies of up to 32 MB come from the heap, whose freed middle is never returned to
the system; each thread may also get an arena of its own (64 MB reserved). Over hundreds
of rounds a device process kept about 140 MB of such freed heap. A fixed threshold sends
large buffers to mmap, which gives them back when they are freed.

That costs a device's compute dearly: a buffer from mmap is fresh pages, faulted in 4 kB
at a time, and the LEAF CNN's SGD step frees and allocates a 26 MB weight gradient (and
its activations) every step. `working_heap` lifts the threshold to glibc's maximum
(32 MB) while an op computes, so those blocks are reused step after step, and trims the
heap when it ends (one client's LEAF CNN training: 1.37 s and 209,995 page faults before,
0.91 s and 44,546 after; benchmarks/bench_heap.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("flt.heap")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
WORKING_MMAP_THRESHOLD = 32 << 20  # glibc's largest (4 MiB * sizeof(long) on 64-bit)
WORKING_TRIM_THRESHOLD = 1 << 30

_libc: ctypes.CDLL | None = None
_limits: tuple[int, int] | None = None  # (mmap, trim) thresholds once limit_heap_retention applied them


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


def limit_heap_retention(mmap_threshold: int = 256 * 1024, trim_threshold: int = 1 << 20, arenas: int = 2) -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing changes)."""
    global _libc, _limits
    _libc = _load_libc()
    if _libc is None:
        return False
    ok = all(
        _libc.mallopt(p, v) == 1
        for p, v in ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold), (M_ARENA_MAX, arenas))
    )
    if not ok:
        log.debug("mallopt refused a setting; the heap keeps glibc's defaults")
    _limits = (mmap_threshold, trim_threshold) if ok else None
    return ok


@contextmanager
def working_heap() -> Iterator[None]:
    """Blocks up to 32 MB from the reusable heap while the body computes, then the limits
    of `limit_heap_retention` again and the freed heap handed back (see above). Does
    nothing in a process that did not apply those limits."""
    libc, limits = _libc, _limits
    if libc is None or limits is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, WORKING_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, WORKING_TRIM_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, limits[0])
        libc.mallopt(M_TRIM_THRESHOLD, limits[1])
        libc.malloc_trim(0)


def skip_triton() -> None:
    """Make `import triton` fail fast in this process (see above); call before torch._dynamo."""
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]
