"""`flt suite`: run many scenarios one after another, one folder each, for hours.

Every scenario file is validated before the first one starts (a typo in the last file
must not wait hours to surface). A scenario whose folder holds a complete summary.json
is skipped; one whose run was interrupted is resumed exactly (`flt run --resume`); a
scenario file that changed since its folder was made is refused rather than mixed in.
Run the same command again after a crash, a Ctrl-C or a reboot and it picks up where it
stopped. The terminal shows scenario i of n, the round and the time left at the current
pace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flt.common.errors import FltError
from flt.common.files import LOCK_NAME, folder_lock, make_folder
from flt.common.schema import ConfigError
from flt.emulator import config
from flt.reports import summary as report
from flt.reports.terminal import Display, duration

RUN_FILES = ("config.yaml", "partition.npz", "public_indices.npy")  # what a resume needs


@dataclass
class Entry:
    file: Path
    cfg: dict
    folder: Path

    @property
    def name(self) -> str:
        return self.cfg["name"]

    @property
    def rounds(self) -> int:
        """Every method's rounds: the scenario's share of the suite's work."""
        return len(self.cfg["methods"]) * self.cfg["train"]["rounds"]


def scenario_files(paths: list[Path]) -> list[Path]:
    """The files named, and a folder's *.yaml / *.yml files in name order."""
    files = []
    for p in paths:
        if p.is_dir():
            inner = sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file())
            if not inner:
                raise ConfigError(f"{p}: no scenario files (*.yaml) in this folder")
            files += inner
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"{p}: no such scenario file or folder")
    return files


def plan(paths: list[Path], overrides: list[str], out: Path) -> list[Entry]:
    """Every scenario loaded and validated, each with its folder out/<name>."""
    entries: list[Entry] = []
    seen: dict[str, Path] = {}  # scenario name -> the file that took it
    for f in scenario_files(paths):
        cfg = config.load(f, overrides)
        if cfg["name"] in seen:
            raise ConfigError(
                f"{f}: name {cfg['name']!r} is also {seen[cfg['name']]}'s; each scenario "
                "needs its own name (it names the scenario's folder)"
            )
        seen[cfg["name"]] = f
        entries.append(Entry(f, cfg, out / cfg["name"]))
    return entries


def state(entry: Entry) -> str:
    """'new', 'interrupted' or 'finished' (every method ran all its rounds)."""
    folder = entry.folder
    if not folder.exists() or not [p for p in folder.iterdir() if p.name != LOCK_NAME]:
        return "new"  # a run killed the instant it locked its folder leaves only the lock file
    if not (folder / "config.yaml").is_file():
        raise ConfigError(
            f"{folder}: exists but is not a run folder (no config.yaml); move it, or choose another --out"
        )
    changed = first_difference(
        config.read_yaml(config.dump(entry.cfg)), config.read_yaml((folder / "config.yaml").read_text())
    )
    if changed:
        raise ConfigError(
            f"{entry.file}: differs from the run in {folder} ({changed}); remove that "
            "folder to start over, or choose another --out"
        )
    done = report.finished_methods(folder, entry.cfg)["methods"]
    if all(m["label"] in done for m in entry.cfg["methods"]):
        return "finished"
    return "interrupted" if all((folder / name).is_file() for name in RUN_FILES) else "new"


def first_difference(a: object, b: object, path: str = "") -> str | None:
    """The first field where two resolved configs differ, named by its path."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(dict.fromkeys([*a, *b])):
            diff = first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
            if diff:
                return diff
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        diffs = (first_difference(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
        return next((d for d in diffs if d), None)
    return None if a == b else f"{path}: now {str(a)[:60]}, was {str(b)[:60]}"


def rounds_done(entry: Entry) -> int:
    """Rounds already in the folder (kept by a resume), for the suite's progress."""
    rounds = entry.cfg["train"]["rounds"]
    return sum(min(rounds, len(report.read_metrics(entry.folder, m["label"]))) for m in entry.cfg["methods"])


