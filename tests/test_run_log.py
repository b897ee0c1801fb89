"""run.log: the server's warnings, the run's progress lines and how each run of a folder
ended, kept beside the results."""

from __future__ import annotations

import io
import logging

import pytest

from flt.common.errors import FltError
from flt.emulator.run_log import run_log
from flt.reports.terminal import Display, step


def _lines(path):
    return [line.split(" ", 2)[2] for line in path.read_text().splitlines()]  # without the time


def test_warnings_progress_and_the_end_of_each_run_are_appended_and_nothing_after(tmp_path):
    path, shown = tmp_path / "run.log", []
    log = logging.getLogger("flt.server")
    with run_log(path, "flt run s.yaml", shown.append, "data: digits") as progress:
        progress("== fedavg ==")
        log.warning("device %s lost", "dev-1")
        log.info("not kept: below warning")
    with pytest.raises(FltError), run_log(path, "flt run --resume RUN", shown.append):  # a resume appends
        raise FltError("data.root: no MNIST files in /nowhere")
    log.warning("after the run: not in its log")

    assert shown == ["== fedavg =="]  # the terminal still gets its line, and only once
    assert _lines(path) == [
        "INFO flt.run: started: flt run s.yaml",
        "INFO flt.run: data: digits",  # shown before the folder existed: the log's first line after it
        "INFO flt.run: == fedavg ==",
        "WARNING flt.server: device dev-1 lost",
        "INFO flt.run: finished",
        "INFO flt.run: started: flt run --resume RUN",
        "INFO flt.run: stopped: error: data.root: no MNIST files in /nowhere",
    ]
    assert not [h for h in logging.getLogger("flt").handlers if isinstance(h, logging.FileHandler)]


def test_a_terminal_keeps_its_bars_and_the_log_gets_only_its_permanent_lines(tmp_path):
    screen = io.StringIO()
    display = Display(screen, tty=True)
    with run_log(tmp_path / "run.log", "flt run s.yaml", display) as progress:
        assert progress is display  # still a Display: rounds are drawn as bars
        for i in (1, 2, 3):
            step(progress, i, 3, f"round {i}/3", "round")
    assert "\r[" in screen.getvalue() and display.copies == []  # bars drawn; the copy goes with the run
    assert _lines(tmp_path / "run.log") == [
        "INFO flt.run: started: flt run s.yaml",
        "INFO flt.run: round 3/3",  # the last step stays on screen, so it is kept; the bars are not
        "INFO flt.run: finished",
    ]


def test_a_table_starts_on_a_line_of_its_own(tmp_path):
    with run_log(tmp_path / "run.log", "flt run s.yaml", print) as progress:
        progress("method   acc\nfedavg  71.00")
    lines = (tmp_path / "run.log").read_text().splitlines()
    assert lines[1].endswith("INFO flt.run: ") and lines[2:4] == ["method   acc", "fedavg  71.00"]
