"""devices.launcher: ray: device processes as Ray actors on a local Ray instance, end to end
through the real CLI (the server connects to the test's Ray cluster by its address)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flt_command import flt_popen  # tests/ is on sys.path under pytest

from flt.common.keys import make_keys
from flt.common.schema import ConfigError
from flt.emulator import config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
TINY = ("--set", "methods=[fedavg]", "--set", "train.rounds=2", "--set", "devices.processes=2")


def flt(*args: str, prelude: str = "pass", timeout: float = 600) -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}; from flt.emulator.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_launcher_ray_without_ray_names_the_field_and_the_install_command(tmp_path):
    # sys.modules["ray"] = None makes `import ray` fail as it does where ray is not installed
    res = flt(
        "run",
        str(QUICKSTART),
        *TINY,
        "--set",
        "devices.launcher=ray",
        "--out",
        str(tmp_path / "run"),
        prelude="sys.modules['ray'] = None",
    )
    assert res.returncode == 2, res.stderr
    assert "devices.launcher: ray needs the ray package" in res.stderr
    assert "pip install 'flt-emulator[ray]'" in res.stderr
    assert not (tmp_path / "run").exists()  # refused before any folder or process exists


def test_ray_address_without_the_ray_launcher_is_refused():
    with pytest.raises(ConfigError, match=r"devices.ray_address: only used with devices.launcher: ray"):
        config.load(QUICKSTART, ["devices.ray_address=auto"])


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'flt-emulator[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def device_actors() -> set[int]:
    """Pids of this machine's device actors (Ray titles a worker by its actor class)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::DeviceHost"):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_ray_actors_give_the_local_launchers_results_over_curve(ray_address, tmp_path):
    keys = tmp_path / "keys"
    make_keys(keys)  # devices.keys: the server's key pair from `flt keys`; each actor gets its own
    common = (*TINY, "--set", "devices.bind=tcp://0.0.0.0:*", "--set", f"devices.keys={keys}")
    local = flt("run", str(QUICKSTART), *common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    ray = flt(
        "run",
        str(QUICKSTART),
        *common,
        "--set",
        "devices.launcher=ray",
        "--set",
        f"devices.ray_address={ray_address}",
        "--out",
        str(tmp_path / "ray"),
    )
    assert ray.returncode == 0, ray.stderr
    a, b = summary(tmp_path / "local"), summary(tmp_path / "ray")
    for key in ("final_accuracy", "final_se", "final_variance", "bytes_up", "bytes_down", "lost_clients"):
        assert a["methods"]["fedavg"][key] == b["methods"]["fedavg"][key], key
    assert b["security"]["mechanism"] == "curve" and b["security"]["refused_hellos"] == {}
    assert b["timing"]["device_exit_codes"] == {"dev-0": 0, "dev-1": 0}
    for name in ("dev-0", "dev-1"):  # each actor's log comes back to the run folder
        assert "hosting 10 clients" in (tmp_path / "ray" / "logs" / f"{name}.log").read_text()
    wait_until(lambda: not device_actors(), 30, "the finished run's actors to exit")


@pytest.mark.slow
def test_a_dead_actor_is_a_lost_device_and_the_actors_die_with_the_server(ray_address, tmp_path):
    out = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as err:
        server = flt_popen(
            "run",
            str(QUICKSTART),
            *TINY,
            "--set",
            "train.rounds=100000",
            "--set",
            "devices.crash={1: 2}",
            "--set",
            "devices.launcher=ray",
            "--set",
            f"devices.ray_address={ray_address}",
            "--out",
            str(out),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        metrics = out / "fedavg" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 300, "round 3")
        assert "device dev-1 lost" in (tmp_path / "stderr").read_text()
        assert len(device_actors()) == 1  # dev-1's actor process is gone; dev-0 serves on
        server.send_signal(signal.SIGKILL)  # no shutdown message: only Ray's fate sharing ends dev-0
        server.wait()
        wait_until(lambda: not device_actors(), 30, "the dead server's actors to exit")
    finally:
        if server.poll() is None:
            server.kill()
