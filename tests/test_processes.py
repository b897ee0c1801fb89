"""Local device processes: forked from the zygote (the default) or executed afresh,
with the same results either way; and the heap setting every long-lived process applies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_tell_a_computing_process_from_a_waiting_one():
    from flt.emulator.processes import process_cpu_seconds

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # both started
        before = {p.pid: process_cpu_seconds(p.pid) for p in (busy, idle)}
        time.sleep(1.5)
        used = {p.pid: process_cpu_seconds(p.pid) - before[p.pid] for p in (busy, idle)}
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert used[busy.pid] >= 0.3 and used[idle.pid] < 0.05, used
    assert process_cpu_seconds(busy.pid) is None  # gone: nothing to read


@pytest.mark.slow  # two quickstart runs of 3 long rounds
def test_a_round_longer_than_the_timeout_drops_no_client_while_its_devices_compute(tmp_path):
    """devices.round_timeout_s was a hard wall-clock cut: on a loaded CPU a LEAF CNN round
    ran past 120 s and every client of the round was dropped, so the result depended on the
    machine's load. A device still computing is now waited for."""
    runs, logs = {}, {}
    for timeout in (1, 120):
        out = tmp_path / str(timeout)
        sets = ["train.rounds=3", "train.local_epochs=400", "methods=[fedavg]", f"devices.round_timeout_s={timeout}"]
        res = flt("run", str(QUICKSTART), *[a for s in sets for a in ("--set", s)], "--out", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        runs[timeout] = [json.loads(x) for x in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
        logs[timeout] = res.stderr
        assert all(r["returned"] == r["selected"] for r in runs[timeout])
        for rec in runs[timeout]:
            rec.pop("timing")
    assert "still computing after" in logs[1]  # the rounds did outlast the 1 s timeout
    assert runs[1] == runs[120]
