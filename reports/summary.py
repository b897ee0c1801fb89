"""Results a person can open: summary.json, a printed table, convergence plots."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Protocol, overload

import numpy as np

from flt.common.schema import ConfigError

COMMAND: list[str] | None = None  # the flt command's arguments, set by the command line


# What a summary reads of a method and of the server's transport (server/strategies/base.py
# Strategy, server/transport.py Transport), described here: reports import only common/.
class MethodReport(Protocol):
    def expected_bytes(self, selections: int, model_bytes: int) -> dict | None: ...

    def summary(self) -> dict: ...


class _Rejections(Protocol):
    def summary(self) -> dict: ...


class _Ledger(Protocol):
    @property
    def rejections(self) -> _Rejections: ...

    def totals(self, since_round: int | None = None) -> dict: ...


class TrafficReport(Protocol):
    @property
    def ledger(self) -> _Ledger: ...

    def lost_clients(self) -> np.ndarray: ...


def command_line() -> str:
    """The command that made a run folder, as a shell would take it."""
    return shlex.join(["flt", *COMMAND] if COMMAND is not None else sys.argv)


def method_summary(
    spec: dict, history: list[dict], strategy: MethodReport, transport: TrafficReport, model_bytes: int, cfg: dict
) -> dict:
    evals = [r for r in history if "acc_mean" in r]
    last = evals[-1] if evals else {}
    scored = [r for r in evals if math.isfinite(r["acc_mean"])]  # an evaluation no client answered is NaN
    best = max(scored, key=lambda r: r["acc_mean"]) if scored else {}
    totals = transport.ledger.totals()
    selections = sum(r["selected"] for r in history)
    payload = {d: {k: v["payload"] for k, v in totals[d].items()} for d in totals}
    overhead = {d: sum(v["overhead"] for v in totals[d].values()) for d in totals}
    expected = strategy.expected_bytes(selections, model_bytes)
    # the paper's formulas count training traffic only: model, encoder and embedding payload
    measured = sum(payload[d][k] for d in payload for k in ("model", "encoder", "embedding"))
    out = {
        "method": spec["name"],
        "label": spec["label"],
        "params": spec["params"],
        "final_accuracy": last.get("acc_mean"),
        "final_se": last.get("acc_se"),
        "final_variance": last.get("acc_var"),
        "best_accuracy": best.get("acc_mean"),
        "best_round": best.get("round"),
        "rounds": len(history),
        "rounds_to_target": _to_target(evals, cfg["train"]["target_accuracy"]),
        "bytes_payload": payload,
        "bytes_overhead": overhead,
        "bytes_up": sum(payload["up"].values()) + overhead["up"],
        "bytes_down": sum(payload["down"].values()) + overhead["down"],
        "formula_payload_bytes": measured,
        "expected": expected,
        **transport.ledger.rejections.summary(),  # messages, bytes and reasons, never traffic
        "lost_clients": transport.lost_clients().tolist(),
        "model_bytes": model_bytes,
        "selections": selections,
    }
    if expected:
        out["bytes_vs_formula"] = measured / expected["bytes"] if expected["bytes"] else math.nan
    if history and "emulated_s" in history[-1]:
        out["emulated_s"] = history[-1]["emulated_s"]
        out["stragglers"] = sum(r.get("stragglers", 0) for r in history)
        out["dropouts"] = sum(r.get("dropouts", 0) for r in history)
    changes = [e for r in history for e in r.get("events", []) if e["kind"] in ("arrival", "drift")]
    if changes:
        nxt = [e["round"] for e in changes[1:]] + [None]
        out["changes"] = [
            {
                "kind": e["kind"],
                "clients": len(e["clients"]),
                **{k: e[k] for k in ("placement", "ari", "fcr_bytes") if k in e},
                **rounds_to_recover(
                    history, e["round"], until, key="acc_incumbents" if e["kind"] == "arrival" else "acc_mean"
                ),
            }
            for e, until in zip(changes, nxt, strict=True)
        ]
    without_test = max((r.get("clients_without_test", 0) for r in evals), default=0)
    if without_test:
        out["clients_without_test"] = without_test  # left out of every accuracy mean
    out.update(strategy.summary())
    out, extra = split_timing(out)  # e.g. FLT's FCR seconds
    out["timing"] = {**_timing([r["timing"] for r in history]), **(extra or {})}
    return out


def _timing(rounds: list[dict]) -> dict:
    """Wall-clock figures of a method, apart from its results (they differ on every rerun)."""
    if not rounds:
        return {"setup_s": 0.0, "wall_s": 0.0, "s_per_round": 0.0, "eval_s_per_round": 0.0}
    # median: round 1 pays one-off warm-up (imports, first vmap); evaluation is apart
    return {
        "setup_s": rounds[0]["setup_s"],
        "wall_s": rounds[-1]["wall_s"],
        "s_per_round": float(np.median([t["train_s"] for t in rounds])),
        "eval_s_per_round": float(np.median([t["eval_s"] for t in rounds if "eval_s" in t] or [0.0])),
    }


def _to_target(evals: list[dict], target: float | None):
    if target is None:
        return None
    hit = next((r for r in evals if r["acc_mean"] >= target), None)
    if hit is None:
        return None
    b = hit["bytes"]
    return {
        "round": hit["round"],
        "bytes": sum(sum(v.values()) for v in b.values()),
        "emulated_s": hit.get("emulated_s"),
    }


def finished_methods(run_dir: Path, cfg: dict) -> dict:
    """A killed run's summary.json, keeping only the methods that ran all their rounds and
    whose folder is still there (a user deletes a method's folder to run it again)."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {}
    except ValueError as exc:  # written atomically, so not a torn write: a damaged file
        raise ConfigError(f"{path}: not valid JSON ({exc}); remove it to rerun every method") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("methods", {}), dict):
        raise ConfigError(f"{path}: not a run's summary (no 'methods' mapping); remove it to rerun every method")
    done = {
        label: m
        for label, m in summary.get("methods", {}).items()
        if isinstance(m, dict)
        and m.get("rounds") == cfg["train"]["rounds"]
        and (run_dir / label / "metrics.jsonl").is_file()
    }
    return {"scenario": cfg["name"], "methods": done}


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"  # not write_atomic's: its mkstemp file is private (0600)
    try:
        tmp.write_text(json.dumps(summary, indent=2, default=_jsonable))
    except OSError as exc:  # a full disk: name the file, as a file object's error does not
        exc.filename = exc.filename or str(tmp)
        raise
    tmp.replace(run_dir / "summary.json")


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def table(summary: dict) -> str:
    head = (
        f"{'method':<14}{'final acc':>10}{'± s.e.':>8}{'variance':>10}{'best':>8}"
        f"{'up MB':>10}{'down MB':>10}{'overhead MB':>12}{'vs formula':>11}"
        f"{'clusters':>9}{'ARI':>6}{'emulated':>10}{'s/round':>9}"
    )
    rows = [head, "-" * len(head)]
    for label, m in summary["methods"].items():
        ratio = m.get("bytes_vs_formula")
        clusters, ari = clustering(m)
        emulated = m.get("emulated_s")
        rows.append(
            f"{label:<14}{_f(m['final_accuracy'], 10)}{_f(m['final_se'], 8)}{_f(m['final_variance'], 10)}"
            f"{_f(m['best_accuracy'], 8)}{m['bytes_up'] / 1e6:>10.2f}{m['bytes_down'] / 1e6:>10.2f}"
            f"{sum(m['bytes_overhead'].values()) / 1e6:>12.3f}"
            f"{(f'{ratio:.4f}' if ratio is not None else '-'):>11}"
            f"{(clusters if clusters is not None else '-'):>9}{_f(ari, 6)}"
            f"{(f'{emulated:.0f} s' if emulated is not None else '-'):>10}{m['timing']['s_per_round']:>9.2f}"
        )
    return "\n".join(rows)


