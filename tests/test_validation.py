"""Bad input stops a run with one line that names the file or field (exit 2), before any
run folder or process exists; a bug keeps its traceback (exit 1)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flt_command import flt, flt_popen  # tests/ is on sys.path under pytest

from flt.common.errors import FltError
from flt.common.schema import ConfigError
from flt.emulator import config
from flt.emulator.population import schedule_from
from flt.scenarios import partition as part
from flt.server.strategies import STRATEGIES

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
SHARED = REPO.parent / "shared" / "data"


def assert_one_line_error(res, code: int, *words: str) -> None:
    assert res.returncode == code, res.stderr + res.stdout
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)


# -- every float field refuses NaN and infinity --------------------------------------------


def float_fields(schema: dict, prefix: str = ""):
    for key, f in schema.items():
        path = f"{prefix}{key}"
        if f.schema is not None:
            yield from float_fields(f.schema, path + ".")
        elif float in (f.types if isinstance(f.types, tuple) else (f.types,)):
            yield path


def nested(path: str, value: str) -> str:
    """'encoder.lr', '.nan' -> 'encoder: {lr: .nan}' (YAML flow)."""
    head, _, rest = path.partition(".")
    return f"{head}: {value}" if not rest else f"{head}: {{{nested(rest, value)}}}"


SCENARIO_FLOATS = list(float_fields(config.SCENARIO))
METHOD_FLOATS = [(name, p) for name, cls in STRATEGIES.items() for p in float_fields(cls.PARAMS)]


def test_the_walk_finds_the_float_fields():
    assert {"train.lr", "train.participation", "partition.alpha", "devices.round_timeout_s"} <= set(SCENARIO_FLOATS)
    assert ("fedprox", "mu") in METHOD_FLOATS and ("flt", "encoder.lr") in METHOD_FLOATS


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_inf_are_refused_for_every_float_field(value):
    for path in SCENARIO_FLOATS:
        with pytest.raises(ConfigError, match=rf"{QUICKSTART}: {path}: expected a finite number"):
            config.load(QUICKSTART, [f"{path}={value}"])
    for name, path in METHOD_FLOATS:
        entry = f"{{name: {name}, {nested(path, value)}}}"
        with pytest.raises(ConfigError, match=rf"methods\[0\]\({name}\)\.{path}: expected a finite number"):
            config.load(QUICKSTART, [f"methods=[{entry}]"])


# -- an alias bomb costs nothing --------------------------------------------------------------


def alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine references, in one YAML flow list: 9**9 (387 million) strings
    once expanded, from under 500 bytes."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


BOMB_SITES = {
    "train.rounds": "train: {{rounds: {}}}\n",
    "name": "name: {}\n",
    "devices.crash": "devices: {{crash: {{0: {}}}}}\n",
    "methods": "methods: {}\n",
    "population.drift": "population: {{drift: [{{round: 2, clients: {}, to_cluster: 1}}]}}\n",
    "population.profiles": "population: {{profiles: {{distribution: {{compute: {{dist: constant, "
    "ms_per_sample: {}}}}}}}}}\n",
    "--set": "",
}


@pytest.mark.parametrize("site", BOMB_SITES)
def test_a_yaml_alias_bomb_gives_a_short_error_without_expanding(tmp_path, site):
    bomb = alias_bomb()
    assert len(bomb) < 500
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB_SITES[site].format(bomb) or "name: x\n")
    overrides = [f"population.newcomers={bomb}"] if site == "--set" else []
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as exc:
            config.load(path, overrides)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(str(exc.value)) < 400, len(str(exc.value))
    assert peak < 20e6, peak  # the full repr would take gigabytes
    assert str(path) in str(exc.value)


# -- sizes the data cannot give are refused before allocating ---------------------------------


def test_more_clients_than_samples_is_refused_before_allocating():
    y_train, y_test = np.repeat(np.arange(10), 100), np.repeat(np.arange(10), 20)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        with pytest.raises(part.PartitionError, match=r"partition.clients: 10000000 clients.*1000 samples"):
            part.partition_clusters(
                y_train,
                y_test,
                n_clients=10_000_000,
                n_clusters=5,
                classes_per_cluster=2,
                shared_classes=0,
                samples_per_client=10,
                test_per_client=5,
                rng=rng,
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5e6, peak
    with pytest.raises(part.PartitionError, match=r"partition\.samples_per_client: 2000"):
        part.partition_dirichlet(
            y_train, y_test, n_clients=2, alpha=0.5, samples_per_client=2000, test_per_client=5, rng=rng
        )
    with pytest.raises(part.PartitionError, match=r"partition\.classes_per_cluster: 1000000000 classes"):
        part.cluster_classes(5, 10**9, 10, 0)  # refused before a list of 10**9 classes exists
    with pytest.raises(part.PartitionError, match=r"partition\.test_per_client: 500"):
        part.partition_structured(
            y_train,
            y_test,
            n_clients=4,
            n_clusters=2,
            classes_per_cluster=2,
            alpha=1.0,
            delta=0.5,
            test_per_client=500,
            rng=rng,
        )


# -- newcomer and drift schedules -------------------------------------------------------------


@pytest.mark.parametrize(
    "pop, words",
    [
        ({"newcomers": [{"round": 3, "cluster": 7}]}, ["newcomers[0].cluster", "0..4"]),
        ({"newcomers": [{"round": 3, "clients": [1, 99]}]}, ["newcomers[0].clients", "0..19"]),
        ({"newcomers": [{"round": 3, "clients": [1, 1]}]}, ["newcomers[0].clients", "distinct"]),
        ({"drift": [{"round": 3, "clients": [0], "to_cluster": 9}]}, ["drift[0].to_cluster", "0..4"]),
        (
            {"drift": [{"round": 3, "clients": [0], "kind": "swap_labels", "labels": [1, 1]}]},
            ["drift[0].labels", "two different"],
        ),
        ({"drift": [{"round": 3, "clients": "all", "to_cluster": 1}]}, ["drift[0].clients"]),
        ({"drift": [{"round": 3, "clients": [0], "kind": "shuffle"}]}, ["drift[0].kind", "resample", "'shuffle'"]),
        ({"drift": [{"round": 3, "clients": [0], "kind": "resample", "to_cluster": 1}]}, ["drift[0]", "to_cluster"]),
    ],
)
def test_bad_schedules_are_refused_by_validation(tmp_path, pop, words):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"population": pop, "train": {"rounds": 5}}))
    with pytest.raises(ConfigError) as exc:
        config.load(path)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_each_drift_event_needs_only_its_own_kinds_fields(tmp_path):
    """A move's to_cluster was carried on to every later event: a move then a resample was
    refused with 'drift[1].to_cluster: required field is missing'."""
    import yaml

    path = tmp_path / "s.yaml"
    drift = [{"round": 3, "clients": [0], "to_cluster": 1}, {"round": 3, "clients": [4], "kind": "resample"}]
    path.write_text(yaml.safe_dump({"population": {"drift": drift}, "train": {"rounds": 5}}))
    assert [ev.get("kind", "move") for ev in config.load(path)["population"]["drift"]] == ["move", "resample"]


def test_schedules_are_checked_against_the_partition():
    truth = np.repeat(np.arange(5), 4)
    cfg = {
        "population": {
            "newcomers": [{"round": 3, "cluster": 4}],
            "drift": [{"round": 4, "clients": [0, 1], "to_cluster": 4}],
        }
    }
    with pytest.raises(ConfigError, match=r"drift\[0\]: cluster 4 has 0 clients free"):
        schedule_from(cfg, truth)  # cluster 4 is still away when its members should swap
    with pytest.raises(ConfigError, match=r"drift\[0\]: clients \[5\] are in cluster 1 already.*kind: resample"):
        schedule_from({"population": {"drift": [{"round": 4, "clients": [0, 5], "to_cluster": 1}]}}, truth)
    with pytest.raises(ConfigError, match=r"newcomers\[0\].cluster: no client belongs to cluster 4"):
        schedule_from({"population": {"newcomers": [{"round": 3, "cluster": 4}]}}, np.full(20, -1))
    with pytest.raises(ConfigError, match=r"drift\[0\].labels: \[3, 12\] but the dataset has classes 0..9"):
        schedule_from(
            {"population": {"drift": [{"round": 3, "clients": [0], "kind": "swap_labels", "labels": [3, 12]}]}},
            truth,
            num_classes=10,
        )


@pytest.mark.parametrize(
    "dist, words",
    [
        ("{compute: {dist: constant, ms_per_sample: .nan}}", ["compute.ms_per_sample", "finite"]),
        ("{network: [{share: 1, up_mbps: -1, down_mbps: 3}]}", ["network[0].up_mbps", "> 0"]),
        ("{availability: {dist: windows, online_fraction: 1.5}}", ["online_fraction", "<= 1.0"]),
        ("{latency: {dist: constant}}", ["profiles.latency: unknown key"]),
    ],
)
def test_profile_distributions_are_checked_by_validation(dist, words):
    with pytest.raises(ConfigError) as exc:
        config.load(QUICKSTART, [f"population.profiles={{distribution: {dist}}}"])
    assert f"{QUICKSTART}: population.profiles.distribution: " in str(exc.value)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


@pytest.mark.parametrize("override", ["population.deadline_s=5", "population.realtime=1", "population.overcommit=2"])
def test_clock_settings_without_profiles_are_refused(override):
    """Without device profiles there is no emulated clock: a deadline was silently ignored
    (a 1-microsecond deadline left every client in time)."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{QUICKSTART}: {key}: needs population.profiles"):
        config.load(QUICKSTART, [override])
    phones = "population.profiles={distribution: {compute: {dist: constant, ms_per_sample: 20}}}"
    assert config.load(QUICKSTART, [override, phones])["population"][key.split(".")[1]] == float(override[-1])


