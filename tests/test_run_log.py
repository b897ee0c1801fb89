"""run.log: the server's warnings and how each run of a folder ended, kept beside the results."""

from __future__ import annotations

import logging

import pytest

from flt.common.errors import FltError
from flt.emulator.run_log import run_log


def test_warnings_and_the_end_of_each_run_are_appended_and_nothing_after(tmp_path):
    path = tmp_path / "run.log"
    log = logging.getLogger("flt.server")
    with run_log(path, "flt run s.yaml"):
        log.warning("device %s lost", "dev-1")
        log.info("not kept: below warning")
    with pytest.raises(FltError), run_log(path, "flt run --resume RUN"):  # a resume appends
        raise FltError("data.root: no MNIST files in /nowhere")
    log.warning("after the run: not in its log")

    lines = [line.split(" ", 2)[2] for line in path.read_text().splitlines()]  # without the time
    assert lines == [
        "INFO flt.run: started: flt run s.yaml",
        "WARNING flt.server: device dev-1 lost",
        "INFO flt.run: finished",
        "INFO flt.run: started: flt run --resume RUN",
        "INFO flt.run: stopped: error: data.root: no MNIST files in /nowhere",
    ]
    assert not [h for h in logging.getLogger("flt").handlers if isinstance(h, logging.FileHandler)]
