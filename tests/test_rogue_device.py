"""An external device that answers wrongly must not end a run (issue 25).

A real emulator (`flt run`, one local device process) and a rogue external device
(tests/rogue_device.py: the real device program, with one request of each kind answered
wrongly) talk over a real loopback socket. Each way of being wrong (no answer, a frame that
does not decode, well-formed but wrong content, an answer after the deadline) must leave a
finished run with every round on disk, the spoiled answers rejected and counted, and the
rogue's clients named in the log; a device that cannot load its clients is lost for the run
and the run goes on without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import numpy as np
import pytest
from flt_command import QUICKSTART, fedavg_running, flt_popen, free_port  # tests/ is on sys.path under pytest

from flt.common.schema import ConfigError
from flt.emulator.config import load
from flt.server.auth import gate_for, uses_curve
from flt.server.routing import host_blocks

ROGUE = Path(__file__).with_name("rogue_device.py")
ROUND_TIMEOUT_S = 2  # the embedding waits 4x this; the rogue has preloaded what a forked device has
# the second of two devices' clients: quickstart's 20 hold 50 training images each, so the
# hosts' blocks, balanced by samples, alternate in pairs (server/routing.py: host_blocks)
ROGUE_CLIENTS = host_blocks(np.arange(20), np.full(20, 50), 2)[1].tolist()


def rogue_sets(port: int, *sets: str) -> list[str]:
    """`--set` arguments: the quickstart with one local device and the rogue on `port`."""
    args = []
    for s in (
        "methods=[flt]",
        "train.rounds=2",
        "devices.processes=1",
        "devices.external=1",
        "devices.security=none",  # auto would want CURVE keys for an external device
        f"devices.bind=tcp://127.0.0.1:{port}",
        f"devices.round_timeout_s={ROUND_TIMEOUT_S}",
        *sets,
    ):
        args += ["--set", s]
    return args


def start_rogue(port: int, mode: str, spoil: str, times: int = 1) -> subprocess.Popen:
    args = ["--connect", f"tcp://127.0.0.1:{port}", "--name", "edge-1", "--mode", mode, "--spoil", spoil]
    return subprocess.Popen(
        [sys.executable, str(ROGUE), *args, "--times", str(times)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(run: subprocess.Popen, rogue: subprocess.Popen) -> tuple[subprocess.CompletedProcess, str]:
    """Wait for the emulator, then for the rogue (told to shut down, or killed)."""
    out_text, err_text = run.communicate(timeout=600)
    try:
        rogue_log, _ = rogue.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        rogue.kill()
        rogue_log, _ = rogue.communicate()
    return subprocess.CompletedProcess(run.args, run.returncode, out_text, err_text), rogue_log


def run_with_rogue(out: Path, mode: str, spoil: str, *sets: str) -> tuple[subprocess.CompletedProcess, str]:
    """FLT on the quickstart (2 rounds) with one local device and the rogue; returns the
    emulator's result and the rogue's log."""
    port = free_port()
    run = flt_popen(
        "run", str(QUICKSTART), *rogue_sets(port, *sets), "--out", str(out), stdout=PIPE, stderr=PIPE, text=True
    )
    return finish(run, start_rogue(port, mode, spoil))


def assert_finished_on_disk(out: Path, res: subprocess.CompletedProcess, rounds: int = 2) -> dict:
    """Exit 0, no traceback, every round's record and the last checkpoint written."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "flt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    assert all(np.isfinite(r["acc_mean"]) for r in records)
    assert (out / "flt" / "checkpoint.npz").exists()
    return json.loads((out / "summary.json").read_text())


SPOILED_KINDS = "centroids,state,update,metrics"  # embedding, checkpoint, training, evaluation

# what the server must count for each way of being wrong (each spoiled cohort: 5 or 10 clients)
EXPECTED_REASONS = {
    "malformed": {"malformed"},
    "wrong": {"bad centroids", "bad state", "bad model", "wrong evaluation totals"},
    "late": {"stale"},
    "missing": set(),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["missing", "malformed", "wrong", "late"])
def test_a_device_that_answers_each_request_wrongly_leaves_a_finished_run(tmp_path, mode):
    res, rogue_log = run_with_rogue(tmp_path, mode, SPOILED_KINDS)
    summary = assert_finished_on_disk(tmp_path, res)
    for kind in SPOILED_KINDS.split(","):
        assert f"rogue: {mode} {kind}" in rogue_log, (kind, rogue_log[-2000:])  # it did spoil each kind
    reasons = summary["rejected"]["rejected_reasons"]
    assert EXPECTED_REASONS[mode] <= set(reasons), reasons
    assert summary["rejected"]["rejected_messages"] >= (0 if mode == "missing" else 10)
    # the checkpoint after set-up was written without the rogue's state, naming its clients
    assert f"checkpoint after round 0: no valid device state from clients {ROGUE_CLIENTS}" in res.stderr
    assert "['edge-1']; written without it" in res.stderr
    if mode in ("missing", "late"):
        assert "did not answer within" in res.stderr  # and which clients, by id
    # the rogue was spoiled once per kind, and answered the rest: its clients still took part
    m = summary["methods"]["flt"]
    assert m["lost_clients"] == [] and m["rounds"] == 2