@pytest.mark.parametrize("kind", ["clusters", "structured"])
def test_more_clusters_than_clients_is_refused_before_the_data_is_read(kind):
    """It was refused only by the partitioner, after the data had loaded, without the file."""
    with pytest.raises(ConfigError, match=r"partition.clusters: 5 clusters for 2 clients"):
        config.load(QUICKSTART, [f"partition.kind={kind}", "partition.clients=2"])
    assert config.load(QUICKSTART, ["partition.kind=iid", "partition.clients=2"])["partition"]["clients"] == 2


def test_crash_names_a_device_the_run_starts():
    """devices.crash={5: 2} with two device processes crashed nothing, silently."""
    with pytest.raises(ConfigError, match=r"devices.crash: no device 5: this run starts 2 device processes"):
        config.load(QUICKSTART, ["devices.crash={5: 2}", "devices.processes=2"])
    with pytest.raises(ConfigError, match=r"devices.crash: expected \{device index: round\}, got -1"):
        config.load(QUICKSTART, ["devices.crash={-1: 2}"])
    assert config.load(QUICKSTART, ["devices.crash={1: 2}", "devices.processes=2"])["devices"]["crash"] == {1: 2}
    with pytest.raises(ConfigError, match=r"no device 3: this run starts 3 device processes"):
        config.check_crash({3: 2}, 3)  # 50 processes asked for, capped at the 3 clients


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    """The second `train:` section silently replaced the first (PyYAML keeps the last)."""
    path = tmp_path / "twice.yaml"
    path.write_text(QUICKSTART.read_text() + "train: {rounds: 3}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: the key 'train' appears twice in one mapping.*line 3[0-9]"):
        config.load(path, [])
    with pytest.raises(ConfigError, match=r"--set methods: .*'name' appears twice"):
        config.load(QUICKSTART, ["methods=[{name: flt, name: fedavg}]"])
    merged = config.read_yaml("{a: &x {b: 1}, c: {<<: *x, b: 2}}")  # a merge may override
    assert merged == {"a": {"b": 1}, "c": {"b": 2}}


