"""`flt report`: one self-contained HTML page for one or more run folders, and the same
tables as Markdown and CSV.

The page needs nothing but itself: figures are embedded as base64 data URIs, there is no
stylesheet, script or font from anywhere else, so it opens offline and can be mailed.
Everything comes from what a run folder already holds (summary.json, each method's
metrics.jsonl, FCR's figures, config.yaml, command.txt); nothing is rerun.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import re
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import yaml

from flt.common.errors import FltError
from flt.common.files import make_folder
from flt.common.schema import ConfigError
from flt.reports import summary as report

# the rest is in summary.json
EVENT_DETAIL = ("exchange", "cause", "placement", "to_cluster", "clusters", "ari", "nmi", "fcr_bytes", "duration_s")
FCR_FIGURES = ("adjacency", "dendrogram", "centroids", "umap")  # as FCR writes them, in this order


@dataclass
class Run:
    path: Path
    summary: dict
    config: str
    command: str | None
    metrics: dict[str, list[dict]] = field(default_factory=dict)  # label -> records
    alias: str | None = None  # set when another run in the same report has the same scenario name

    @cached_property
    def cfg(self) -> dict:
        return yaml.safe_load(self.config) or {} if self.config else {}

    @property
    def scenario(self) -> str:
        name = self.summary.get("scenario")
        return name if isinstance(name, str) and name else self.path.name

    @property
    def name(self) -> str:
        return self.alias or self.scenario


def tell_apart(runs: list[Run]) -> list[Run]:
    """Runs of one scenario with different settings (`--set`) share its name: each is
    then named by its folder too, so their rows, sections and figures stay apart."""
    counts = Counter(run.scenario for run in runs)
    for run in runs:
        if counts[run.scenario] > 1:
            run.alias = f"{run.scenario} ({run.path.name})"
    folders = Counter(run.name for run in runs)
    for run in runs:
        if folders[run.name] > 1:  # same folder name under different parents
            run.alias = f"{run.scenario} ({run.path})"
    return runs


def run_folders(paths: list[Path]) -> list[Path]:
    """Each path is a run folder (it has summary.json) or a folder of them (`flt suite`'s)."""
    found = []
    for p in paths:
        if (p / "summary.json").is_file():
            found.append(p)
            continue
        inner = sorted(d for d in p.iterdir() if (d / "summary.json").is_file()) if p.is_dir() else []
        if not inner:
            raise ConfigError(f"{p}: no summary.json here or one folder down; not a run folder")
        found += inner
    return found


def load_run(path: Path) -> Run:
    try:
        summary = json.loads((path / "summary.json").read_text())
    except ValueError as exc:
        raise ConfigError(f"{path / 'summary.json'}: not valid JSON ({exc})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("methods"), dict):
        raise ConfigError(f"{path / 'summary.json'}: no 'methods' mapping")
    config = path / "config.yaml"
    command = path / "command.txt"
    return Run(
        path,
        summary,
        config.read_text() if config.exists() else "",
        command.read_text().strip() if command.exists() else None,
        {label: report.read_metrics(path, label) for label in summary["methods"]},
    )


# -- the tables: one row of raw values per (run, method) ----------------------------------
def method_row(run: Run, label: str) -> dict:
    m = run.summary["methods"][label]
    evals = [r for r in run.metrics.get(label, []) if "acc_mean" in r]
    best = max(evals, key=lambda r: r["acc_mean"]) if evals else {}
    clusters, ari = report.clustering(m)
    target = m.get("rounds_to_target") or {}
    timing = m.get("timing") or {}
    row = {
        "scenario": run.name,
        "method": label,
        "rounds": m.get("rounds"),
        "rounds_planned": (run.cfg.get("train") or {}).get("rounds"),
        "final_accuracy": m.get("final_accuracy"),
        "final_se": m.get("final_se"),
        "final_round": evals[-1]["round"] if evals else None,
        "best_accuracy": best.get("acc_mean", m.get("best_accuracy")),
        "best_se": best.get("acc_se"),
        "best_round": best.get("round", m.get("best_round")),
        "variance": m.get("final_variance"),
        "clusters": clusters,
        "ari": ari,
        "bytes_up": m.get("bytes_up"),
        "bytes_down": m.get("bytes_down"),
    }
    for d in ("up", "down"):
        for kind, n in (m.get("bytes_payload") or {}).get(d, {}).items():
            row[f"{d}_{kind}"] = n
        row[f"{d}_overhead"] = (m.get("bytes_overhead") or {}).get(d)
    expected = m.get("expected") or {}
    row |= {
        "formula": expected.get("formula"),
        "formula_bytes": expected.get("bytes"),
        "measured_formula_bytes": m.get("formula_payload_bytes"),
        "bytes_vs_formula": m.get("bytes_vs_formula"),
        "target_accuracy": (run.cfg.get("train") or {}).get("target_accuracy"),
        "target_round": target.get("round"),
        "target_bytes": target.get("bytes"),
        "target_emulated_s": target.get("emulated_s"),
        "emulated_s": m.get("emulated_s"),
        "wall_s": timing.get("wall_s", m.get("wall_s")),
        "s_per_round": timing.get("s_per_round", m.get("s_per_round")),
    }
    return row


def fcr_rows(run: Run) -> list[dict]:
    """Every (re-)clustering of every FCR method: when, why, what it found, how well."""
    rows = []
    for label, m in run.summary["methods"].items():
        for r in m.get("fcr_reports") or []:
            rows.append(
                {
                    "scenario": run.name,
                    "method": label,
                    "round": r.get("round", 0),
                    "cause": r.get("cause", "initial"),
                    "clients": r.get("n_clients"),
                    "clusters": r.get("clusters"),
                    "sizes": " ".join(map(str, r.get("cluster_sizes", []))),
                    "silhouette": r.get("silhouette"),
                    "separation": r.get("separation"),
                    "ari": r.get("ari"),
                    "nmi": r.get("nmi"),
                    **next_cut_columns(r.get("next_cut")),
                }
            )
    return rows


def next_cut_columns(cut: object) -> dict:
    """Why not one more cluster (server/fcr.py next_cut): the cut C + 1's weakest split
    score and the smaller held-out z of the split it adds; empty cells for a run written
    before it was reported, or one whose C was not chosen by the split rule."""
    cut = cut if isinstance(cut, dict) else {}
    z = cut.get("heldout_z")
    numbers = [x for x in z if isinstance(x, (int, float))] if isinstance(z, list) else []
    return {
        "next_clusters": cut.get("clusters"),
        "next_weakest_split": cut.get("weakest_split_score"),
        "next_heldout_z": min(numbers) if numbers else None,
    }


def change_rows(run: Run) -> list[dict]:
    """Arrivals and drift, and how each method recovered (summary.json's `changes`)."""
    keys = (
        "round",
        "kind",
        "clients",
        "placement",
        "ari",
        "fcr_bytes",
        "measured_on",
        "before",
        "lowest",
        "lowest_round",
        "rounds_to_recover",
        "bytes_to_recover",
        "emulated_s_to_recover",
    )
    return [
        {"scenario": run.name, "method": label, **{k: c.get(k) for k in keys}}
        for label, m in run.summary["methods"].items()
        for c in m.get("changes") or []
    ]


def event_rows(run: Run) -> list[dict]:
    """Every event the rounds recorded (arrival, drift, re-clustering), in order."""
    rows = []
    for label, records in run.metrics.items():
        for r in records:
            for e in r.get("events", []):
                detail = {k: e[k] for k in EVENT_DETAIL if k in e}
                rows.append(
                    {
                        "scenario": run.name,
                        "method": label,
                        "round": e.get("round", r["round"]),
                        "event": e["kind"],
                        "clients": len(e.get("clients", [])),
                        "detail": ", ".join(f"{k} {_fmt(v)}" for k, v in detail.items()),
                    }
                )
    return rows


def group_rows(run: Run) -> list[dict]:
    """Each method's last evaluation, per planted cluster: how many clients and training
    samples the cluster holds and its clients' mean and lowest accuracy. A mean over all
    clients hides a method that serves the big clusters and fails the small ones; this
    shows it. Nothing for a partition without planted clusters (writers) or a run
    recorded before per-client scores were kept."""
    truth, sizes = planted_clusters(run.path / "partition.npz")
    if not (truth >= 0).any():
        return []
    rows = []
    for label, records in run.metrics.items():
        last = next((r for r in reversed(records) if isinstance(r.get("per_client"), dict)), None)
        if last is None:
            continue
        scores = last["per_client"]
        if len({len(scores.get(k) or ()) for k in ("client", "correct", "total")}) != 1:
            continue  # a hand-edited or damaged record: no table rather than a wrong one
        try:
            client, correct, total = (np.asarray(scores[k], dtype=np.int64) for k in ("client", "correct", "total"))
        except (TypeError, ValueError):
            continue
        keep = (total > 0) & (client >= 0) & (client < len(truth))
        client, acc = client[keep], 100.0 * correct[keep] / total[keep]
        for g in np.unique(truth[client]):
            mine = truth[client] == g
            rows.append(
                {
                    "scenario": run.name,
                    "method": label,
                    "round": last["round"],
                    "cluster": int(g),
                    "clients": int(mine.sum()),
                    "train_samples": int(sizes[client[mine]].sum()),
                    "accuracy": float(acc[mine].mean()),
                    "lowest": float(acc[mine].min()),
                }
            )
    return rows


def planted_clusters(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each client's planted cluster and training-set size from a run's partition.npz
    (its `cluster` and `train_offsets` arrays); empty when the file is missing or damaged."""
    empty = np.zeros(0, np.int64)
    try:
        with np.load(path, allow_pickle=False) as z:
            truth, offsets = z["cluster"].astype(np.int64), z["train_offsets"].astype(np.int64)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return empty, empty
    if truth.ndim != 1 or offsets.shape != (len(truth) + 1,):
        return empty, empty
    return truth, np.diff(offsets)


# -- formatting ---------------------------------------------------------------------------
def _fmt(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _pm(mean, se) -> str:
    return "-" if _fmt(mean) == "-" else f"{mean:.2f} ± {_fmt(se)}"  # None or NaN: no client tested


def _secs(s) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def stopped(r: dict) -> bool:
    """Whether a run ended before its scenario's T (killed, or stopped at a time limit):
    its 'final' accuracy is then its last evaluation's, not round T's."""
    planned, done = r.get("rounds_planned"), r.get("rounds")
    return isinstance(planned, int) and isinstance(done, int) and done < planned


def _rounds_and_final(r: dict) -> tuple[str, str]:
    final = _pm(r["final_accuracy"], r["final_se"])
    if not stopped(r):
        return _fmt(r["rounds"]), final
    at = f" (round {r['final_round']})" if r.get("final_round") is not None else ""
    return f"{r['rounds']} of {r['rounds_planned']}, stopped", final + at


def results_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = [
        "scenario",
        "method",
        "rounds",
        "final acc ± s.e.",
        "best acc ± s.e. (round)",
        "variance",
        "clusters",
        "ARI",
        "up MB",
        "down MB",
        "measured / formula",
        "to target: round, MB, emulated",
        "emulated time",
        "wall time",
    ]
    body = []
    for r in rows:
        to_target = (
            "no target"
            if r["target_accuracy"] is None
            else (
                "not reached"
                if r["target_round"] is None
                else f"{r['target_round']}, {_mb(r['target_bytes'])}, {_secs(r['target_emulated_s'])}"
            )
        )
        body.append(
            [
                r["scenario"],
                r["method"],
                *_rounds_and_final(r),
                f"{_pm(r['best_accuracy'], r['best_se'])} ({_fmt(r['best_round'])})",
                _fmt(r["variance"]),
                _fmt(r["clusters"]),
                _fmt(r["ari"]),
                _mb(r["bytes_up"]),
                _mb(r["bytes_down"]),
                _fmt(r["bytes_vs_formula"], 4),
                to_target,
                _secs(r["emulated_s"]),
                _secs(r["wall_s"]),
            ]
        )
    return head, body


def bytes_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """MB up and down by message kind, the protocol's overhead apart, and the formula."""
    kinds = [
        k
        for k in dict.fromkeys(k for r in rows for k in r)
        if re.fullmatch(r"(up|down)_\w+", k) and any(r.get(k) for r in rows)
    ]
    head = ["scenario", "method", *[k.replace("_", " ") + " MB" for k in kinds], "formula", "formula MB", "measured MB"]
    body = [
        [
            r["scenario"],
            r["method"],
            *[_mb(r.get(k)) for k in kinds],
            r["formula"] or "-",
            _mb(r["formula_bytes"]),
            _mb(r["measured_formula_bytes"]),
        ]
        for r in rows
    ]
    return head, body


def plain_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = list(rows[0]) if rows else []
    return head, [[_fmt(r[k], 3) for k in head] for r in rows]


def markdown(head: list[str], body: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), line(["---"] * len(head)), *map(line, body)])


def html_table(head: list[str], body: list[list[str]]) -> str:
    esc = html.escape
    rows = "".join(
        "<tr>" + "".join(f"<td{'' if NUMBER.match(str(c)) else ' class=t'}>{esc(str(c))}</td>" for c in r) + "</tr>\n"
        for r in body
    )
    heads = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f"<div class=scroll><table><thead><tr>{heads}</tr></thead>\n<tbody>{rows}</tbody></table></div>"


NUMBER = re.compile(r"^[-+]?[0-9.]+( ± [0-9.]+)?( \(\d+\))?( s| min)?$|^-$")  # right-aligned


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()


# -- the page -----------------------------------------------------------------------------
CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1400px;margin:2em auto;
padding:0 1.5em;color:#1d1d1f}
h1{font-size:1.7em;margin-bottom:.2em}h2{margin-top:2.2em;border-bottom:2px solid #ddd;padding-bottom:.2em}
h3{margin-top:1.6em}table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #d0d0d5;padding:.3em .6em;text-align:right;white-space:nowrap}
th{background:#f2f2f6;white-space:normal}td.t{text-align:left}.scroll{overflow-x:auto}td:nth-child(-n+2),th:nth-child(-n+2){text-align:left}
tbody tr:nth-child(even){background:#fafafc}img{max-width:100%;border:1px solid #eee;margin:.3em 0}
.figs{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}.figs figure{margin:0;max-width:48%}
.figs figure.wide{max-width:100%}
figcaption{font-size:.85em;color:#555}pre{background:#f6f6f8;padding:.8em;overflow:auto;font-size:.85em}
.note{color:#666;font-size:.9em}
"""


def fcr_figures(run: Run, label: str, report_: dict) -> list[tuple[str, Path]]:
    rnd = report_.get("round", 0)
    tag = "" if not rnd else f"-round{rnd}"
    folder = run.path / label
    return [
        (f"{kind}{tag}", folder / f"{kind}{tag}.png") for kind in FCR_FIGURES if (folder / f"{kind}{tag}.png").is_file()
    ]


def figure(png: Path, caption: str, wide: bool = False) -> str:
    return (
        f'<figure{" class=wide" if wide else ""}><img src="{data_uri(png)}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def run_section(run: Run, plots: Path) -> str:
    rows = [method_row(run, label) for label in run.summary["methods"]]
    conv = report.plot_convergence(run.path, run.summary, plots / f"convergence-{_slug(run.name)}.png")
    parts = [
        f"<h2>{html.escape(run.name)}</h2>",
        f'<p class="note">run folder <code>{html.escape(str(run.path.resolve()))}</code></p>',
        "<h3>Results</h3>",
        html_table(*results_table(rows)),
        "<h3>Bytes by kind</h3>",
        html_table(*bytes_table(rows)),
        "<h3>Convergence</h3>",
        figure(conv, "accuracy against rounds (± s.e.), bytes and emulated time"),
    ]
    if (examples := run.path / "shift_examples.png").is_file():
        shift_kind = json.loads((run.path / "shift.json").read_text()).get("kind", "?")
        parts += [f"<h3>Shift between clusters: {html.escape(shift_kind)}</h3>", figure(examples, "shift_examples.png")]
    if groups := group_rows(run):
        parts += [
            "<h3>Accuracy by planted cluster (last evaluation)</h3>",
            html_table(*plain_table([{k: v for k, v in r.items() if k != "scenario"} for r in groups])),
        ]
    parts += fcr_section(run)
    changes, events = change_rows(run), event_rows(run)
    if changes or events:
        parts.append("<h3>Dynamic events and recovery</h3>")
        parts += [
            html_table(*plain_table(events)) if events else "",
            html_table(*plain_table(changes)) if changes else "",
        ]
    command = run.command or f"(not recorded) flt run {run.path / 'config.yaml'}"
    parts += [
        "<h3>Command and resolved config</h3>",
        f"<pre>{html.escape(command)}</pre>",
        f"<details><summary>config.yaml, every default filled in</summary>"
        f"<pre>{html.escape(run.config or '(no config.yaml)')}</pre></details>",
    ]
    return "\n".join(parts)


def fcr_section(run: Run) -> list[str]:
    parts = []
    for label, m in run.summary["methods"].items():
        reports = m.get("fcr_reports") or []
        if not reports:
            continue
        timeline = run.path / label / "clusters_timeline.png"  # written once anything re-clustered
        parts += [
            f"<h3>FCR: {html.escape(label)}</h3>",
            figure(timeline, f"{label}/clusters_timeline.png: who was in which cluster, round by round")
            if timeline.is_file() and len(reports) > 1
            else "",
            html_table(
                *plain_table(
                    [
                        {k: v for k, v in r.items() if k not in ("scenario", "method")}
                        for r in fcr_rows(run)
                        if r["method"] == label
                    ]
                )
            ),
        ]
        for r in reports:
            figs = fcr_figures(run, label, r)
            if figs:
                title = (
                    f"round {r.get('round', 0)} ({r.get('cause', 'initial')}): {r.get('clusters')} clusters, "
                    f"ARI {_fmt(r.get('ari'))}, NMI {_fmt(r.get('nmi'))}"
                )
                parts.append(
                    f"<p><b>{html.escape(title)}</b></p><div class=figs>"
                    + "".join(figure(p, f"{label}/{name}.png", name.startswith("adjacency")) for name, p in figs)
                    + "</div>"
                )
    return parts


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


@dataclass
class Pieces:
    """One run's rows of each table, and its section of the page."""

    rows: list[dict]
    fcr: list[dict]
    changes: list[dict]
    events: list[dict]
    groups: list[dict]
    section: str


# what a field of the wrong type or shape raises while a run's files are read and formatted
# (not OSError: a full disk while the figures are written is not the run folder's fault)
DAMAGE: tuple[type[Exception], ...] = (KeyError, TypeError, ValueError, AttributeError, IndexError)
DAMAGE += (EOFError, zipfile.BadZipFile, yaml.YAMLError)


def read_run(run: Run, plots: Path) -> Pieces:
    """A run folder's files come from disk, perhaps edited by hand or written by another
    version: a missing field or one of the wrong type names the folder, not a traceback."""
    try:
        return Pieces(
            [method_row(run, label) for label in run.summary["methods"]],
            fcr_rows(run),
            change_rows(run),
            event_rows(run),
            group_rows(run),
            run_section(run, plots),
        )
    except FltError:
        raise
    except DAMAGE as exc:
        raise ConfigError(
            f"{run.path}: its summary.json, metrics.jsonl or config.yaml is not as flt writes it "
            f"({type(exc).__name__}: {str(exc)[:200]}); rerun it, or leave it out of the report"
        ) from None


def build(paths: list[Path], out: Path) -> Path:
    """Write report.html, report.md and the CSV tables into `out`; return the page's path."""
    runs = tell_apart([load_run(p) for p in run_folders(paths)])
    make_folder(out, "--out")
    pieces = [read_run(run, out) for run in runs]
    rows = [r for p in pieces for r in p.rows]
    fcr = [r for p in pieces for r in p.fcr]
    changes = [r for p in pieces for r in p.changes]
    events = [r for p in pieces for r in p.events]
    groups = [r for p in pieces for r in p.groups]
    tables = (("methods", rows), ("fcr", fcr), ("changes", changes), ("events", events), ("groups", groups))
    for name, table in tables:
        if table:
            write_csv(out / f"{name}.csv", table)
    (out / "report.md").write_text(markdown_page(runs, rows, fcr, changes, events, groups))
    title = "flt report: " + ", ".join(run.name for run in runs)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{len(runs)} run(s); tables also in report.md and *.csv beside this page</p>',
        *(["<h2>All methods</h2>", html_table(*results_table(rows))] if len(runs) > 1 else []),
        *[p.section for p in pieces],
    ]
    page = out / "report.html"
    page.write_text(
        f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    return page


def markdown_page(
    runs: list[Run], rows: list[dict], fcr: list[dict], changes: list[dict], events: list[dict], groups: list[dict]
) -> str:
    parts = [
        "# flt report",
        "",
        "## Results",
        "",
        markdown(*results_table(rows)),
        "",
        "## Bytes by kind",
        "",
        markdown(*bytes_table(rows)),
        "",
    ]
    sections = (
        ("Accuracy by planted cluster (last evaluation)", groups),
        ("FCR (every clustering)", fcr),
        ("Events", events),
        ("Recovery", changes),
    )
    for title, table in sections:
        if table:
            parts += [f"## {title}", "", markdown(*plain_table(table)), ""]
    parts += ["## Commands", ""] + [f"- {run.name}: `{run.command or 'not recorded'}`" for run in runs]
    return "\n".join(parts) + "\n"
