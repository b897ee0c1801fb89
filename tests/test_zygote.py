"""The zygote that local devices are forked from: exit codes come back through it, it ends
when the emulator's end of its socket closes, and under `flt` it is a copy of the emulator."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from flt_command import fedavg_running

from flt.emulator.zygote import Zygote

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


@pytest.mark.slow
def test_exit_codes_come_back_through_the_zygote(tmp_path):
    zygote, ended = Zygote.spawn(), None
    try:
        bad = zygote.start(["--no-such-option"], {}, str(tmp_path / "bad.log"))
        assert zygote.exit_code(bad, timeout=60) == 2  # argparse's usage error
        assert "required: --connect" in (tmp_path / "bad.log").read_text()  # the log is its stderr
        # a device with nobody to talk to waits for its server: killed, it reports the signal
        args = ["--connect", "tcp://127.0.0.1:9", "--parent-pid", str(os.getpid())]
        waiting = zygote.start(args, {"OMP_NUM_THREADS": "1"}, str(tmp_path / "wait.log"))
        assert zygote.exit_code(waiting, timeout=1) is None
        assert os.getsid(waiting) == waiting  # a session of its own: Ctrl-C is not its to get
        os.kill(waiting, signal.SIGKILL)
        assert zygote.exit_code(waiting, timeout=60) == -signal.SIGKILL
    finally:
        ended = zygote.close()
    assert ended == 0  # it ended at EOF, not killed


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_flt_the_zygote_is_a_fork_of_the_emulator(tmp_path):
    """Forked, not executed: the zygote is a copy of the emulator (its title says so, and
    it shares the emulator's pages of torch), so torch's pages are the server's too;
    devices are its children."""
    proc = fedavg_running(tmp_path)
    try:
        kids = _children(proc.pid)
        assert len(kids) == 1, kids  # the zygote alone: no fork server, no resource tracker
        (zygote,) = kids
        assert _cmdline(zygote).startswith(f"flt zygote (a fork of pid {proc.pid}, ".encode())
        assert _shared_dirty_mb(proc.pid) > 50  # pages the emulator shares: only a fork of it can
        assert len(_children(zygote)) == 2  # the quickstart's two devices
    finally:  # devices and zygote end with it (test_processes.py); Ctrl-C: test_end_to_end.py
        proc.kill()
        proc.wait(timeout=60)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _shared_dirty_mb(pid: int) -> float:
    """Written pages this process shares with another (after a fork: its parent's)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Shared_Dirty:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()
