"""Seeded device-profile distributions and the validation of their scenario spec.

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
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from flt.common.errors import short
from flt.emulator.profiles.units import MBPS_TO_BYTES, ProfileError, check_number
from flt.emulator.profiles.windows import Profiles

DEFAULT_SPEC: dict[str, Any] = {  # a `profiles:` mapping as a scenario file spells it
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
            raise ProfileError(f"profiles.{name}.{k}: unknown key for dist {dist!r} (allowed: {sorted(allowed)})")
    merged = dict(dists[dist])
    merged.update({k: v for k, v in sec.items() if k != "dist"})
    return dist, merged


def _draw_positive(dist, sec, name, median_key, const_key, n, rng):
    if dist == "constant":
        v = check_number(sec[const_key], f"profiles.{name}.{const_key}", allow_zero=(name == "latency_ms"))
        return np.full(n, v)
    med = check_number(sec[median_key], f"profiles.{name}.{median_key}")
    sigma = check_number(sec["sigma"], f"profiles.{name}.sigma", allow_zero=True)
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
        shares.append(check_number(tier.get("share", 1.0), f"{where}.share"))
        ups.append(check_number(tier["up_mbps"], f"{where}.up_mbps"))
        downs.append(check_number(tier["down_mbps"], f"{where}.down_mbps"))
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
    frac = check_number(sec["online_fraction"], "profiles.availability.online_fraction", upper=1.0)
    period = check_number(sec["period_s"], "profiles.availability.period_s")
    wpp = sec["windows_per_period"]
    if isinstance(wpp, bool) or not isinstance(wpp, numbers.Integral) or wpp < 1:
        raise ProfileError(f"profiles.availability.windows_per_period: expected an integer >= 1, got {short(wpp)}")
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
    return Profiles._from_flat(ms, up, down, lat, starts.reshape(-1), ends.reshape(-1), owner, np.ones(n, bool), period)
