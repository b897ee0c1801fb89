"""End to end through the real CLI: a server and device processes over loopback sockets."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flt_command import flt, flt_popen, flt_run, free_port  # tests/ is on sys.path under pytest

from flt.scenarios.partition import Partition
from flt.server.routing import host_blocks

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"

pytestmark = pytest.mark.slow  # every test here runs the CLI with device processes


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fedavg")
    res = flt_run(
        str(QUICKSTART),
        str(out),
        "methods=[fedavg]",
        "train.rounds=8",
        "devices.processes=3",
    )
    assert res.returncode == 0, res.stderr + res.stdout
    return out, res


def test_fedavg_learns_over_three_device_processes(fedavg_run):
    out, res = fedavg_run
    m = summary(out)["methods"]["fedavg"]
    assert m["final_accuracy"] > 30.0, m  # chance is 10 % on ten digits
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["dev-0.log", "dev-1.log", "dev-2.log"]
    assert "dev-0: hosting" in (out / "logs" / "dev-0.log").read_text()  # each device logs what it does
    assert all(code == 0 for code in summary(out)["timing"]["device_exit_codes"].values())
    assert "round   8/8" in res.stdout


def test_fedavg_model_bytes_equal_the_formula(fedavg_run):
    out, _ = fedavg_run
    m = summary(out)["methods"]["fedavg"]
    rounds, rho, clients = 8, 0.5, 20
    w_local = m["model_bytes"]
    assert w_local == 4 * (784 * 200 + 200 + 200 * 10 + 10)
    model = m["bytes_payload"]["up"]["model"] + m["bytes_payload"]["down"]["model"]
    assert model == 2 * rho * clients * w_local * rounds
    assert m["bytes_vs_formula"] == 1.0
    # evaluation traffic and headers are counted, but separately from the formula
    assert m["bytes_payload"]["down"]["evaluation"] == clients * w_local * rounds
    assert 0 < m["bytes_overhead"]["up"] < 0.01 * m["bytes_payload"]["up"]["model"]


def test_run_folder_holds_config_partition_metrics_and_plot(fedavg_run):
    out, _ = fedavg_run
    for name in ("config.yaml", "partition.npz", "summary.json", "convergence.png", "fedavg/metrics.jsonl"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 9))
    assert all({"acc_mean", "acc_se", "acc_var", "bytes"} <= set(r) for r in rows)


def hosted(run_dir: Path, n_clients: int, n_devices: int) -> list[list[int]]:
    """The clients each device hosted (balanced by training samples, server/routing.py)."""
    sizes = Partition.load(run_dir / "partition.npz").train_sizes[:n_clients]
    return [b.tolist() for b in host_blocks(np.arange(n_clients), sizes, n_devices)]


def test_same_seed_gives_the_same_run(fedavg_run, tmp_path):
    out, _ = fedavg_run
    res = flt_run(
        str(QUICKSTART),
        str(tmp_path),
        "methods=[fedavg]",
        "train.rounds=8",
        "devices.processes=3",
    )
    assert res.returncode == 0, res.stderr
    a = [json.loads(x)["acc_mean"] for x in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["acc_mean"] for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert a == b


def test_a_device_that_dies_mid_round_does_not_hang_the_server(tmp_path):
    res = flt_run(
        str(QUICKSTART),
        str(tmp_path),
        "methods=[fedavg]",
        "train.rounds=5",
        "devices.processes=2",
        "devices.crash={1: 3}",
    )
    assert res.returncode == 0, res.stderr
    s = summary(tmp_path)
    m = s["methods"]["fedavg"]
    assert m["lost_clients"] == hosted(tmp_path, 20, 2)[1]  # dev-1's, all of them
    assert "device dev-1 lost" in res.stderr
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    assert rows[2]["returned"] < rows[2]["selected"]  # round 3 finished without dev-1's clients
    assert all(r["n_eval"] == 10 for r in rows[2:])  # only dev-0's clients are evaluated after
    assert s["timing"]["device_exit_codes"]["dev-1"] == 3


def test_a_diverging_learning_rate_is_named_and_its_updates_left_out(tmp_path):
    """lr 1e9 makes the clients' loss NaN in round 1: an honest device's update, but one
    that would poison the average. It is left out, and the log and the last line say why
    in terms of the setting to change."""
    res = flt_run(str(QUICKSTART), str(tmp_path), "methods=[fedavg]", "train.rounds=1", "train.lr=1e9")
    assert res.returncode == 0, res.stderr
    assert "local training diverged (a smaller train.lr may help)" in res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("rejected ") and "non-finite update" in last, last
    row = json.loads((tmp_path / "fedavg" / "metrics.jsonl").read_text())
    rejected = summary(tmp_path)["rejected"]["rejected_reasons"]["non-finite update"]["messages"]
    assert rejected >= 1 and row["returned"] == row["selected"] - rejected  # how many overflow is chaotic


def test_a_crash_round_that_gives_the_device_no_work_crashes_it_at_its_next_task(tmp_path):
    """Seed 0, 4 devices, 2 clients drawn a round: none of dev-1's is drawn in round 2, so
    `crash={1: 2}` once crashed nothing at all."""
    res = flt_run(
        str(QUICKSTART),
        str(tmp_path),
        "methods=[fedavg]",
        "train.rounds=6",
        "train.participation=0.1",
        "devices.processes=4",
        "devices.crash={1: 2}",
    )
    assert res.returncode == 0, res.stderr
    assert summary(tmp_path)["methods"]["fedavg"]["lost_clients"] == hosted(tmp_path, 20, 4)[1]
    assert "injected crash in round 3" in (tmp_path / "logs" / "dev-1.log").read_text()
    # the server's warning about it outlives the terminal: in run.log, between its start and end
    log = (tmp_path / "run.log").read_text().splitlines()
    assert "INFO flt.run: started: flt run" in log[0] and log[-1].endswith("INFO flt.run: finished"), log
    assert log[1].endswith("INFO flt.run: data: digits"), log  # shown before the folder existed
    assert any("ERROR flt.server: device dev-1 lost" in line for line in log[1:-1]), log


def test_newcomers_and_drift_go_on_after_a_device_dies(tmp_path):
    """dev-0 dies in round 5 with its 10 clients; newcomers arrive in round 10 and clients
    0-2 (0 is dev-0's) drift in round 18. Waiting for the newcomer's device once named the dead one
    ("exited before connecting") and ended the run, and undoing the drift sent to it."""
    res = flt_run(
        str(REPO / "scenarios" / "dynamic_digits.yaml"),
        str(tmp_path),
        "methods=[fedavg]",
        "train.rounds=20",
        "devices.crash={0: 5}",
    )
    assert res.returncode == 0, res.stderr
    assert "5 newcomers joined" in res.stdout and "data drift" in res.stdout
    s = summary(tmp_path)
    lost = hosted(tmp_path, 20, 2)[0]  # the 20 clients present from round 1 on 2 devices
    assert s["methods"]["fedavg"]["lost_clients"] == lost and 0 in lost
    assert s["methods"]["fedavg"]["rounds"] == 20
    codes = s["timing"]["device_exit_codes"]
    assert codes["dev-0"] == 3 and codes["dev-1"] == 0 and list(codes.values()).count(0) == len(codes) - 1


def test_a_newcomer_device_starts_local_models_from_the_initial_weights(tmp_path):
    """Newcomers arrive in round 10 on a new device process. Local evaluates each client's
    model on its device, and the new device had never been given the run's initial
    weights (every device gets them when a method starts), so its clients' evaluation
    failed until each one was first selected to train."""
    res = flt_run(
        str(REPO / "scenarios" / "dynamic_digits.yaml"),
        str(tmp_path),
        "methods=[local]",
        "train.rounds=12",
        "population.drift=[]",
    )
    assert res.returncode == 0, res.stderr
    assert "5 newcomers joined" in res.stdout and "failed" not in res.stderr, res.stderr
    rows = [json.loads(x) for x in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [r["n_eval"] for r in rows[9:]] == [25, 25, 25]  # the 5 newcomers from their first round
    assert all(r["acc_newcomers"] is not None for r in rows[9:])


def test_a_batch_larger_than_every_shard_is_the_shard(tmp_path):
    """Devices pad each client's batches to the batch size: batches of 100,000 on shards of
    50 took 20 s a round where 50 takes 0.05. The run cuts the batch to the largest shard,
    says so, and trains exactly what batches of 50 train."""
    runs = {}
    for batch in (100_000, 50):
        out = tmp_path / str(batch)
        res = flt_run(
            str(QUICKSTART),
            str(out),
            "methods=[fedavg]",
            "train.rounds=3",
            f"train.batch_size={batch}",
        )
        assert res.returncode == 0, res.stderr
        runs[batch] = (res.stdout, (out / "fedavg" / "metrics.jsonl").read_text().splitlines())
    assert "train.batch_size 100000 is larger than every client's shard: batches of 50" in runs[100_000][0]
    cut, asked = ([json.loads(r) for r in rows] for _, rows in (runs[100_000], runs[50]))
    for r in cut + asked:
        del r["timing"]  # wall-clock figures: the only field that may differ
    assert cut == asked and len(cut) == 3 and cut[-1]["acc_mean"] > 0


def test_a_run_whose_every_device_dies_stops_with_exit_3_and_keeps_its_rounds(tmp_path):
    res = flt_run(
        str(QUICKSTART),
        str(tmp_path),
        "methods=[fedavg, flt]",
        "train.rounds=8",
        "devices.processes=2",
        "devices.crash={0: 2, 1: 2}",
    )
    assert res.returncode == 3, res.stderr
    assert "every device is lost" in res.stderr and "dev-0" in res.stderr and "dev-1" in res.stderr
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert 2 <= len(rows) < 8 and rows[-1]["returned"] == 0  # no empty rounds after the last device died
    assert summary(tmp_path)["methods"]["fedavg"]["rounds"] == len(rows)
    assert not (tmp_path / "flt").exists()  # the next method did not start with no devices


def stop_after_three_rounds(out: Path, signum: int, times: int = 1) -> tuple[subprocess.Popen, str, Path]:
    """A long FedAvg run on the quickstart, sent `signum` (`times` times, 50 ms apart) once
    3 rounds are recorded; returns the process (ended), its stderr and its metrics file."""
    import signal
    import time

    proc = flt_popen(
        "run", str(QUICKSTART), "--set", "methods=[fedavg]", "--set", "train.rounds=100000", "--out", str(out),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell without job control starts background jobs with SIGINT ignored (POSIX), and
        # the child would inherit that: give it the default a terminal's Ctrl-C meets
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    metrics = out / "fedavg" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.5)
    for i in range(times):
        time.sleep(0.05 * (i > 0))
        proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # the whole stderr, not the repr's first and last lines
        proc.kill()
        pytest.fail(f"the run did not stop within 60 s of the signal; its stderr:\n{proc.communicate()[1]}")
    return proc, err, metrics


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_cleanly_and_keeps_the_rounds_done(tmp_path, presses):
    """Pressed twice (an impatient user), the second Ctrl-C came while the run closed: the
    devices were never told to shut down (they left when they found the server gone) and
    the summary lost its last write (`timing`, the rejected messages)."""
    import signal

    proc, err, metrics = stop_after_three_rounds(tmp_path, signal.SIGINT, presses)
    assert proc.returncode == 130 and "interrupted" in err
    assert len(metrics.read_text().splitlines()) >= 3
    codes = json.loads((tmp_path / "summary.json").read_text())["timing"]["device_exit_codes"]
    assert codes == {"dev-0": 0, "dev-1": 0}  # devices were told to shut down and did


def test_sigterm_stops_like_ctrl_c_and_keeps_the_rounds_done(tmp_path):
    """kill (or a batch scheduler's time limit) ended the server at once: no shutdown sent
    to the devices, no last line. Now it stops as Ctrl-C does, with the shell's code 143."""
    import signal

    proc, err, metrics = stop_after_three_rounds(tmp_path, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert f"terminated: results so far are in {tmp_path}; `flt run --resume {tmp_path}` continues" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["methods"]["fedavg"]["rounds"] == len(metrics.read_text().splitlines()) >= 3
    assert summary["timing"]["device_exit_codes"] == {"dev-0": 0, "dev-1": 0}  # told to shut down
    assert (tmp_path / "run.log").read_text().splitlines()[-1].endswith("INFO flt.run: stopped: terminated")


def flt_patched(patch: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`flt ARGV` in a fresh process that first runs the Python code `patch`."""
    import sys

    script = f"{patch}\nimport sys\nfrom flt.emulator.cli import main\nsys.exit(main({argv!r}))\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)


def flt_stopped_in(module: str, function: str, argv: list[str], signal: str = "SIGTERM") -> subprocess.CompletedProcess:
    """`flt ARGV` in a fresh process that sends itself `signal` when `module.function` is
    called (instead of calling it): a stop at a chosen point of a real command."""
    patch = (
        "import os, signal, importlib\n"
        f"setattr(importlib.import_module({module!r}), {function!r}, "
        f"lambda *a, **k: os.kill(os.getpid(), signal.{signal}))"
    )
    return flt_patched(patch, argv)


def test_a_run_stopped_while_its_data_loads_says_there_is_nothing_to_resume(tmp_path):
    """A stop before the run folder is ready (here: SIGTERM while the data loads) claimed
    that "results so far are in the run folder", though there was none to resume."""
    out = tmp_path / "run"
    proc = flt_stopped_in("flt.emulator.run", "load_data", ["run", str(QUICKSTART), "--out", str(out)])
    assert proc.returncode == 143, proc.stderr
    assert "terminated before the run folder was ready: nothing to resume" in proc.stderr
    assert "results so far" not in proc.stderr and not out.exists()


STOP_ONCE_DEVICES_LOGGED = """
import os, signal, time
from pathlib import Path
import flt.emulator.session as session
from flt.emulator.processes import DeviceFleet

def stop_once_logged(logs, marker):  # what the devices sent then is on the server's socket, unread
    while not all(log.exists() and marker in log.read_text() for log in logs):
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)

def wait(self, transport, timeout_s):  # a device logs "connecting to" right after its hello
    for pid in [self.forks.pid, *(proc.pid for proc in self.procs.values())]:  # the zygote and devices
        caught = int(dict(line.split(":\t") for line in open(f"/proc/{pid}/status"))["SigCgt"], 16)
        print("catches SIGTERM:", pid, bool(caught >> (signal.SIGTERM - 1) & 1))
    stop_once_logged([self.log_dir / f"{name}.log" for name in self.procs], "connecting to")

def await_ready(transport, expected, timeout_s):  # ... and "hosting" right before its ready
    stop_once_logged([Path(LOGS) / f"{name}.log" for name in expected], "hosting")

if STOP == "hello":
    DeviceFleet.wait = wait
else:
    session._await_ready = await_ready
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("stop", ["hello", "ready"])
def test_what_its_own_devices_sent_as_a_run_stopped_is_counted_apart(tmp_path, stop):
    """Stopped while its device processes started, or while they loaded their clients (before
    their hellos, or their `ready`, were read), a run warned of its own devices as
    `rejected (hello mid-run)` or `(stale)` and counted them with a stray peer's
    messages: hellos were expected only while waiting for devices by hand, and `ready`
    never. The command now takes SIGTERM before it forks its device zygote: the zygote and
    the devices must still leave SIGTERM to the default (killed, not a Python exception)."""
    out = tmp_path / "run"
    patch = f"STOP, LOGS = {stop!r}, {str(out / 'logs')!r}\n{STOP_ONCE_DEVICES_LOGGED}"
    proc = flt_patched(patch, ["run", str(QUICKSTART), "--out", str(out)])
    assert proc.returncode == 143 and "WARNING" not in proc.stderr, proc.stderr
    rejected = summary(out)["rejected"]["rejected_reasons"]
    assert rejected == {"after the interrupt": {"messages": 2, "bytes": rejected["after the interrupt"]["bytes"]}}
    catches = [line for line in proc.stdout.splitlines() if line.startswith("catches SIGTERM:")]
    assert len(catches) == (3 if stop == "hello" else 0) and all(line.endswith("False") for line in catches), catches


def test_a_stop_while_the_command_imports_torch_is_one_line(tmp_path):
    """Ctrl-C in the seconds the command spends importing torch and the rest (before any
    work) ended it with a KeyboardInterrupt traceback, or, inside torch's C++ import, with
    an abort ("terminate called after throwing an instance of pybind11::error_already_set")."""
    out = tmp_path / "run"
    argv = ["run", str(QUICKSTART), "--out", str(out)]
    proc = flt_stopped_in("flt.emulator.processes", "preload", argv, signal="SIGINT")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted: nothing was computed (the command was starting)"
    assert not out.exists()


def test_flt_relate_stopped_mid_way_says_so_in_one_line_and_stops_its_devices(tmp_path):
    """Ctrl-C or SIGTERM during `flt relate` ended it with a KeyboardInterrupt traceback
    and exit 1 (the command line caught the stop for `run` and `compare` only)."""
    out = tmp_path / "relate"
    argv = ["relate", str(QUICKSTART), "--no-umap", "--out", str(out)]
    proc = flt_stopped_in("flt.emulator.relate", "write_artifacts", argv)  # after FCR, devices up
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "terminated: `flt relate` has nothing to resume; run it again"
    assert "2 device processes host 20 clients" in proc.stdout and not (out / "relate.json").exists()
    logs = [(out / "logs" / f"dev-{i}.log").read_text() for i in (0, 1)]
    assert all(": shutdown" in log for log in logs), logs


def test_ctrl_c_in_flt_report_and_in_a_device_started_by_hand_is_one_line(tmp_path, fedavg_run):
    """Ctrl-C in `flt report` or in `flt device` (the way to stop a device started by
    hand) ended them with a KeyboardInterrupt traceback."""
    import signal
    import time

    argv = ["report", str(fedavg_run[0]), "--out", str(tmp_path / "report")]
    proc = flt_stopped_in("flt.reports.html", "build", argv, signal="SIGINT")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted: the report is unfinished; run the command again"

    device = flt_popen(
        "device", "--connect", f"tcp://127.0.0.1:{free_port()}", "--name", "by-hand",
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert device.stderr is not None
    assert any("by-hand: connecting to" in line for line in device.stderr)  # up, waiting for no server
    time.sleep(0.5)
    device.send_signal(signal.SIGINT)
    err = device.communicate(timeout=60)[1]
    assert device.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted: the device left its server"


def test_a_sigterm_after_the_command_is_done_ends_the_process_without_a_traceback(tmp_path):
    """Stop's handler stayed installed after `main` returned, so a SIGTERM while the
    process exited (zmq's atexit clean-up) printed a Terminated traceback."""
    import sys

    script = (
        "import os, signal, sys\n"
        "from flt.emulator.cli import main\n"
        f"code = main(['run', '--resume', {str(tmp_path)!r}])\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == -15 and "Traceback" not in proc.stderr, proc.stderr
    assert "no config.yaml" in proc.stderr  # main ran: refused the folder with one line


def test_a_device_started_by_hand_joins_over_tcp(tmp_path):
    """The path to real edge devices: one local device process plus one started by hand
    with `flt device --connect`, as on another host. An external device means CURVE by
    default, on loopback too, so the README's way: keys first."""
    import time

    keys = tmp_path / "keys"
    assert flt("keys", str(keys), "--devices", "1").returncode == 0

    port = free_port()  # for the server to bind
    run = flt_popen(
        "run",
        str(QUICKSTART),
        "--set",
        "methods=[fedavg]",
        "--set",
        "train.rounds=4",
        "--set",
        "devices.processes=1",
        "--set",
        "devices.external=1",
        "--set",
        f"devices.bind=tcp://127.0.0.1:{port}",
        "--set",
        f"devices.keys={keys}",
        "--out",
        str(tmp_path / "run"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    by_hand = flt_popen(
        "device",
        "--connect",
        f"tcp://127.0.0.1:{port}",
        "--key",
        str(keys / "edge-0.key_secret"),
        "--server-key",
        str(keys / "server.key"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert "waiting for 1 external device(s)" in out
    by_hand.wait(timeout=60)
    assert by_hand.returncode == 0  # the server told it to shut down
    # a device started by hand holds only its own clients' shards (no routing to or from it)
    said = by_hand.stderr.read()
    assert "hosting 10 clients (shards of 10)" in said
    assert f"edge-0: connecting to tcp://127.0.0.1:{port} (waiting for the server)" in said  # before anything else
    assert summary(tmp_path / "run")["security"]["mechanism"] == "curve"  # devices.security: auto
    m = summary(tmp_path / "run")["methods"]["fedavg"]
    assert m["rounds"] == 4 and m["final_accuracy"] is not None and not m["lost_clients"]
    assert m["selections"] == m["rounds"] * 10  # every selected client answered, both devices' too


def test_every_method_runs_over_real_processes_and_matches_its_byte_formula(tmp_path):
    names = ["fedavg", "fedprox", "local", "pca_km_hc", "ifca", "fedsem", "cfl", "fedgroup", "pacfl", "oracle", "flt"]
    res = flt(
        "compare", str(QUICKSTART), "--methods", ",".join(names), "--set", "train.rounds=3", "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    methods = summary(tmp_path)["methods"]
    assert list(methods) == names
    for name, m in methods.items():
        assert m["final_accuracy"] is not None and m["rounds"] == 3, name
        assert abs(m["bytes_vs_formula"] - 1.0) < 0.01, (name, m["expected"], m["formula_payload_bytes"])
    w, sel = methods["ifca"]["model_bytes"], methods["ifca"]["selections"]
    assert methods["ifca"]["bytes_payload"]["down"]["model"] == 5 * w * sel  # C models to each
    assert methods["ifca"]["bytes_payload"]["up"]["model"] == w * sel
    assert methods["local"]["bytes_payload"]["up"]["model"] == 0
    for line in ("method", "fedavg", "ifca", "flt"):
        assert line in res.stdout


def _table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the final table for the quickstart's two methods: method -> its cells."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(("fedavg ", "flt "))}


def _readme_rows() -> dict[str, list[str]]:
    """The quickstart table the README shows."""
    text = (REPO / "README.md").read_text()
    return _table_rows(text.split("The quickstart ends with a table", 1)[1].split("```", 2)[1])


def test_the_readme_quickstart_table_is_what_the_command_prints(tmp_path):
    """The README's main job, as written (no --set): its table must not drift from the
    code (FLT's bytes did once, by 0.11 MB). Accuracy within 2 points and bytes within
    0.02 MB, so another machine's float rounding does not fail it; clusters and ARI exactly."""
    res = flt("run", str(QUICKSTART), "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    readme = _readme_rows()
    got = _table_rows(res.stdout)
    assert set(got) == set(readme) == {"fedavg", "flt"}
    for method, cells in readme.items():
        ours = got[method]
        for col in range(4):  # final acc, s.e., variance, best
            tolerance = 50.0 if col == 2 else 2.0  # variance is in %^2
            assert abs(float(ours[col]) - float(cells[col])) <= tolerance, (method, col, ours, cells)
        for col in (4, 5, 6):  # up MB, down MB, overhead MB: headers carry floats, a few bytes each
            assert float(ours[col]) == pytest.approx(float(cells[col]), abs=0.02), (method, col, ours, cells)
        assert ours[7:10] == cells[7:10], (method, ours, cells)  # vs formula, clusters, ARI