def clustering(m: dict) -> tuple[int | None, float | None]:
    """The clusters a method found and their ARI against the planted ones: FCR's latest
    (re-)clustering, or the assignment IFCA, FedSEM and CFL ended with; (None, None) for
    methods that do not cluster."""
    reports = m.get("fcr_reports")
    if reports:
        return reports[-1].get("clusters"), reports[-1].get("ari")
    if "found_clusters" not in m:
        return None, None
    found = {c for c in m["found_clusters"] if c >= 0}
    # nobody assigned yet (FedSEM before K models returned, IFCA before any pick): every
    # client trains and is evaluated with the one fallback model
    return m.get("clusters", len(found) or 1), m.get("ari")


def _f(x, width: int) -> str:
    return f"{x:>{width}.2f}" if isinstance(x, (int, float)) and x == x else f"{'-':>{width}}"


def read_metrics(run_dir: Path, label: str) -> list[dict]:
    """A method's records, one per round (metrics.jsonl). A last line that does not parse
    is a record torn by a killed run (resuming drops it too); one before it is damage."""
    path = run_dir / label / "metrics.jsonl"
    try:
        text = path.read_text() if path.exists() else ""
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): not a run's records") from None
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            if i == len(lines):
                break
            raise ConfigError(f"{path}: line {i} is not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: line {i} is a JSON {type(record).__name__}, not one round's record")
        records.append(record)
    return records


