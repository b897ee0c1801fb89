"""Device runtime profiles: per-client compute speed, bandwidth, latency, availability.

A :class:`Profiles` is a struct of arrays with one row per client.  It is pure data
plus vectorized queries (``online``, ``online_until``, ``take``); the emulator's round
loop turns it into task durations with :mod:`emulator.clock`.

Units
-----
* ``ms_per_sample``: milliseconds of *inference* per sample, FedScale's
  ``computation``; training costs 3x that (forward + backward, see clock.py).
* ``up_bps`` / ``down_bps``: **bytes** per second.  Files speak in bits: ``kbps`` is
  1,000 bits/s (125 bytes/s), ``mbps`` is 1,000,000 bits/s.
* ``latency_s``: one-way latency added once per message.
* ``windows``: per client a float64 array ``[W, 2]`` of availability windows
  ``[start, end)`` in emulated seconds.  An empty array means *always online*.  A client
  whose only window is ``[0, 0)`` is *never online* (what a trace with only empty
  windows, e.g. ``0-0``, gives).
* ``period_s``: windows repeat with this period (86400 for a daily trace): the client is
  online at ``t`` when ``t mod period`` falls in a window.  ``None``: no repetition,
  windows are absolute and the client is offline after its last window.  It may also be
  a float64 array ``[M]`` of per-client periods (FedScale's traces carry one
  ``finish_time`` per client); ``inf`` entries mean no repetition for that client.

Windows are normalized on construction: sorted, overlapping or touching windows merged,
and with a period, folded into ``[0, period)`` (a window that runs past the period end
wraps to the start, one at least a period long makes the client always online).

Scenario spec (``profiles_from_distribution``)
----------------------------------------------
The device-profile section of a scenario YAML (the scenario schema picks the section's
name; errors are prefixed ``profiles.``).  Every key is optional; these are the
defaults, a realistic phone mix::

    compute: {dist: lognormal, median_ms_per_sample: 20.0, sigma: 0.5}
    #        or {dist: constant, ms_per_sample: 10}
    network:                       # a mix, one tier drawn per client; mbps = 1e6 bits/s
      - {share: 0.5, up_mbps: 5,  down_mbps: 20}
      - {share: 0.3, up_mbps: 1,  down_mbps: 5}
      - {share: 0.2, up_mbps: 20, down_mbps: 100}
    latency_ms: {dist: constant, value: 50}
    #        or {dist: lognormal, median_ms: 50, sigma: 0.5}
    availability: {dist: always}
    #        or {dist: windows, online_fraction: 0.7, period_s: 3600, windows_per_period: 2}

* A section given replaces that section's defaults; keys missing inside it take the
  defaults of its ``dist`` (``{dist: lognormal, sigma: 0.3}`` keeps median 20).
* ``lognormal`` draws ``median * exp(sigma * N(0, 1))`` (so the median is ``median``).
* ``network`` shares must be positive and sum to 1.
* ``availability: windows`` gives each client ``windows_per_period`` windows per period
  covering exactly ``online_fraction`` of it, with random (Dirichlet) lengths and gaps and
  a random phase; the windows repeat every ``period_s``.  ``online_fraction: 1`` is
  always online.
* Draw order (fixed, so a seed reproduces the same devices): compute, network, latency,
  availability.
* Unknown keys, wrong types and out-of-range values raise :class:`ProfileError` naming
  the key.

Trace files (``load_trace``)
----------------------------
CSV, one row per client, header (any column order)::

    # period_s: 86400          <- optional directive; other '#' lines are comments
    client,ms_per_sample,up_kbps,down_kbps,latency_ms,windows
    0,18.5,4000,20000,45,
    1,42.0,800,3000,120,0-3600;7200-9000

``client`` ids must be exactly ``0..M-1`` (any row order).  ``windows`` is a
``;``-separated list of ``start-end`` seconds (``end`` may be ``inf``); empty means
always online.  Without a ``period_s`` directive the windows do not repeat.

JSON::

    {"period_s": 86400,                      # or null / omitted: no repetition
     "clients": [{"client": 0, "ms_per_sample": 18.5, "up_kbps": 4000,
                  "down_kbps": 20000, "latency_ms": 45,
                  "windows": [[0, 3600], [7200, 9000]]}]}   # [] or omitted: always online

``ms_per_sample``, ``up_kbps``, ``down_kbps`` must be > 0, ``latency_ms`` >= 0.
The format is picked by the extension (``.csv`` / ``.json``), else by content.
Errors name the file, the line (CSV) or client, and the field.

FedScale (``import_fedscale``)
------------------------------
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

import csv
import io
import json
import math
import numbers
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scenarios.errors import FltError, short

__all__ = [
    "DEFAULT_SPEC",
    "ProfileError",
    "Profiles",
    "import_fedscale",
    "load_trace",
    "profiles_from_distribution",
]

KBPS_TO_BYTES = 1000.0 / 8.0  # 1 kbit/s = 125 bytes/s
MBPS_TO_BYTES = 1e6 / 8.0


class ProfileError(FltError, ValueError):
    """A profile spec, trace file or profile array is invalid; the message says where."""


# --------------------------------------------------------------------------------------
# Window normalization (vectorized over all windows of all clients)
# --------------------------------------------------------------------------------------


def _normalize_windows(s, e, owner, m, period, had_any):
    """Fold, sort and merge windows given flat (start, end, owner) arrays.

    Returns (starts, ends, offsets): CSR arrays, windows of client i are
    starts[offsets[i]:offsets[i+1]] (sorted, disjoint, not touching, inside
    [0, period] for periodic clients).  Always-online clients have no windows;
    never-online clients have the single window [0, 0).
    """
    s = np.asarray(s, dtype=np.float64)
    e = np.asarray(e, dtype=np.float64)
    owner = np.asarray(owner, dtype=np.int64)
    full = np.zeros(m, dtype=bool)  # periodic clients covered all period long

    bad = np.isnan(s) | np.isnan(e) | ~np.isfinite(s)
    if bad.any():
        c = int(owner[np.argmax(bad)])
        raise ProfileError(f"client {c}: window start must be a finite number and end a number")
    bad = e < s
    if bad.any():
        i = int(np.argmax(bad))
        raise ProfileError(
            f"client {int(owner[i])}: window [{s[i]:g}, {e[i]:g}) ends before it starts"
        )

    p = period[owner]
    periodic = np.isfinite(p)
    if periodic.any():
        length = e - s
        covers = periodic & (length >= p)
        full[owner[covers]] = True
        fold = periodic & ~covers
        s2 = np.where(fold, np.mod(s, np.where(fold, p, 1.0)), s)
        e2 = np.where(fold, s2 + length, e)
        over = fold & (e2 > p)
        # split windows that run past the period end into [s2, P) and [0, e2 - P)
        s = np.concatenate([s2, np.zeros(int(over.sum()))])
        e = np.concatenate([np.where(over, p, e2), (e2 - p)[over]])
        owner = np.concatenate([owner, owner[over]])

    keep = (e > s) & ~full[owner]
    s, e, owner = s[keep], e[keep], owner[keep]

    if s.size:
        order = np.lexsort((s, owner))
        s, e, owner = s[order], e[order], owner[order]
        # grouped running max of `e` via integer keys (exact; owners are sorted so the
        # running max never leaks across clients)
        uniq, inv = np.unique(e, return_inverse=True)
        key = owner * np.int64(len(uniq)) + inv
        run = np.maximum.accumulate(key)
        run_e = uniq[run - owner * np.int64(len(uniq))]
        first = np.ones(s.size, dtype=bool)
        first[1:] = owner[1:] != owner[:-1]
        prev_e = np.empty_like(run_e)
        prev_e[0] = -np.inf
        prev_e[1:] = run_e[:-1]
        new_block = first | (s > prev_e)
        idx = np.flatnonzero(new_block)
        s = s[idx]
        e = np.maximum.reduceat(e, idx)
        owner = owner[idx]

        # periodic clients whose merged windows cover [0, P] entirely: always online
        pe = period[owner]
        cover = np.isfinite(pe) & (s <= 0) & (e >= pe)
        if cover.any():
            full[owner[cover]] = True
            keep = ~full[owner]
            s, e, owner = s[keep], e[keep], owner[keep]

    counts = np.bincount(owner, minlength=m)
    never = had_any & ~full & (counts == 0)
    if never.any():
        nv = np.flatnonzero(never)
        s = np.concatenate([s, np.zeros(nv.size)])
        e = np.concatenate([e, np.zeros(nv.size)])
        owner = np.concatenate([owner, nv])
        order = np.lexsort((s, owner))
        s, e, owner = s[order], e[order], owner[order]
        counts = np.bincount(owner, minlength=m)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return s, e, offsets


def _gather_index(offsets, clients):
    """Flat window indices of `clients` (CSR gather) and the local owner of each."""
    lens = offsets[clients + 1] - offsets[clients]
    total = int(lens.sum())
    local = np.repeat(np.arange(clients.size), lens)
    if total == 0:
        return np.zeros(0, dtype=np.int64), local, lens
    before = np.cumsum(lens) - lens
    idx = np.repeat(offsets[clients] - before, lens) + np.arange(total)
    return idx, local, lens


def _check_values(name, a, m, *, allow_zero=False, allow_inf=False):
    a = np.array(a, dtype=np.float64, copy=True) if np.ndim(a) == 1 else None
    if a is None or a.shape != (m,):
        raise ProfileError(f"Profiles.{name}: expected a 1-D array of {m} values")
    ok = ~np.isnan(a) & ((a >= 0) if allow_zero else (a > 0))
    if not allow_inf:
        ok &= np.isfinite(a)
    if not ok.all():
        c = int(np.argmin(ok))
        req = ">= 0" if allow_zero else "> 0"
        raise ProfileError(f"Profiles.{name}: client {c}: value {a[c]!r} must be {req} and finite")
    return a


def _period_array(period_s, m):
    """(public value, per-client float64 array with inf = no repetition)."""
    if period_s is None:
        return None, np.full(m, np.inf)
    if np.ndim(period_s) == 0:
        try:
            p = float(period_s)
        except (TypeError, ValueError):
            raise ProfileError(f"Profiles.period_s: expected a number or None, got {period_s!r}") from None
        if not (p > 0 and math.isfinite(p)):
            raise ProfileError(f"Profiles.period_s: must be > 0 and finite, got {period_s!r}")
        return p, np.full(m, p)
    arr = np.array(period_s, dtype=np.float64).reshape(-1)
    if arr.shape != (m,):
        raise ProfileError(f"Profiles.period_s: per-client periods need {m} values, got {arr.size}")
    bad = np.isnan(arr) | (arr <= 0)
    if bad.any():
        c = int(np.argmax(bad))
        raise ProfileError(f"Profiles.period_s: client {c}: period {arr[c]!r} must be > 0")
    arr.setflags(write=False)
    return arr, arr.copy()


# --------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------


@dataclass(eq=False, repr=False)
class Profiles:
    """Struct of arrays, one row per client (see the module docstring for units)."""

    ms_per_sample: np.ndarray
    up_bps: np.ndarray
    down_bps: np.ndarray
    latency_s: np.ndarray
    windows: list
    period_s: float | np.ndarray | None = None

    def __post_init__(self):
        m = int(np.size(self.ms_per_sample))
        arrays = self._checked_arrays(
            self.ms_per_sample, self.up_bps, self.down_bps, self.latency_s, m
        )
        if not isinstance(self.windows, (list, tuple)) or len(self.windows) != m:
            raise ProfileError(f"Profiles.windows: expected a list of {m} arrays (one per client)")
        flat, counts = [], np.zeros(m, dtype=np.int64)
        for c, w in enumerate(self.windows):  # building: one conversion per client
            if w is None:
                continue
            a = np.asarray(w, dtype=np.float64)
            if a.size == 0:
                continue
            if a.ndim != 2 or a.shape[1] != 2:
                raise ProfileError(
                    f"Profiles.windows: client {c}: expected an array of [start, end) pairs, "
                    f"got shape {a.shape}"
                )
            flat.append(a)
            counts[c] = a.shape[0]
        allw = np.concatenate(flat) if flat else np.zeros((0, 2))
        owner = np.repeat(np.arange(m), counts)
        self._build(arrays, allw[:, 0], allw[:, 1], owner, counts > 0, self.period_s)

    # -- construction helpers ----------------------------------------------------------

    @staticmethod
    def _checked_arrays(ms, up, down, lat, m):
        return (
            _check_values("ms_per_sample", ms, m),
            _check_values("up_bps", up, m, allow_inf=True),
            _check_values("down_bps", down, m, allow_inf=True),
            _check_values("latency_s", lat, m, allow_zero=True),
        )

    def _build(self, arrays, s, e, owner, had_any, period_s):
        m = arrays[0].size
        public_period, per = _period_array(period_s, m)
        starts, ends, offsets = _normalize_windows(s, e, owner, m, per, had_any)
        self._assemble(arrays, starts, ends, offsets, public_period, per)

    def _assemble(self, arrays, starts, ends, offsets, public_period, per):
        for a in arrays:
            a.setflags(write=False)
        self.ms_per_sample, self.up_bps, self.down_bps, self.latency_s = arrays
        self.period_s = public_period
        pairs = np.stack([starts, ends], axis=1) if starts.size else np.zeros((0, 2))
        pairs.setflags(write=False)
        self.windows = np.split(pairs, offsets[1:-1]) if offsets.size > 1 else []
        self._starts = pairs[:, 0]
        self._ends = pairs[:, 1]
        self._offsets = offsets
        self._period = per

    @classmethod
    def _from_flat(cls, ms, up, down, lat, s, e, owner, had_any, period_s):
        obj = cls.__new__(cls)
        m = int(np.size(ms))
        obj._build(cls._checked_arrays(ms, up, down, lat, m), s, e, owner, had_any, period_s)
        return obj

    # -- queries -----------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.ms_per_sample.size)

    def __repr__(self) -> str:
        n_win = int(self._offsets[-1])
        always = int(np.sum(np.diff(self._offsets) == 0))
        per = "per-client" if isinstance(self.period_s, np.ndarray) else self.period_s
        return f"Profiles(M={len(self)}, windows={n_win}, always_online={always}, period_s={per})"

    def _clients(self, clients) -> np.ndarray:
        c = np.asarray(clients)
        if c.dtype == bool:
            raise TypeError("clients must be integer ids, not a boolean mask")
        c = c.astype(np.int64, copy=False).reshape(-1)
        if c.size and (c.min() < 0 or c.max() >= len(self)):
            raise IndexError(f"client id out of range 0..{len(self) - 1}")
        return c

    def _locate(self, clients, t):
        """Shared core of online/online_until: which window (if any) holds t."""
        c = self._clients(clients)
        t = np.broadcast_to(np.asarray(t, dtype=np.float64), c.shape)
        per = self._period[c]
        periodic = np.isfinite(per)
        tt = np.where(periodic, np.mod(t, np.where(periodic, per, 1.0)), t)
        idx, local, lens = _gather_index(self._offsets, c)
        inside = (self._starts[idx] <= tt[local]) & (tt[local] < self._ends[idx])
        return c, t, tt, per, periodic, idx[inside], local[inside], lens

    def online(self, clients, t) -> np.ndarray:
        """Boolean [len(clients)]: is each client online at emulated time t?"""
        _, _, _, _, _, _, where, lens = self._locate(clients, t)
        on = lens == 0
        on[where] = True
        return on

    def online_until(self, clients, t) -> np.ndarray:
        """End of the window each client is in at t (absolute seconds).

        ``inf`` for always-online clients, ``t`` itself for a client offline at t.
        A window ending at the period end continues into a window starting at 0.
        """
        c, t, tt, per, periodic, win, where, lens = self._locate(clients, t)
        until = np.where(lens == 0, np.inf, t)
        end = self._ends[win]
        base = (t - tt)[where]
        ex = end.copy()
        wrap = periodic[where] & (end >= per[where])
        if wrap.any():
            first = self._offsets[c[where[wrap]]]
            starts0 = self._starts[first] <= 0
            ex[np.flatnonzero(wrap)[starts0]] += self._ends[first[starts0]]
        u = base + ex
        # base + ex can round down by an ulp and land back inside the window; nudge it so
        # that the client is offline exactly at the returned time
        fix = np.flatnonzero(periodic[where])
        for _ in range(4):
            if not fix.size:
                break
            still = self.online(c[where[fix]], u[fix])
            fix = fix[still]
            u[fix] = np.nextafter(u[fix], np.inf)
        until[where] = u
        return until

    def take(self, clients) -> Profiles:
        """Subset (or repeat: ``p.take(np.arange(n) % len(p))``) in the given order."""
        c = self._clients(clients)
        idx, _, lens = _gather_index(self._offsets, c)
        offsets = np.zeros(c.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        obj = type(self).__new__(type(self))
        if self.period_s is None or np.ndim(self.period_s) == 0:
            public_period = self.period_s
        else:
            public_period = self._period[c]
            public_period.setflags(write=False)
        obj._assemble(
            (self.ms_per_sample[c], self.up_bps[c], self.down_bps[c], self.latency_s[c]),
            self._starts[idx],
            self._ends[idx],
            offsets,
            public_period,
            self._period[c],
        )
        return obj

    @property
    def always_online(self) -> np.ndarray:
        """Boolean [M]: clients with no availability windows."""
        return np.diff(self._offsets) == 0


# --------------------------------------------------------------------------------------
# Seeded distributions
# --------------------------------------------------------------------------------------

DEFAULT_SPEC = {
    "compute": {"dist": "lognormal", "median_ms_per_sample": 20.0, "sigma": 0.5},
    "network": [
        {"share": 0.5, "up_mbps": 5.0, "down_mbps": 20.0},
        {"share": 0.3, "up_mbps": 1.0, "down_mbps": 5.0},
        {"share": 0.2, "up_mbps": 20.0, "down_mbps": 100.0},
    ],
    "latency_ms": {"dist": "constant", "value": 50.0},
    "availability": {"dist": "always"},
}

_DIST_DEFAULTS = {
    "compute": {
        "lognormal": {"median_ms_per_sample": 20.0, "sigma": 0.5},
        "constant": {"ms_per_sample": 20.0},
    },
    "latency_ms": {
        "lognormal": {"median_ms": 50.0, "sigma": 0.5},
        "constant": {"value": 50.0},
    },
    "availability": {
        "always": {},
        "windows": {"online_fraction": 0.7, "period_s": 3600.0, "windows_per_period": 2},
    },
}


def _number(value, where, *, positive=True, allow_zero=False, upper=None):
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


def _section(spec, name):
    """Merge a section over its dist's defaults, rejecting unknown keys."""
    sec = spec.get(name, DEFAULT_SPEC[name])
    if sec is None:
        sec = DEFAULT_SPEC[name]
    if not isinstance(sec, dict):
        raise ProfileError(f"profiles.{name}: expected a mapping, got {type(sec).__name__}")
    dists = _DIST_DEFAULTS[name]
    dist = sec.get("dist", DEFAULT_SPEC[name]["dist"])
    if not isinstance(dist, str) or dist not in dists:
        raise ProfileError(
            f"profiles.{name}.dist: unknown distribution {short(dist)} (expected one of {sorted(dists)})"
        )
    allowed = set(dists[dist]) | {"dist"}
    for k in sec:
        if k not in allowed:
            raise ProfileError(
                f"profiles.{name}.{k}: unknown key for dist {dist!r} (allowed: {sorted(allowed)})"
            )
    merged = dict(dists[dist])
    merged.update({k: v for k, v in sec.items() if k != "dist"})
    return dist, merged


