"""Availability windows and the :class:`Profiles` struct of arrays that holds them.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from flt.emulator.profiles.units import ProfileError


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
        raise ProfileError(f"client {int(owner[i])}: window [{s[i]:g}, {e[i]:g}) ends before it starts")

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
        arrays = self._checked_arrays(self.ms_per_sample, self.up_bps, self.down_bps, self.latency_s, m)
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
                    f"Profiles.windows: client {c}: expected an array of [start, end) pairs, got shape {a.shape}"
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

    def online(self, clients: ArrayLike, t: ArrayLike) -> np.ndarray:
        """Boolean [len(clients)]: is each client online at emulated time t?"""
        _, _, _, _, _, _, where, lens = self._locate(clients, t)
        on = lens == 0
        on[where] = True
        return on

    def online_until(self, clients: ArrayLike, t: ArrayLike) -> np.ndarray:
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

    def take(self, clients: ArrayLike) -> Profiles:
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
