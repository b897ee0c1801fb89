"""The `flt` command as the tests run it: a child process with its output captured."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def flt(*args: str, timeout: float = 900, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`flt ARGS...` from `cwd` (the repository by default); a run that outlives `timeout`
    fails the test instead of hanging it."""
    return subprocess.run(
        [sys.executable, "-m", "flt.emulator.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def flt_popen(*args: str, **popen: object) -> subprocess.Popen:
    """`flt ARGS...` started in the background from the repository, for tests that signal,
    kill or talk to a running emulator; `popen` goes to subprocess.Popen (pipes, env, ...)."""
    return subprocess.Popen([sys.executable, "-m", "flt.emulator.cli", *args], cwd=REPO, **popen)  # type: ignore[call-overload]


def fedavg_running(out: Path, timeout: float = 300) -> subprocess.Popen:
    """A quickstart FedAvg run of 500 rounds in the background (quiet), returned once its
    first round is on disk: an emulator with its devices up, for tests that kill or inspect it."""
    import time

    args = ["run", str(QUICKSTART), "--set", "train.rounds=500", "--set", "methods=[fedavg]", "--out", str(out)]
    proc = flt_popen(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = out / "fedavg" / "metrics.jsonl", time.monotonic() + timeout
    while not metrics.exists() or not metrics.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run never reached round 1")
        time.sleep(0.05)
    return proc


def free_port() -> int:
    """A loopback port nobody listens on now, for a server the test binds itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
