"""What every profile source shares: the error type, bit-rate units and the scalar check.

Files speak in bits (``kbps`` is 1,000 bits/s, ``mbps`` 1,000,000 bits/s); a
:class:`~emulator.profiles.Profiles` holds bytes per second.
"""

from __future__ import annotations

import math
import numbers

from flt.common.errors import FltError, short

KBPS_TO_BYTES = 1000.0 / 8.0  # 1 kbit/s = 125 bytes/s
MBPS_TO_BYTES = 1e6 / 8.0


class ProfileError(FltError, ValueError):
    """A profile spec, trace file or profile array is invalid; the message says where."""


def check_number(
    value: object, where: str, *, positive: bool = True, allow_zero: bool = False, upper: float | None = None
) -> float:
    """`value` as a float if it is a finite real (not a bool) in range; else a ProfileError at `where`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ProfileError(f"{where}: expected a number, got {short(value)}")
    v = float(value)
    if not math.isfinite(v):
        raise ProfileError(f"{where}: expected a finite number, got {short(value)}")
    if positive and not (v > 0 or (allow_zero and v == 0)):
        raise ProfileError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {short(value)}")
    if upper is not None and v > upper:
        raise ProfileError(f"{where}: must be <= {upper}, got {short(value)}")
    return v
