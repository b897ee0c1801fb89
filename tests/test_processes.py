"""Local device processes: forked from the zygote (the default) or executed afresh,
with the same results either way; and the heap setting every long-lived process applies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import pytest
from flt_command import fedavg_running
from test_end_to_end import QUICKSTART, flt  # tests/ is on sys.path under pytest

from flt.common.heap import limit_heap_retention
from flt.common.schema import ConfigError
from flt.emulator import config
from flt.emulator.processes import DeviceFleet
from flt.server.transport import Transport


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_forked_devices_run_in_sessions_of_their_own_and_are_watched(tmp_path):
    transport = Transport()
    fleet = DeviceFleet(transport.endpoint, tmp_path / "logs", start="forkserver")
    try:
        names = fleet.start(2)
        assert fleet.wait(transport, 60) == names
        pids = [fleet.procs[n].pid for n in names]
        assert all(os.getsid(p) == p for p in pids)  # Ctrl-C at the terminal reaches the emulator only
        assert len({_parent(p) for p in pids}) == 1 and _parent(pids[0]) != os.getpid()  # the zygote's
        assert all((tmp_path / "logs" / f"{n}.log").is_file() for n in names)
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while fleet.alive(names[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not fleet.alive(names[0]) and fleet.alive(names[1])
        assert fleet.exit_codes()[names[0]] == -signal.SIGKILL
    finally:
        transport.close()
        fleet.stop(grace_s=1)
    assert all(code is not None for code in fleet.exit_codes().values())  # none left behind


def test_an_unknown_start_method_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"devices\.start"):
        config.load(QUICKSTART, ["devices.start=thread"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_heap_setting_applies_on_glibc():
    assert limit_heap_retention() is True


@pytest.mark.slow  # two quickstart runs of 2 rounds
def test_forked_and_executed_devices_give_the_same_run(tmp_path):
    runs = {}
    for start in ("forkserver", "exec"):
        sets = ["--set", "train.rounds=2", "--set", "methods=[fedavg,flt]", "--set", f"devices.start={start}"]
        res = flt("run", str(QUICKSTART), *sets, "--out", str(tmp_path / start))
        assert res.returncode == 0, res.stderr[-2000:]
        runs[start] = [
            json.loads(line) for line in (tmp_path / start / "flt" / "metrics.jsonl").read_text().splitlines()
        ]
        for rec in runs[start]:
            rec.pop("timing")
    assert runs["forkserver"] == runs["exec"]


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # exited meanwhile
                kids.setdefault(_parent(int(entry)), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # one quickstart start-up
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_forked_devices_exit_when_the_emulator_is_killed(tmp_path):
    """No orphans: SIGKILL gives the emulator no chance to stop its devices; the zygote
    sees its parent go and exits, and each device sees the emulator go and exits."""
    proc = fedavg_running(tmp_path)
    family = _descendants(proc.pid)
    assert len(family) >= 3  # the zygote and 2 devices
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if _running(p)], "processes outlived the emulator"