def plot_convergence(run_dir: Path, summary: dict, path: Path | None = None) -> Path:
    """Accuracy against rounds, bytes and emulated time, one line per method
    (run_dir/convergence.png unless `path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = {label: read_metrics(run_dir, label) for label in summary["methods"]}
    clocked = any(r.get("emulated_s") is not None for rows in metrics.values() for r in rows if "acc_mean" in r)
    # the emulated-time panel only when devices have profiles: an empty axis says nothing
    fig, axes = plt.subplots(1, 3 if clocked else 2, figsize=(15 if clocked else 10, 4))
    ax_r, ax_b = axes[0], axes[1]
    ax_t = axes[2] if clocked else None
    marked: set[int] = set()
    for label, rows_all in metrics.items():
        rows = [r for r in rows_all if "acc_mean" in r]
        acc = np.array([r["acc_mean"] for r in rows])
        se = np.array([r["acc_se"] for r in rows])
        rnd = [r["round"] for r in rows]
        mb = [sum(sum(v.values()) for v in r["bytes"].values()) / 1e6 for r in rows]
        ax_r.plot(rnd, acc, label=label)
        ax_r.fill_between(rnd, acc - se, acc + se, alpha=0.2)
        ax_b.plot(mb, acc, label=label)
        if ax_t is not None and rows and all("emulated_s" in r for r in rows):
            ax_t.plot([r["emulated_s"] / 60 for r in rows], acc, label=label)
        for r in rows_all:  # arrivals and drift, the same rounds for every method
            for e in r.get("events", []):
                if e["kind"] in ("arrival", "drift") and e["round"] not in marked:
                    marked.add(e["round"])
                    ax_r.axvline(e["round"], color="grey", ls="--", lw=0.8)
                    ax_r.annotate(
                        e["kind"],
                        (e["round"], 0.02),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        fontsize=7,
                        color="grey",
                    )
    ax_r.set(xlabel="round", ylabel="mean client test accuracy (%)", title=str(summary.get("scenario", run_dir.name)))
    ax_r.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole
    ax_b.set(xlabel="bytes on the wire, up + down (MB)", ylabel="mean client test accuracy (%)")
    ax_b.set_xscale("symlog")
    if ax_t is not None:
        ax_t.set(xlabel="emulated time (min)", ylabel="mean client test accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    path = path or run_dir / "convergence.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_shift_examples(path: Path, rows: list[tuple[str, np.ndarray, np.ndarray]], scale: int = 3) -> Path:
    """A few training images of one client per shift group, as that client's device sees
    them: rows of (title, float images [n, C, H, W] in [0, 1], labels it trains on).
    Drawn with Pillow, not matplotlib: it runs at the start of a run, in the server, and
    importing matplotlib there held about 200 MB more for the whole run (bench_shift.py)."""
    from PIL import Image, ImageDraw

    h, w = rows[0][1].shape[-2:]
    cell_w, cell_h, left, top = w * scale + 8, h * scale + 22, 170, 8
    cols = max(len(x) for _, x, _ in rows)
    sheet = Image.new("RGB", (left + cols * cell_w, top + len(rows) * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (title, x, y) in enumerate(rows):
        y0 = top + r * cell_h
        draw.multiline_text((6, y0 + cell_h // 3), title, fill="black")
        for c in range(len(x)):
            pixels = (np.clip(x[c], 0, 1) * 255).round().astype(np.uint8).transpose(1, 2, 0)
            img = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).convert("RGB")
            sheet.paste(img.resize((w * scale, h * scale), Image.Resampling.NEAREST), (left + c * cell_w, y0 + 14))
            draw.text((left + c * cell_w, y0), f"label {int(y[c])}", fill="black")
    sheet.save(path)
    return path


# Keys whose values depend on the machine, not on the scenario: wall-clock seconds (any
# key ending in "seconds", e.g. FLT's encoder_seconds) and the encoder cache (its path,
# whether it hit). They move to a record's `timing` object. Emulated time ends in "_s".
WALL_CLOCK_KEYS = frozenset({"train_s", "eval_s", "wall_s", "setup_s", "s_per_round", "eval_s_per_round"})
WALL_CLOCK_SUFFIXES = ("seconds", "cached", "cache")


def is_wall_clock(key: object) -> bool:
    return isinstance(key, str) and (key in WALL_CLOCK_KEYS or key.endswith(WALL_CLOCK_SUFFIXES))


@overload
def split_timing(obj: dict) -> tuple[dict, dict | None]: ...


@overload
def split_timing(obj: list) -> tuple[list, list[dict] | None]: ...


@overload
def split_timing(obj: object) -> tuple[Any, Any]: ...


def split_timing(obj: object) -> tuple[Any, Any]:
    """(obj without wall-clock keys at any depth, those values in the same nesting or
    None). Lists keep their positions: events[i]'s seconds are timing['events'][i]."""
    if isinstance(obj, dict):
        clean: dict = {}
        timing: dict = {}
        for k, v in obj.items():
            if is_wall_clock(k):
                timing[k] = v
                continue
            clean[k], sub = split_timing(v)
            if sub:
                timing[k] = sub
        return clean, timing or None
    if isinstance(obj, list):
        parts = [split_timing(v) for v in obj]
        positions = [t or {} for _, t in parts]
        return [c for c, _ in parts], positions if any(positions) else None
    return obj, None


