"""Import of FedScale's device files (``import_fedscale``).

``client_device_capacity``: pickle of ``{client_id: {'computation': ms per sample,
'communication': kbps}}``; the one bandwidth serves both directions; latency 0.
``client_behave_trace``: pickle of ``{client_id: {'active': [...], 'inactive': [...],
'finish_time': period, 'duration': ...}}``; the client is online from ``active[i]`` to
``inactive[i]`` and the pattern repeats every ``finish_time``.  Clients are re-indexed
``0..M-1`` in sorted key order of the capacity file.  Traces are matched by key when the
behaviour file has every capacity key, else cycled as FedScale does (client ``i`` takes
the ``i mod B``-th trace in sorted key order); a trace with no active span is a client
that is never online.  FedScale treats a window as closed at both ends, we as
``[active, inactive)``: they differ only at the boundary instants.  Both pickles are read with an unpickler
that refuses every global, so only plain dicts, lists, tuples, numbers and strings can
come out of them; anything else is a :class:`ProfileError` and nothing is executed.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
from pathlib import Path
from typing import NoReturn

import numpy as np

from flt.emulator.profiles.units import ProfileError
from flt.emulator.profiles.windows import Profiles


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global: only builtin containers/scalars come out."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"forbidden global {module}.{name}")


def _safe_unpickle(path):
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _NoGlobalsUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("forbidden global"):
            raise ProfileError(
                f"{path}: refused: the pickle references {str(exc)[len('forbidden ') :]}; "
                "only plain dicts, lists, numbers and strings are accepted"
            ) from None
        raise ProfileError(f"{path}: not a readable pickle: {exc}") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from None
    except Exception as exc:  # malformed data can raise many types inside pickle
        raise ProfileError(f"{path}: not a readable pickle: {type(exc).__name__}: {exc}") from None


def _sorted_keys(d, path):
    try:
        return sorted(d)
    except TypeError:
        raise ProfileError(f"{path}: client ids of mixed types cannot be ordered") from None


def _fs_number(value, where, *, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ProfileError(f"{where}: expected a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or not (v > 0 or (allow_zero and v == 0)):
        raise ProfileError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def import_fedscale(
    capacity_path: str | os.PathLike, behave_path: str | os.PathLike | None = None, *, kbit_bits: float = 1000.0
) -> Profiles:
    """Import FedScale's ``client_device_capacity`` (+ optional ``client_behave_trace``).

    ``kbit_bits``: bits in FedScale's kbit.  1000 (default) reads ``communication`` as
    SI kbps like our own format; FedScale's aggregator measures updates in
    ``bytes / 1024 * 8`` kbits, so pass 1024 to reproduce its times exactly.
    """
    if not (isinstance(kbit_bits, numbers.Real) and kbit_bits > 0):
        raise ValueError(f"kbit_bits must be > 0, got {kbit_bits!r}")
    cap = _safe_unpickle(capacity_path)
    if not isinstance(cap, dict) or not cap:
        raise ProfileError(f"{capacity_path}: expected a non-empty dict {{client_id: {{...}}}}")
    keys = _sorted_keys(cap, capacity_path)
    m = len(keys)
    ms = np.empty(m)
    bw = np.empty(m)
    for i, k in enumerate(keys):
        rec = cap[k]
        where = f"{capacity_path}: client {k!r}"
        if not isinstance(rec, dict):
            raise ProfileError(f"{where}: expected a dict with 'computation' and 'communication'")
        for field in ("computation", "communication"):
            if field not in rec:
                raise ProfileError(f"{where}: missing field {field!r}")
        ms[i] = _fs_number(rec["computation"], f"{where}, field 'computation'")
        bw[i] = _fs_number(rec["communication"], f"{where}, field 'communication'")
    bps = bw * (float(kbit_bits) / 8.0)
    lat = np.zeros(m)
    empty = np.zeros(0)
    if behave_path is None:
        return Profiles._from_flat(ms, bps, bps.copy(), lat, empty, empty, empty, np.zeros(m, bool), None)

    beh = _safe_unpickle(behave_path)
    if not isinstance(beh, dict) or not beh:
        raise ProfileError(f"{behave_path}: expected a non-empty dict {{client_id: {{...}}}}")
    bkeys = _sorted_keys(beh, behave_path)
    # FedScale cycles its traces over clients when they are not keyed by the same ids
    chosen = keys if all(k in beh for k in keys) else [bkeys[i % len(bkeys)] for i in range(m)]

    parsed = {}  # trace key -> (starts, ends, period); a trace may serve several clients
    for k in set(chosen):
        rec = beh[k]
        where = f"{behave_path}: client {k!r}"
        if not isinstance(rec, dict):
            raise ProfileError(f"{where}: expected a dict with 'active', 'inactive', 'finish_time'")
        for field in ("active", "inactive", "finish_time"):
            if field not in rec:
                raise ProfileError(f"{where}: missing field {field!r}")
        period = _fs_number(rec["finish_time"], f"{where}, field 'finish_time'")
        act, ina = rec["active"], rec["inactive"]
        for field, seq in (("active", act), ("inactive", ina)):
            if not isinstance(seq, (list, tuple)):
                raise ProfileError(f"{where}, field {field!r}: expected a list of times")
            for j, x in enumerate(seq):
                if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
                    raise ProfileError(f"{where}, field {field!r}[{j}]: expected a number, got {x!r}")
        if len(ina) == len(act) - 1:
            ina = [*ina, period]  # last active span runs to the end of the trace
        elif len(ina) != len(act):
            raise ProfileError(f"{where}: 'active' has {len(act)} entries but 'inactive' has {len(ina)}")
        a = np.asarray(act, dtype=np.float64)
        b = np.asarray(ina, dtype=np.float64)
        bad = b < a
        if bad.any():
            j = int(np.argmax(bad))
            raise ProfileError(f"{where}: window {j} goes inactive at {b[j]:g} before it becomes active at {a[j]:g}")
        parsed[k] = (a, b, period)

    counts = np.array([parsed[k][0].size for k in chosen], dtype=np.int64)
    s = np.concatenate([parsed[k][0] for k in chosen]) if m else empty
    e = np.concatenate([parsed[k][1] for k in chosen]) if m else empty
    owner = np.repeat(np.arange(m), counts)
    periods = np.array([parsed[k][2] for k in chosen])
    period = float(periods[0]) if np.all(periods == periods[0]) else periods
    # a trace with no active spans at all is a client that is never online
    try:
        return Profiles._from_flat(ms, bps, bps.copy(), lat, s, e, owner, np.ones(m, bool), period)
    except ProfileError as exc:
        raise ProfileError(f"{behave_path}: {exc}") from None
