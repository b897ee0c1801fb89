"""Our device-trace file format, CSV or JSON (``load_trace``).

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
"""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import os
import re
from pathlib import Path

import numpy as np

from flt.emulator.profiles.units import KBPS_TO_BYTES, ProfileError, check_number
from flt.emulator.profiles.windows import Profiles

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
    return check_number(v, where)


def _assemble_rows(path, rows, period):
    """rows: list of (client_id, where, ms, up_kbps, down_kbps, lat_ms, [(a, b), ...])."""
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    m = len(rows)
    seen: dict[int, str] = {}  # client id -> where it was first seen
    for r in rows:
        if r[0] in seen:
            raise ProfileError(f"{r[1]}: duplicate client id {r[0]} (first at {seen[r[0]]})")
        seen[r[0]] = r[1]
    if m and (ids.max() >= m):
        missing = sorted(set(range(m)) - set(seen))
        raise ProfileError(
            f"{path}: client ids must be exactly 0..{m - 1}; missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
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
                    raise ProfileError(f"{path} line {lineno}: unknown column {col!r} (expected {', '.join(_COLUMNS)})")
            for col in _COLUMNS:
                if col not in header:
                    raise ProfileError(f"{path} line {lineno}: missing column {col!r}")
            if len(set(header)) != len(header):
                raise ProfileError(f"{path} line {lineno}: duplicate column in header")
            continue
        if len(fields) == len(header) - 1 and header[-1] == "windows":
            fields.append("")  # trailing empty windows without the comma
        if len(fields) != len(header):
            raise ProfileError(f"{path} line {lineno}: expected {len(header)} fields, got {len(fields)}")
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


def load_trace(path: str | os.PathLike) -> Profiles:
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