def rounds_to_recover(
    history: list[dict], event_round: int, until: int | None = None, tolerance: float = 1.0, key: str = "acc_mean"
) -> dict:
    """Accuracy just before an event, its lowest point after (before the next event at
    `until`), and how many rounds until it is back within `tolerance` points of where it
    was. `key` "acc_incumbents" compares like with like after an arrival: the clients
    that were there before (the newcomers' own accuracy is reported apart)."""
    evals = [r for r in history if "acc_mean" in r]
    level_of = lambda r: r.get(key, r["acc_mean"])  # noqa: E731 (before any newcomer: everyone)
    before = [level_of(r) for r in evals if r["round"] < event_round]
    after = [r for r in evals if event_round <= r["round"] < (until or float("inf"))]
    if not before or not after:
        return {}
    level = before[-1]
    low = min(after, key=level_of)
    # never out of the band: recovered at once (not at the round of its lowest wobble)
    first = after[0] if level_of(low) >= level - tolerance else low
    back = next((r for r in after if r["round"] >= first["round"] and level_of(r) >= level - tolerance), None)
    b0 = sum(sum(v.values()) for v in evals[len(before) - 1]["bytes"].values())
    out = {
        "round": event_round,
        "measured_on": "incumbents" if key == "acc_incumbents" else "all clients",
        "before": level,
        "lowest": level_of(low),
        "lowest_round": low["round"],
        "rounds_to_recover": None if back is None else back["round"] - event_round,
        "bytes_to_recover": None if back is None else sum(sum(v.values()) for v in back["bytes"].values()) - b0,
        "emulated_s_to_recover": None
        if back is None or "emulated_s" not in back
        else back["emulated_s"] - evals[len(before) - 1].get("emulated_s", 0.0),
    }
    if "acc_newcomers" in after[-1]:
        out["newcomers_accuracy"] = after[-1]["acc_newcomers"]
    return out