@pytest.mark.slow
def test_a_finite_update_too_large_to_average_is_rejected_not_averaged(tmp_path):
    """Weights of 1e37 passed the NaN check; weighed by 50 samples they overflow float32,
    and the rogue's clusters were left with infinite models (accuracy at chance)."""
    res, rogue_log = run_with_rogue(tmp_path, "huge", "update", "train.rounds=3")
    summary = assert_finished_on_disk(tmp_path, res, rounds=3)
    assert "rogue: huge update" in rogue_log
    assert summary["rejected"]["rejected_reasons"]["non-finite update"]["messages"] >= 1
    assert "past 1e+18: it would overflow the average" in res.stderr
    last = json.loads((tmp_path / "flt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["acc_mean"] > 60, last  # the quickstart's FLT after 3 rounds: about 90


@pytest.mark.slow
def test_centroids_too_large_for_any_encoder_are_rejected_and_the_rest_clustered(tmp_path):
    """Finite float32 centroids of 1e37 from the rogue's 10 clients made FCR's whitening
    see the 10 honest clients as one point: 2 clusters for their 3 (ARI 0.26); they are
    found again once those are left out."""
    res, rogue_log = run_with_rogue(tmp_path, "huge", "centroids")
    summary = assert_finished_on_disk(tmp_path, res)
    assert "rogue: huge centroids" in rogue_log
    assert summary["rejected"]["rejected_reasons"]["non-finite centroids"]["messages"] == len(ROGUE_CLIENTS)
    fcr = summary["methods"]["flt"]["fcr"]
    assert fcr["unassigned"] == ROGUE_CLIENTS
    planted = {c // 4 for c in range(20) if c not in ROGUE_CLIENTS}  # quickstart: 4 clients a cluster
    assert fcr["clusters"] == len(planted) and fcr["ari"] == pytest.approx(1.0), fcr


@pytest.mark.slow
def test_centroids_narrower_than_the_encoders_embedding_are_rejected_not_fatal(tmp_path):
    """Each client's centroids looked well-formed on their own; one column short of the
    encoder's width, they reached the server's set distance beside everyone else's."""
    res, rogue_log = run_with_rogue(tmp_path, "narrow", "centroids")
    summary = assert_finished_on_disk(tmp_path, res)
    assert "rogue: narrow centroids" in rogue_log
    assert "bad centroids" in summary["rejected"]["rejected_reasons"]
    assert summary["rejected"]["rejected_messages"] >= len(ROGUE_CLIENTS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["missing", "wrong"])
def test_a_device_that_cannot_load_its_clients_is_lost_and_the_run_goes_on(tmp_path, mode):
    """`ready` missing (late and malformed are the same to the server: no valid `ready`
    within the start-up timeout) or naming other clients."""
    res, _ = run_with_rogue(tmp_path, mode, "ready", "devices.start_timeout_s=20")
    summary = assert_finished_on_disk(tmp_path, res)
    assert "device edge-1 lost" in res.stderr and f"its 10 clients {ROGUE_CLIENTS}" in res.stderr, res.stderr[-2000:]
    assert summary["methods"]["flt"]["lost_clients"] == ROGUE_CLIENTS


@pytest.mark.slow
def test_a_run_ends_with_one_line_and_exit_3_when_no_device_can_load_its_clients(tmp_path):
    res, rogue_log = run_with_rogue(tmp_path, "wrong", "ready", "devices.processes=0")
    assert res.returncode == 3, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert "error: no device could load its clients (edge-1: said ready for clients" in res.stderr
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "partition.npz").exists()
    assert "shutdown" in rogue_log  # told to go, though it was lost


@pytest.mark.slow
def test_resume_says_which_clients_the_checkpoint_lacks(tmp_path):
    """Local, with a rogue that never reports its clients' state: killed, then resumed
    (with the rogue back), the run says whose device state it resumes without."""
    port, out = free_port(), tmp_path / "killed"
    sets = rogue_sets(port, "methods=[local]", "train.rounds=6")
    run = flt_popen("run", str(QUICKSTART), *sets, "--out", str(out), stdout=PIPE, stderr=PIPE, text=True)
    rogue = start_rogue(port, "missing", "state", times=1000)
    metrics, deadline = out / "local" / "metrics.jsonl", time.monotonic() + 300
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    for proc in (run, rogue):  # a killed server tells nobody to shut down
        proc.kill()
        proc.communicate(timeout=60)
    resumed = flt_popen("run", "--resume", str(out), stdout=PIPE, stderr=PIPE, text=True)
    res, _ = finish(resumed, start_rogue(port, "missing", "state", times=1000))
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(
        rf"after round \d+ lacks the device state of 10 client\(s\) {re.escape(str(ROGUE_CLIENTS))}", res.stdout
    )
    assert len(metrics.read_text().splitlines()) == 6


def test_security_auto_means_curve_whenever_external_devices_may_join(tmp_path):
    assert not uses_curve("tcp://127.0.0.1:*", "auto", external=0)  # the emulator's own devices only
    assert uses_curve("tcp://127.0.0.1:5555", "auto", external=1)
    assert uses_curve("tcp://0.0.0.0:5555", "auto", external=0)
    assert not uses_curve("tcp://127.0.0.1:5555", "none", external=1)  # said explicitly, on loopback
    gate = gate_for("tcp://127.0.0.1:*", "auto", None, external=0)
    assert not gate.curve
    scenario = tmp_path / "s.yaml"
    scenario.write_text(QUICKSTART.read_text())
    with pytest.raises(ConfigError, match=r"devices.keys: 1 external device\(s\) over CURVE need keys"):
        load(str(scenario), ["devices.external=1"])


@pytest.mark.slow
def test_device_processes_carry_a_title_that_names_them_and_their_run(tmp_path):
    out = tmp_path / "titled-run"
    proc = fedavg_running(out)
    try:
        titles = [_cmdline(p) for p in Path("/proc").iterdir() if p.name.isdigit()]
    finally:
        proc.kill()
        proc.wait(30)
    assert f"flt device dev-0 (run {out.name})" in titles, [t for t in titles if "flt" in t]
    assert f"flt device dev-1 (run {out.name})" in titles
    assert any(t.startswith("flt zygote (a fork of pid ") for t in titles)


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # gone meanwhile, or not ours to read
        return ""
