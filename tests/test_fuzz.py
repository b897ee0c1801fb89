"""Fuzzing a real run on loopback: the quickstart (digits, 2 device processes, FedAvg)
while a hostile peer (tests/fuzz_peer.py) sends random and mutated frames and the
crafted cases of issue 9. The run must complete, count every message the peer sent by
reason, and report exactly what a clean run with the same seed reports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flt_command import free_port  # tests/ is on sys.path under pytest

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 16  # long enough after round 1 for the server to read all the peer sends
# wall-clock by nature, and the rejection counts, which are the point of the fuzzed run
UNEQUAL = {
    "timing",
    "train_s",
    "eval_s",
    "wall_s",
    "setup_s",
    "s_per_round",
    "eval_s_per_round",
    "rejected_messages",
    "rejected_bytes",
    "rejected_reasons",
}


def _run(out: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flt.emulator.cli",
            "run",
            str(REPO / "scenarios" / "quickstart.yaml"),
            "--set",
            "methods=[fedavg]",
            "--set",
            f"train.rounds={ROUNDS}",
            "--set",
            f"devices.bind=tcp://127.0.0.1:{port}",
            "--out",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _results(out: Path) -> tuple[dict, list[dict]]:
    method = json.loads((out / "summary.json").read_text())["methods"]["fedavg"]
    rows = [json.loads(line) for line in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda d: {k: v for k, v in d.items() if k not in UNEQUAL}  # noqa: E731
    return strip(method), [strip(r) for r in rows]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    out, port = tmp_path_factory.mktemp("fuzzed"), free_port()
    report = out.parent / "fuzz_report.json"
    run = _run(out, port)
    peer = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "fuzz_peer.py"),
            f"tcp://127.0.0.1:{port}",
            str(report),
            "--after",
            str(out / "fedavg" / "metrics.jsonl"),
            "--random",
            "1000",
            "--mutated",
            "1000",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log, _ = run.communicate(timeout=600)
    peer_log, _ = peer.communicate(timeout=120)
    assert run.returncode == 0, log[-3000:]
    assert peer.returncode == 0, peer_log[-3000:]
    return out, json.loads(report.read_text()), log


@pytest.mark.slow
def test_a_fuzzed_run_completes_and_counts_every_message_by_reason(fuzzed):
    out, sent, _ = fuzzed
    rejected = json.loads((out / "summary.json").read_text())["rejected"]
    reasons = {r: v["messages"] for r, v in rejected["rejected_reasons"].items()}
    # the peer's messages and nothing else: the devices' own traffic is all accepted
    assert rejected["rejected_messages"] == sum(sent["expected"].values()) + sent["collision"]
    assert reasons["malformed"] == sent["expected"]["malformed"]
    # its updates (for clients no device hosts, and for dev-0's client under dev-0's name)
    # come from connections that never became devices
    assert reasons["unknown device"] == sent["expected"]["unknown device"] + sent["collision"] - 1
    assert sum(reasons.values()) == rejected["rejected_messages"]
    # frames over the inbound limit (50 MB hellos) are dropped by ZeroMQ, never read
    assert rejected["rejected_bytes"] < 40 << 20


@pytest.mark.slow
def test_a_fuzzed_run_reports_exactly_what_a_clean_run_reports(fuzzed, tmp_path):
    out, _, _ = fuzzed
    clean = _run(tmp_path, free_port())
    log, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, log[-3000:]
    fuzzed_summary, fuzzed_rows = _results(out)
    clean_summary, clean_rows = _results(tmp_path)
    assert fuzzed_rows == clean_rows  # accuracy and bytes, round by round
    assert fuzzed_summary == clean_summary
    assert json.loads((tmp_path / "summary.json").read_text())["rejected"]["rejected_messages"] == 0