def test_a_yaml_boolean_word_where_text_is_expected_says_to_quote_it():
    """YAML 1.1 reads `security: on` as True: "expected str, got True" named no cause."""
    with pytest.raises(ConfigError, match=r"security: expected str: one of auto, curve, none, got True \(YAML"):
        config.load(QUICKSTART, ["devices.security=on"])
    with pytest.raises(ConfigError, match=r"name: expected str, got False \(YAML reads an unquoted on, off, yes or no"):
        config.load(QUICKSTART, ["name=no"])
    assert config.load(QUICKSTART, ["name='no'"])["name"] == "no"


def test_exponent_floats_are_numbers_in_files_and_set(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-3 as text: `lr: 1e-3` was refused as "expected float"."""
    assert config.load(QUICKSTART, ["train.lr=1e-3"])["train"]["lr"] == 1e-3
    path = tmp_path / "s.yaml"
    path.write_text(QUICKSTART.read_text().replace("lr: 0.05", "lr: 5E-2").replace("seed: 0", "seed: 1_0"))
    cfg = config.load(path, [])
    assert cfg["train"]["lr"] == 0.05 and cfg["seed"] == 10
    assert config.read_yaml("[1e9, 1.5e3, .5e1, 1e, e5, nan, '1e-3']") == [1e9, 1500.0, 5.0, "1e", "e5", "nan", "1e-3"]


def test_encoder_sources_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"methods\[0\]\(flt\).encoder.dataset: 'public' needs"):
        config.load(QUICKSTART, ["partition.public_fraction=0", "methods=[flt]"])
    with pytest.raises(ConfigError, match=r"encoder.dataset: 'nope' is neither 'public' nor a dataset"):
        config.load(QUICKSTART, ["methods=[{name: flt, encoder: {dataset: nope}}]"])
    with pytest.raises(ConfigError, match=r"encoder.dataset: 'digits' is the clients' own dataset"):
        config.load(QUICKSTART, ["methods=[{name: pca_km_hc, encoder: {dataset: digits}}]"])
    with pytest.raises(ConfigError, match=r"encoder.root: dataset 'femnist' needs a data root"):
        config.load(QUICKSTART, ["methods=[{name: flt, encoder: {dataset: femnist}}]"])
    # clients that fit their own PCA need no public images: nothing to check or load
    own = config.load(QUICKSTART, ["partition.public_fraction=0", "methods=[{name: pca_km_hc, basis: client}]"])
    assert config.encoder_source(own["methods"][0]) is None
    with pytest.raises(ConfigError, match=r"methods\[0\]\(pca_km_hc\).encoder.dataset: 'public' needs"):
        config.load(QUICKSTART, ["partition.public_fraction=0", "methods=[{name: pca_km_hc, basis: public}]"])


@pytest.mark.slow
def test_a_missing_encoder_dataset_stops_the_run_before_any_folder_or_process(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "run"
    res = flt(
        "run",
        str(QUICKSTART),
        "--set",
        f"methods=[fedavg, {{name: flt, encoder: {{dataset: mnist, root: {empty}}}}}]",
        "--out",
        str(out),
    )
    assert_one_line_error(res, 2, "methods[1](flt).encoder: dataset 'mnist'", str(empty))
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


# -- relative paths and --methods labels ------------------------------------------------------


def test_relative_paths_resolve_against_the_scenario_file_and_set_against_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "sc").mkdir()
    path = tmp_path / "sc" / "x.yaml"
    path.write_text(
        "data: {dataset: mnist, root: ../data}\n"
        "population: {profiles: {trace: traces/t.csv}}\n"
        "methods: [fedavg, {name: flt, encoder: {dataset: femnist, root: ~/femnist}},\n"
        "          {name: flt, label: b, encoder: {dataset: fashion_mnist, root: /abs/fm}},\n"
        "          {name: flt, label: c, encoder: {dataset: femnist, root: ../fem}}]\n"
    )
    monkeypatch.chdir(REPO)
    cfg = config.load(path)
    assert cfg["data"]["root"] == str(tmp_path / "data")
    assert cfg["population"]["profiles"]["trace"] == str(tmp_path / "sc" / "traces" / "t.csv")
    roots = [m["params"]["encoder"]["root"] for m in cfg["methods"][1:]]
    assert roots == ["~/femnist", "/abs/fm", str(tmp_path / "fem")]
    monkeypatch.chdir(tmp_path)
    assert config.load(path, ["data.root=mine"])["data"]["root"] == str(tmp_path / "mine")
    # the saved config.yaml holds absolute paths: it runs again from anywhere
    again = tmp_path / "elsewhere.yaml"
    again.write_text(config.dump(cfg))
    assert config.load(again)["data"]["root"] == str(tmp_path / "data")


def test_compare_methods_accepts_labels_as_well_as_names():
    s1 = REPO / "scenarios" / "s1_mnist.yaml"
    labels = lambda names: [m["label"] for m in config.load(s1, [], names)["methods"]]  # noqa: E731
    assert labels(["fedavg", "flt_enc1"]) == ["fedavg", "flt_enc1"]
    assert labels(["flt"]) == ["flt_enc1", "flt_enc2", "flt_paper"]
    assert labels(["cfl_tuned", "ifca"]) == ["cfl_tuned", "ifca"]
    assert labels(["flt", "flt_enc1"]) == ["flt_enc1", "flt_enc2", "flt_paper"]  # each entry once
    with pytest.raises(
        ConfigError,
        match=r"unknown method or label 'flt_enc3'; methods: .*fedavg.*"
        r"labels in this scenario: .*flt_enc1, flt_enc2",
    ):
        config.load(s1, [], ["flt_enc3"])


# -- through the command line: one line, exit 2, no run folder --------------------------------


@pytest.mark.slow
def test_invalid_set_yaml_and_an_empty_file_exit_2_naming_field_and_file(tmp_path):
    out = tmp_path / "run"
    res = flt("run", str(QUICKSTART), "--set", "train.rounds=[1,", "--out", str(out))
    assert_one_line_error(res, 2, str(QUICKSTART), "--set train.rounds", "not valid YAML")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    res = flt("run", str(empty), "--out", str(out))
    assert_one_line_error(res, 2, str(empty), "empty")
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def write_idx(path: Path, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    raw = bytes([0, 0, 0x08, arr.ndim]) + np.array(arr.shape, ">u4").tobytes() + arr.tobytes()
    path.write_bytes(gzip.compress(raw))


@pytest.mark.slow
def test_truncated_data_file_exits_2_naming_it_and_leaves_no_run_folder(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "data"
    root.mkdir()
    for prefix, n in (("train", 200), ("t10k", 50)):
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    bad = root / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:1000])
    scen = tmp_path / "s.yaml"
    scen.write_text("data: {dataset: mnist, root: data}\ndevices: {processes: 1}\n")
    out = tmp_path / "run"
    res = flt("run", str(scen), "--out", str(out), cwd=tmp_path / "data")  # root: relative to the file
    assert_one_line_error(res, 2, str(bad), "corrupt or truncated")
    assert res.stdout.startswith(f"data: mnist from {root}\n"), res.stdout
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, words",
    [
        ("partition.clients=10000000", ["partition.clients: 10000000 clients"]),
        ("population.newcomers=[{round: 3, cluster: 1}]", ["newcomers[0].cluster: no client belongs to cluster 1"]),
    ],
)
def test_checks_against_the_data_leave_no_run_folder(tmp_path, override, words):
    out = tmp_path / "run"
    extra = ["--set", "partition.kind=dirichlet"] if "newcomers" in override else []
    res = flt("run", str(QUICKSTART), "--set", override, *extra, "--out", str(out))
    assert_one_line_error(res, 2, *words)
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))


@pytest.mark.slow
def test_a_scenario_runs_from_another_folder_and_prints_its_data_root(tmp_path):
    if not (SHARED / "mnist").is_dir():
        pytest.skip(f"real data not found at {SHARED}")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    # the shipped S1 file names ../../shared/data relative to itself; stop right after the data
    res = flt(
        "run",
        str(REPO / "scenarios" / "s1_mnist.yaml"),
        "--set",
        "partition.clients=100000",
        "--out",
        str(tmp_path / "run"),
        cwd=elsewhere,
    )
    assert res.stdout.startswith(f"data: mnist from {SHARED.resolve()}\n"), res.stdout + res.stderr
    assert_one_line_error(res, 2, "partition.clients: 100000 clients")


@pytest.mark.slow
def test_a_bug_keeps_its_traceback_and_exits_1(tmp_path):
    code = (
        "import sys; from flt.emulator import cli, run\n"
        "def broken(cfg, out=None, **kw): raise ValueError('a bug, not a mistake')\n"
        "run.run_scenario = broken\n"
        f"sys.exit(cli.main(['run', {str(QUICKSTART)!r}]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr
    assert "Traceback" in res.stderr and "ValueError: a bug, not a mistake" in res.stderr
    assert "error: " not in res.stderr.splitlines()[0]


@pytest.mark.slow
def test_devices_that_never_connect_exit_3_with_one_line(tmp_path):
    res = flt(
        "run",
        str(QUICKSTART),
        "--set",
        "devices.processes=0",
        "--set",
        "devices.external=1",
        "--set",
        "devices.security=none",  # auto would want CURVE keys for an external device
        "--set",
        "devices.start_timeout_s=0.5",
        "--out",
        str(tmp_path / "run"),
    )
    assert_one_line_error(res, 3, "0 of 1 devices connected")


@pytest.mark.parametrize("bind", ["bogus", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:-1", "tcp://host", "ipc://"])
def test_a_server_address_zeromq_would_refuse_or_wrap_is_refused_first(bind):
    """ZeroMQ binds port 99999 as 34463 without a word; `bogus` was a traceback."""
    with pytest.raises(ConfigError, match=r"devices\.bind: expected tcp://HOST:PORT \(PORT 1\.\.65535"):
        config.load(QUICKSTART, [f"devices.bind={bind}"])
    for good in (
        "tcp://0.0.0.0:5555",
        "tcp://127.0.0.1:*",
        "tcp://0.0.0.0:0",
        "ipc:///tmp/flt.sock",
        "tcp://edge.lan:65535",
    ):
        assert config.load(QUICKSTART, [f"devices.bind={good}"])["devices"]["bind"] == good


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["--connect", "bogus"], "--connect: expected tcp://HOST:PORT (PORT 1..65535) or ipc://PATH, got 'bogus'"),
        (["--connect", "tcp://127.0.0.1:*"], "--connect: expected tcp://HOST:PORT"),  # * only where one listens
        (["--connect", "tcp://127.0.0.1:5555", "--threads", "0"], "--threads: 1 to 1,024, got 0"),
        (["--connect", "tcp://127.0.0.1:5555", "--threads", "99999999999999999999"], "--threads: 1 to 1,024"),
    ],
)
def test_a_device_started_by_hand_with_a_bad_address_is_one_line(args, words):
    """`flt device --connect bogus` was a ZeroMQ traceback, and `--threads 10^20` torch's."""
    assert_one_line_error(flt("device", *args, timeout=120), 2, words)


@pytest.mark.slow
def test_an_fcr_nobody_answers_in_time_names_the_timeout(tmp_path):
    """round_timeout_s 0.001: every embedding came late, and the error said only
    "no client sent centroids (see the device logs)", where nothing had failed."""
    res = flt(
        "run",
        str(QUICKSTART),
        "--set",
        "devices.round_timeout_s=0.001",
        "--set",
        "methods=[flt]",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: FCR: no client sent valid centroids in time") and "devices.round_timeout_s" in last


@pytest.mark.slow
def test_a_port_another_program_holds_is_one_line_naming_devices_bind(tmp_path):
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as holder:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        res = flt("run", str(QUICKSTART), "--set", f"devices.bind=tcp://127.0.0.1:{port}", "--out", str(tmp_path))
    assert_one_line_error(res, 2, f"devices.bind: cannot listen on 'tcp://127.0.0.1:{port}': Address already in use")


def test_every_user_facing_error_shares_the_base():
    from flt.common.errors import DeviceError
    from flt.emulator.profiles import ProfileError
    from flt.scenarios.datasets import DataError

    for cls in (ConfigError, DataError, part.PartitionError, ProfileError, DeviceError):
        assert issubclass(cls, FltError)
    assert DeviceError.exit_code == 3 and ConfigError.exit_code == 2


def test_dataset_names_follow_the_loaders_spelling():
    assert (
        config.load(QUICKSTART, ["data.dataset=emnist:letters", "data.root=/data"])["data"]["dataset"]
        == "emnist:letters"
    )
    assert config.load(QUICKSTART, ["data.dataset=Fashion-MNIST", "data.root=/data"])
    with pytest.raises(ConfigError, match=r"data.dataset: expected one of digits, .*got 'emnist:nope'"):
        config.load(QUICKSTART, ["data.dataset=emnist:nope", "data.root=/data"])


@pytest.mark.parametrize("error", ["cuda", "host"])
def test_running_out_of_memory_is_one_line_and_exit_3_not_a_traceback(error, capsys):
    import torch

    from flt.emulator.cli import guarded

    def action():
        if error == "cuda":  # what the server raised on a GPU that other jobs had filled
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 MiB.\nProcess 1 has ...")
        raise MemoryError

    assert guarded(action) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory" in err and "run the command again" in err
    assert "Process 1" not in err  # the first line only
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        guarded(lambda: (_ for _ in ()).throw(RuntimeError("a bug")))


def test_a_full_disk_is_one_line_and_exit_3_not_a_traceback(capsys):
    import errno

    from flt.emulator.cli import guarded

    def action():  # what writing metrics.jsonl raises when the disk fills mid-run
        exc = OSError(errno.ENOSPC, "No space left on device", "runs/x/fedavg/metrics.jsonl")
        exc.run_dir = Path("runs/x")  # as emulator/run.py names the folder it was writing
        raise exc

    assert guarded(action) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk is full" in err and "metrics.jsonl" in err
    assert "`flt run --resume runs/x`" in err
    assert guarded(action, again="run the same command again") == 3  # flt suite's way on
    assert "free space, then run the same command again" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):  # other OS errors are not the disk's, and keep their traceback
        guarded(lambda: Path("/nonexistent/flt/file").read_text())


@pytest.mark.parametrize(
    "command",
    [
        ["run", str(QUICKSTART), "--set", "train.rounds=1", "--out", "{file}/run"],
        ["relate", str(QUICKSTART), "--out", "{file}"],
        ["run", str(QUICKSTART), "--set", "train.rounds=1", "--set", "output={file}"],
        ["keys", "{file}/keys"],
    ],
    ids=["run --out", "relate --out", "output", "keys"],
)
def test_an_output_folder_that_cannot_be_made_names_its_option(tmp_path, command):
    blocker = tmp_path / "a_file"  # a plain file where a folder should go
    blocker.write_text("")
    proc = flt(*[part_.replace("{file}", str(blocker)) for part_ in command], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    what = {"run": "--out", "relate": "--out", "keys": "flt keys DIR"}[command[0]]
    what = "output" if "output=" in " ".join(command) else what
    assert f"error: {what}:" in proc.stderr and str(blocker) in proc.stderr


def test_a_full_disk_while_a_record_or_the_summary_is_written_names_the_file(tmp_path):
    """/dev/full answers every write with ENOSPC; a file object's error carried no name."""
    import errno

    from flt.common.files import append_line
    from flt.reports.summary import write_summary

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError) as caught:
        append_line(tmp_path / "metrics.jsonl", '{"round": 1}')  # a round's record
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "metrics.jsonl")
    (tmp_path / "summary.json.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as caught:
        write_summary(tmp_path, {"methods": {}})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "summary.json.tmp")


