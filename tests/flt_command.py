"""The `flt` command as the tests run it: a child process with its output captured."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def results_without_timing(run_dir: Path) -> dict:
    """Every metrics.jsonl line and summary.json, minus the `timing` objects."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "timing"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    out = {
        p.parent.name: [strip(json.loads(line)) for line in p.read_text().splitlines()]
        for p in sorted(run_dir.glob("*/metrics.jsonl"))
    }
    out["summary"] = strip(json.loads((run_dir / "summary.json").read_text()))
    return out


def flt(*args: str, timeout: float = 900, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`flt ARGS...` from `cwd` (the repository by default), in a process of its own forked
    from a warm interpreter (tests/warm_cli.py: the command's imports are paid once per
    test session), with this process's environment; a run that outlives `timeout` is
    killed and fails the test instead of hanging it."""
    argv = [sys.executable, "-m", "flt.emulator.cli", *args]
    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX) as sock:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"argv": list(args), "cwd": str(cwd), "env": dict(os.environ), "stdout": str(out), "stderr": str(err)}
        sock.connect(_warm_server())
        sock.sendall(json.dumps(request).encode() + b"\n")
        sock.settimeout(timeout)
        replies = sock.makefile("rb")
        pid = json.loads(replies.readline())["pid"]
        try:
            code = json.loads(replies.readline())["code"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


_warm: tuple[subprocess.Popen, str] | None = None


def _warm_server() -> str:
    """The socket of this test session's warm interpreter, started on first use."""
    global _warm
    if _warm is None or _warm[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="flt-warm-")
        atexit.register(shutil.rmtree, folder, True)
        path = str(Path(folder, "cli.sock"))
        script = str(Path(__file__).with_name("warm_cli.py"))
        server = subprocess.Popen([sys.executable, script, path], stdout=subprocess.PIPE)
        if server.stdout is None or server.stdout.readline() != b"ready\n":
            raise RuntimeError(f"tests/warm_cli.py did not start (exit code {server.wait()})")
        atexit.register(server.kill)
        _warm = (server, path)
    return _warm[1]


def flt_run(
    scenario: Path | str, out: Path | str, *overrides: str, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`flt run SCENARIO --set O1 --set O2 ... --out OUT`, as `flt` runs it."""
    sets = [arg for o in overrides for arg in ("--set", o)]
    return flt("run", str(scenario), *sets, "--out", str(out), timeout=timeout)


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
