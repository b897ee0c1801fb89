"""Keep a long-lived process's memory to what it uses.

Triton: torch.func's first vmap imports torch._dynamo, which imports triton (about
70 MB of mapped library per process) only to learn whether it could compile kernels.
This project never compiles (no torch.compile), so `skip_triton` marks it absent.

The heap:

glibc raises its mmap threshold each time a large block is freed, so later batches and
model copies of up to 32 MB come from the heap, whose freed middle is never returned to
the system; each thread may also get an arena of its own (64 MB reserved). Over hundreds
of rounds a device process kept about 140 MB of such freed heap. A fixed threshold sends
large buffers to mmap, which gives them back when they are freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("flt.heap")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def limit_heap_retention(mmap_threshold: int = 256 * 1024, trim_threshold: int = 1 << 20, arenas: int = 2) -> bool:
    """Apply the settings above; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    ok = all(
        mallopt(p, v) == 1
        for p, v in ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold), (M_ARENA_MAX, arenas))
    )
    if not ok:
        log.debug("mallopt refused a setting; the heap keeps glibc's defaults")
    return ok


def skip_triton() -> None:
    """Make `import triton` fail fast in this process (see above); call before torch._dynamo."""
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]
