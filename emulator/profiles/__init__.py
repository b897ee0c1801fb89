"""Device runtime profiles: per-client compute speed, bandwidth, latency, availability.

A :class:`Profiles` is a struct of arrays with one row per client.  It is pure data
plus vectorized queries (``online``, ``online_until``, ``take``); the emulator's round
loop turns it into task durations with :mod:`emulator.clock`.

One module per concept:

* :mod:`~emulator.profiles.windows`: availability windows and the :class:`Profiles`
  struct (units, normalization, the ``online`` queries);
* :mod:`~emulator.profiles.distributions`: seeded distributions and their spec's
  validation (``profiles_from_distribution``);
* :mod:`~emulator.profiles.trace`: our CSV/JSON trace format (``load_trace``);
* :mod:`~emulator.profiles.fedscale`: FedScale's device files (``import_fedscale``);
* :mod:`~emulator.profiles.units`: the error type, bit-rate units, the scalar check.
"""

from flt.emulator.profiles.distributions import DEFAULT_SPEC, profiles_from_distribution
from flt.emulator.profiles.fedscale import import_fedscale
from flt.emulator.profiles.trace import load_trace
from flt.emulator.profiles.units import KBPS_TO_BYTES, MBPS_TO_BYTES, ProfileError
from flt.emulator.profiles.windows import Profiles

__all__ = [
    "DEFAULT_SPEC",
    "KBPS_TO_BYTES",
    "MBPS_TO_BYTES",
    "ProfileError",
    "Profiles",
    "import_fedscale",
    "load_trace",
    "profiles_from_distribution",
]