# `flt run` with NumPy's savez failing as a full disk would, from its `after`-th call on
# (the partition is the first .npz a run writes, then a checkpoint after set-up and after
# every round)
FULL_DISK_AFTER = """
import errno, sys
import numpy as np
real, calls = np.savez, [0]
def savez(*args, **kwargs):
    calls[0] += 1
    if calls[0] > int(sys.argv[1]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(*args, **kwargs)
np.savez = savez
from flt.emulator.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_names_the_file_and_the_folder_to_resume(tmp_path):
    """The message named neither: `writing a file` (NumPy writes through a file object)
    and `flt run --resume RUN_DIR`."""
    out = tmp_path / "run"
    sets = ["--set", "train.rounds=3", "--set", "methods=[fedavg]", "--out", str(out)]
    full = subprocess.run(
        [sys.executable, "-c", FULL_DISK_AFTER, "3", "run", str(QUICKSTART), *sets],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert full.returncode == 3 and "Traceback" not in full.stderr, full.stderr[-2000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last == (
        f"error: the disk is full (writing {out / 'fedavg' / 'checkpoint.npz'}); the rounds so far are in "
        f"{out}: free space, then `flt run --resume {out}`"
    )
    rounds = lambda: [json.loads(line)["round"] for line in (out / "fedavg" / "metrics.jsonl").open()]  # noqa: E731
    assert rounds()[:1] == [1]  # what was done is on disk (checkpoints are paced: the failed one was later)
    resumed = flt("run", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert rounds() == [1, 2, 3]


@pytest.mark.slow
def test_a_run_folder_deleted_mid_run_stops_the_run_in_one_line_and_stays_deleted(tmp_path):
    """Deleted by hand while FedAvg ran, the folder was made again by the next round's
    writes and filled with the rest of the run, without its first rounds; or, when a
    write came first, the run stopped with a FileNotFoundError traceback."""
    import shutil
    import time

    out = tmp_path / "run"
    args = ["run", str(QUICKSTART), "--set", "train.rounds=5000", "--set", "methods=[fedavg]", "--out", str(out)]
    proc = flt_popen(*args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    metrics = out / "fedavg" / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its folder was deleted"
        time.sleep(0.05)
    shutil.rmtree(out)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"error: the run folder {out} was removed while the run wrote into it; run the command again"
    )
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))