def _draw_positive(dist, sec, name, median_key, const_key, n, rng):
    if dist == "constant":
        v = _number(sec[const_key], f"profiles.{name}.{const_key}", allow_zero=(name == "latency_ms"))
        return np.full(n, v)
    med = _number(sec[median_key], f"profiles.{name}.{median_key}")
    sigma = _number(sec["sigma"], f"profiles.{name}.sigma", allow_zero=True)
    return med * np.exp(sigma * rng.standard_normal(n))


def profiles_from_distribution(n: int, spec: dict | None, rng: np.random.Generator) -> Profiles:
    """Draw `n` client profiles from a scenario's device-profile spec (module docstring)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ProfileError(f"profiles: number of clients must be an integer >= 0, got {n!r}")
    n = int(n)
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        raise ProfileError(f"profiles: expected a mapping, got {type(spec).__name__}")
    for k in spec:
        if k not in DEFAULT_SPEC:
            raise ProfileError(f"profiles.{k}: unknown key (allowed: {sorted(DEFAULT_SPEC)})")
    if not isinstance(rng, np.random.Generator):
        raise TypeError("rng must be a numpy.random.Generator")

    # compute
    dist, sec = _section(spec, "compute")
    ms = _draw_positive(dist, sec, "compute", "median_ms_per_sample", "ms_per_sample", n, rng)

    # network mix
    tiers = spec.get("network", DEFAULT_SPEC["network"])
    if tiers is None:
        tiers = DEFAULT_SPEC["network"]
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise ProfileError("profiles.network: expected a non-empty list of tiers")
    shares, ups, downs = [], [], []
    for i, tier in enumerate(tiers):
        where = f"profiles.network[{i}]"
        if not isinstance(tier, dict):
            raise ProfileError(f"{where}: expected a mapping, got {type(tier).__name__}")
        for k in tier:
            if k not in ("share", "up_mbps", "down_mbps"):
                raise ProfileError(f"{where}.{k}: unknown key (allowed: share, up_mbps, down_mbps)")
        for k in ("up_mbps", "down_mbps"):
            if k not in tier:
                raise ProfileError(f"{where}.{k}: missing")
        shares.append(_number(tier.get("share", 1.0), f"{where}.share"))
        ups.append(_number(tier["up_mbps"], f"{where}.up_mbps"))
        downs.append(_number(tier["down_mbps"], f"{where}.down_mbps"))
    shares = np.asarray(shares)
    if abs(shares.sum() - 1.0) > 1e-6:
        raise ProfileError(f"profiles.network.share: shares sum to {shares.sum():g}, expected 1")
    tier_of = rng.choice(len(shares), size=n, p=shares / shares.sum())
    up = np.asarray(ups)[tier_of] * MBPS_TO_BYTES
    down = np.asarray(downs)[tier_of] * MBPS_TO_BYTES

    # latency
    dist, sec = _section(spec, "latency_ms")
    lat = _draw_positive(dist, sec, "latency_ms", "median_ms", "value", n, rng) / 1000.0

    # availability
    dist, sec = _section(spec, "availability")
    empty = np.zeros(0)
    if dist == "always":
        return Profiles._from_flat(ms, up, down, lat, empty, empty, empty, np.zeros(n, bool), None)
    frac = _number(sec["online_fraction"], "profiles.availability.online_fraction", upper=1.0)
    period = _number(sec["period_s"], "profiles.availability.period_s")
    wpp = sec["windows_per_period"]
    if isinstance(wpp, bool) or not isinstance(wpp, numbers.Integral) or wpp < 1:
        raise ProfileError(
            f"profiles.availability.windows_per_period: expected an integer >= 1, got {short(wpp)}"
        )
    wpp = int(wpp)
    if frac >= 1.0:
        return Profiles._from_flat(ms, up, down, lat, empty, empty, empty, np.zeros(n, bool), period)
    alpha = np.ones(wpp)
    on = frac * period * rng.dirichlet(alpha, size=n)  # [n, W] window lengths
    off = (1.0 - frac) * period * rng.dirichlet(alpha, size=n)  # [n, W] gaps after each
    phase = rng.uniform(0.0, period, size=n)
    step = on + off
    starts = phase[:, None] + np.cumsum(step, axis=1) - step
    ends = starts + on
    owner = np.repeat(np.arange(n), wpp)
    return Profiles._from_flat(
        ms, up, down, lat, starts.reshape(-1), ends.reshape(-1), owner, np.ones(n, bool), period
    )


# --------------------------------------------------------------------------------------
# Our trace format
# --------------------------------------------------------------------------------------

_COLUMNS = ("client", "ms_per_sample", "up_kbps", "down_kbps", "latency_ms", "windows")
_NUM = r"(?:[+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|inf)"
_WINDOW_RE = re.compile(rf"^\s*({_NUM})\s*-\s*({_NUM})\s*$")
_PERIOD_RE = re.compile(r"^#\s*period_s\s*[:=]\s*(\S+)\s*$")


def _field_value(raw, where, *, allow_zero=False):
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: expected a number, got {raw!r}") from None
    if not math.isfinite(v) or not (v > 0 or (allow_zero and v == 0)):
        raise ProfileError(f"{where}: must be {'>= 0' if allow_zero else '> 0'} and finite, got {raw!r}")
    return v


def _client_id(raw, where):
    if isinstance(raw, bool):
        raise ProfileError(f"{where}: expected an integer client id, got {raw!r}")
    if isinstance(raw, numbers.Integral):
        v = int(raw)
    else:
        try:
            v = int(str(raw).strip())
        except ValueError:
            raise ProfileError(f"{where}: expected an integer client id, got {raw!r}") from None
    if v < 0:
        raise ProfileError(f"{where}: client id must be >= 0, got {raw!r}")
    return v


def _check_window(a, b, where):
    if math.isnan(a) or math.isnan(b) or not math.isfinite(a) or a < 0:
        raise ProfileError(f"{where}: window start must be a finite number >= 0, got {a!r}")
    if b < a:
        raise ProfileError(f"{where}: window end {b:g} is before its start {a:g}")


def _parse_period(raw, where):
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", "")):
        return None
    v = raw
    if isinstance(raw, str):
        try:
            v = float(raw)
        except ValueError:
            raise ProfileError(f"{where}: expected a number or null, got {raw!r}") from None
    return _number(v, where)


def _assemble_rows(path, rows, period):
    """rows: list of (client_id, where, ms, up_kbps, down_kbps, lat_ms, [(a, b), ...])."""
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    m = len(rows)
    seen = {}
    for r in rows:
        if r[0] in seen:
            raise ProfileError(f"{r[1]}: duplicate client id {r[0]} (first at {seen[r[0]]})")
        seen[r[0]] = r[1]
    if m and (ids.max() >= m):
        missing = sorted(set(range(m)) - set(seen))
        raise ProfileError(
            f"{path}: client ids must be exactly 0..{m - 1}; missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}"
        )
    order = np.argsort(ids)
    rows = [rows[i] for i in order]
    ms = np.array([r[2] for r in rows], dtype=np.float64)
    up = np.array([r[3] for r in rows], dtype=np.float64) * KBPS_TO_BYTES
    down = np.array([r[4] for r in rows], dtype=np.float64) * KBPS_TO_BYTES
    lat = np.array([r[5] for r in rows], dtype=np.float64) / 1000.0
    counts = np.array([len(r[6]) for r in rows], dtype=np.int64)
    pairs = np.array([w for r in rows for w in r[6]], dtype=np.float64).reshape(-1, 2)
    owner = np.repeat(np.arange(m), counts)
    try:
        return Profiles._from_flat(ms, up, down, lat, pairs[:, 0], pairs[:, 1], owner, counts > 0, period)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


def _load_csv(path, text):
    period = None
    header = None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            mt = _PERIOD_RE.match(stripped)
            if mt:
                period = _parse_period(mt.group(1), f"{path} line {lineno}: period_s")
            continue
        fields = [f.strip() for f in next(csv.reader(io.StringIO(line)))]
        if header is None:
            header = fields
            for col in header:
                if col not in _COLUMNS:
                    raise ProfileError(
                        f"{path} line {lineno}: unknown column {col!r} (expected {', '.join(_COLUMNS)})"
                    )
            for col in _COLUMNS:
                if col not in header:
                    raise ProfileError(f"{path} line {lineno}: missing column {col!r}")
            if len(set(header)) != len(header):
                raise ProfileError(f"{path} line {lineno}: duplicate column in header")
            continue
        if len(fields) == len(header) - 1 and header[-1] == "windows":
            fields.append("")  # trailing empty windows without the comma
        if len(fields) != len(header):
            raise ProfileError(
                f"{path} line {lineno}: expected {len(header)} fields, got {len(fields)}"
            )
        rec = dict(zip(header, fields, strict=True))
        where = f"{path} line {lineno}"
        cid = _client_id(rec["client"], f"{where}, field 'client'")
        where = f"{path} line {lineno} (client {cid})"
        ms = _field_value(rec["ms_per_sample"], f"{where}, field 'ms_per_sample'")
        up = _field_value(rec["up_kbps"], f"{where}, field 'up_kbps'")
        down = _field_value(rec["down_kbps"], f"{where}, field 'down_kbps'")
        lat = _field_value(rec["latency_ms"], f"{where}, field 'latency_ms'", allow_zero=True)
        wins = []
        for part in rec["windows"].split(";"):
            if not part.strip():
                continue
            mt = _WINDOW_RE.match(part)
            if not mt:
                raise ProfileError(
                    f"{where}, field 'windows': bad window {part.strip()!r} (expected start-end seconds)"
                )
            a, b = float(mt.group(1)), float(mt.group(2))
            _check_window(a, b, f"{where}, field 'windows'")
            wins.append((a, b))
        rows.append((cid, where, ms, up, down, lat, wins))
    if header is None:
        raise ProfileError(f"{path}: no header line (expected {','.join(_COLUMNS)})")
    return _assemble_rows(path, rows, period)


def _json_number(rec: dict, key: str, where: str, allow_zero: bool = False) -> float:
    """Field `key` of a JSON client record, checked to be a real number (JSON true is not 1)."""
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ProfileError(f"{where}, field {key!r}: expected a number, got {v!r}")
    return _field_value(v, f"{where}, field {key!r}", allow_zero=allow_zero)


def _load_json(path, text):
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: expected an object with 'clients' (and 'period_s')")
    for k in doc:
        if k not in ("period_s", "clients"):
            raise ProfileError(f"{path}: unknown key {k!r} (allowed: period_s, clients)")
    period = _parse_period(doc.get("period_s"), f"{path}: period_s")
    clients = doc.get("clients")
    if not isinstance(clients, list):
        raise ProfileError(f"{path}: 'clients' must be a list")
    rows = []
    required = _COLUMNS[:-1]
    for i, rec in enumerate(clients):
        where = f"{path}: clients[{i}]"
        if not isinstance(rec, dict):
            raise ProfileError(f"{where}: expected an object")
        for k in rec:
            if k not in _COLUMNS:
                raise ProfileError(f"{where}: unknown field {k!r} (allowed: {', '.join(_COLUMNS)})")
        for k in required:
            if k not in rec:
                raise ProfileError(f"{where}: missing field {k!r}")
        cid = _client_id(rec["client"], f"{where}, field 'client'")
        where = f"{path}: clients[{i}] (client {cid})"
        ms, up, down = (_json_number(rec, k, where) for k in ("ms_per_sample", "up_kbps", "down_kbps"))
        lat = _json_number(rec, "latency_ms", where, allow_zero=True)
        raw_w = rec.get("windows") or []
        if not isinstance(raw_w, list):
            raise ProfileError(f"{where}, field 'windows': expected a list of [start, end] pairs")
        wins = []
        for j, pair in enumerate(raw_w):
            if (
                not isinstance(pair, (list, tuple))
                or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, numbers.Real) for x in pair)
            ):
                raise ProfileError(f"{where}, field 'windows'[{j}]: expected [start, end], got {pair!r}")
            a, b = float(pair[0]), float(pair[1])
            _check_window(a, b, f"{where}, field 'windows'[{j}]")
            wins.append((a, b))
        rows.append((cid, where, ms, up, down, lat, wins))
    return _assemble_rows(path, rows, period)


def load_trace(path) -> Profiles:
    """Read a device trace in our CSV or JSON format (module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read trace: {exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix != ".csv" and text.lstrip().startswith("{")):
        return _load_json(path, text)
    return _load_csv(path, text)


# --------------------------------------------------------------------------------------
# FedScale import
# --------------------------------------------------------------------------------------


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global: only builtin containers/scalars come out."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"forbidden global {module}.{name}")


def _safe_unpickle(path):
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _NoGlobalsUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("forbidden global"):
            raise ProfileError(
                f"{path}: refused: the pickle references {str(exc)[len('forbidden '):]}; "
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


def import_fedscale(capacity_path, behave_path=None, *, kbit_bits: float = 1000.0) -> Profiles:
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
            raise ProfileError(
                f"{where}: 'active' has {len(act)} entries but 'inactive' has {len(ina)}"
            )
        a = np.asarray(act, dtype=np.float64)
        b = np.asarray(ina, dtype=np.float64)
        bad = b < a
        if bad.any():
            j = int(np.argmax(bad))
            raise ProfileError(
                f"{where}: window {j} goes inactive at {b[j]:g} before it becomes active at {a[j]:g}"
            )
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
