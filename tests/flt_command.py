"""The `flt` command as the tests run it: a child process with its output captured."""

from __future__ import annotations

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