class SuiteDisplay(Display):
    """The terminal, plus where the suite stands: [i/n scenario] on every line, and on
    round lines the share of all rounds done and the time left at the current pace."""

    def __init__(self, entries: list[Entry], **kw: Any):
        super().__init__(**kw)
        self.entries, self.total = entries, sum(e.rounds for e in entries)
        self.index, self.rounds_so_far = 0, 0
        self.started, self.ran = time.monotonic(), 0  # this scenario's start, rounds run since

    def begin(self, index: int, done_before: int) -> None:
        self.index, self.rounds_so_far = index, done_before
        self.started, self.ran = time.monotonic(), 0

    def step(
        self, i: int, n: int, line: str, unit: str = "step", every: int | None = None, force: bool = False
    ) -> None:
        if unit == "round":
            self.rounds_so_far, self.ran = self.rounds_so_far + 1, self.ran + 1
        super().step(i, n, line, unit, every, force)

    def tail(self, i: int, n: int, unit: str) -> str:
        if unit != "round":
            return super().tail(i, n, unit)
        pace = (time.monotonic() - self.started) / max(self.ran, 1)  # setup and pretraining included
        left = self.total - self.rounds_so_far
        return f"  suite {100 * self.rounds_so_far / self.total:.0f}%" + (
            f", ~{duration(pace * left)} left" if left else ""
        )

    def decorate(self, text: str, unit: str) -> str:
        return f"[{self.index + 1}/{len(self.entries)} {self.entries[self.index].name}] {text.lstrip()}"


def run_suite(paths: list[Path], overrides: list[str], out: Path, display: Display | None = None) -> int:
    """Run every scenario not yet finished; return 0, or the exit code of the first that
    failed (the others still run). The suite's folder stays locked until it ends."""
    entries = plan(paths, overrides, out)
    # a second suite into this folder would start on the scenarios this one has not reached
    with folder_lock(make_folder(out, "--out"), "--out"):
        return _run_entries(entries, out, display)


def _run_entries(entries: list[Entry], out: Path, display: Display | None) -> int:
    from flt.emulator.run import run_scenario

    states = [state(e) for e in entries]  # every folder checked before anything runs
    display = display or SuiteDisplay(entries).install()  # the encoder's bar goes through it too
    outcome, code = [], 0
    for i, (entry, st) in enumerate(zip(entries, states, strict=True)):
        head = f"== scenario {i + 1} of {len(entries)}: {entry.name} ({entry.file}) -> {entry.folder}"
        if st == "finished":
            display(f"{head}: finished before, skipped")
            outcome.append((entry, "skipped (finished before)"))
            continue
        if isinstance(display, SuiteDisplay):  # rounds in the folders: kept ones included
            display.begin(i, sum(rounds_done(e) for e in entries if e.folder.exists()))
        display(f"{head}: " + ("resuming from the last checkpoint" if st == "interrupted" else "starting"))
        tic = time.monotonic()
        try:
            if st == "interrupted":
                saved = config.load(entry.folder / "config.yaml", [], saved=True)
                run_scenario(saved, str(entry.folder), progress=display, resume=True)
            else:
                run_scenario(entry.cfg, str(entry.folder), progress=display)
            outcome.append(
                (entry, f"{'resumed' if st == 'interrupted' else 'ran'} in {duration(time.monotonic() - tic)}")
            )
        except FltError as exc:  # this scenario's input or devices; the others may be fine
            display(f"error: {entry.file}: {exc}")
            outcome.append((entry, f"failed: {exc}"))
            code = code or exc.exit_code
    display.done()
    display(f"suite: {len(entries)} scenario(s) in {out}")
    for entry, what in outcome:
        display(f"  {entry.name:<24} {what}")
    display(f"a page with every table and figure: flt report {out}")
    return code
