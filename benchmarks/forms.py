"""Run each form of one computation in a process of its own, so that each peak RSS
(`ru_maxrss`, which only grows) is that form's own: bench_case1.py, bench_fedgroup_edc.py.

A benchmark script calls `run_forms` from its main; each child is the same script with
`--one FORM --save PATH` and the given arguments, and prints `seconds extra_gb` (`report`)."""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

LEAF_CNN_FEMNIST = 6_603_710  # parameters of the LEAF CNN with 62 classes: S3's model size


def child_options(ap: argparse.ArgumentParser, forms: tuple[str, ...]) -> None:
    """The hidden options `run_forms` gives each child."""
    ap.add_argument("--one", choices=forms, help=argparse.SUPPRESS)
    ap.add_argument("--save", type=Path, help=argparse.SUPPRESS)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def report(seconds: float, peak_before: float) -> None:
    """A child's one line: its seconds and how much its peak RSS grew during the call."""
    print(f"{seconds:.4f} {peak_gb() - peak_before:.4f}")


def run_forms(script: str, forms: tuple[str, ...], args: list[str], load: Callable[[Path], Any]) -> dict:
    """{form: (seconds, extra peak GB, load(the file the child saved))}, in order."""
    scratch = Path(tempfile.mkdtemp(prefix=Path(script).stem + "_"))
    try:
        out = {}
        for form in forms:
            save = scratch / form
            cmd = [sys.executable, script, "--one", form, "--save", str(save), *args]
            seconds, extra = map(float, subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split())
            out[form] = (seconds, extra, load(save))
        return out
    finally:
        shutil.rmtree(scratch)
