"""Scenario files: validation before anything starts, `--set` overrides, the resolved
config saved in the run folder, `flt compare`, and `flt --help`."""

import json
from pathlib import Path

import pytest
import yaml
from flt_command import flt  # tests/ is on sys.path under pytest

from flt.common.schema import ConfigError
from flt.emulator import config
from flt.server.strategies.params import METHODS

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def scenario(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- bad scenarios stop before anything starts ---------------------------------------------


@pytest.mark.slow
def test_unknown_key_exits_2_naming_file_field_and_suggestion(tmp_path):
    path = scenario(tmp_path, "train: {lrr: 0.1}\n")
    out = tmp_path / "run"
    res = flt("run", str(path), "--out", str(out))
    assert res.returncode == 2, res.stderr + res.stdout
    assert str(path) in res.stderr
    assert "train.lrr" in res.stderr
    assert "did you mean 'lr'" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()  # validated before the run folder is made
    assert "run folder" not in res.stdout


@pytest.mark.slow
def test_bad_method_param_through_the_cli_exits_2(tmp_path):
    path = scenario(tmp_path, "methods: [{name: flt, gama: 1}]\n")
    out = tmp_path / "run"
    res = flt("compare", str(path), "--methods", "flt", "--out", str(out))
    assert res.returncode == 2, res.stderr + res.stdout
    assert str(path) in res.stderr and "gama" in res.stderr and "gamma" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "text, field, words",
    [
        ("train: {rounds: ten}\n", "train.rounds", ["int", "'ten'"]),
        ("train: {participation: 1.5}\n", "train.participation", ["1.5", "maximum"]),
        ("train: {lr: 0}\n", "train.lr", ["minimum"]),
        ("partition: {clients: many}\n", "partition.clients", ["int"]),
        ("model: resnet\n", "model", ["'resnet'", "mlp"]),
        ("methods: [fedavgg]\n", "methods[0].name", ["unknown method", "'fedavgg'", "fedavg"]),
        ("methods: [{name: flt, gama: 1}]\n", "gama", ["unknown field", "did you mean 'gamma'", "flt"]),
        ("methods: [{name: flt, k: five}]\n", ".k", ["'five'", "positive integer, 'auto' or 'labels'", "flt"]),
        ("methods: [{name: flt, k: 0}]\n", ".k", ["positive integer, 'auto' or 'labels'"]),
        ("methods: [{name: flt, encoder: {epochz: 3}}]\n", "encoder.epochz", ["did you mean 'epochs'"]),
        ("methods: []\n", "methods", ["at least one"]),
        ("data: {dataset: mnist}\n", "data.root", ["'mnist'", "data root"]),
        ("data: {dataset: no_such_set}\n", "data.dataset", ["'no_such_set'"]),
        ("partition: {kind: writers, max_per_class: 50}\n", "partition.max_per_class", ["writer keeps all"]),
        ("partition: {max_per_class: 0}\n", "partition.max_per_class", ["minimum"]),
    ],
)
def test_bad_scenarios_name_file_and_field(tmp_path, text, field, words):
    path = scenario(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        config.load(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: "), msg
    assert field in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.rounds=ten", "train.rounds"),
        ("train.participation=1.5", "train.participation"),
        ("methods=[{name: flt, k: five}]", ".k"),
        ("train.lrr=0.1", "train.lrr"),
        ("rounds", "--set 'rounds'"),
    ],
)
def test_bad_overrides_name_file_and_field(override, field):
    with pytest.raises(ConfigError) as exc:
        config.load(QUICKSTART, [override])
    assert str(exc.value).startswith(f"{QUICKSTART}: ")
    assert field in str(exc.value)


def test_compare_with_an_unknown_method_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"--methods: unknown method or label 'fedavgg'; "
        r"methods: .*fedavg.*labels in this scenario: fedavg, flt",
    ):
        config.load(QUICKSTART, [], ["fedavg", "fedavgg"])


@pytest.mark.slow
def test_missing_scenario_file_exits_2(tmp_path):
    res = flt("run", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    assert str(tmp_path / "nope.yaml") in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_missing_data_files_fail_with_a_message_naming_the_root(tmp_path):
    empty = tmp_path / "empty-root"
    empty.mkdir()
    path = scenario(tmp_path, f"data: {{dataset: mnist, root: {empty}}}\ndevices: {{processes: 1}}\n")
    res = flt("run", str(path), "--out", str(tmp_path / "run"), timeout=120)
    assert res.returncode != 0
    assert str(empty) in res.stderr
    # a clean one-line error, as for every other bad input, not a Python traceback
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("error: "), res.stderr


# -- a valid run: overrides and the saved, resolved config ---------------------------------------

OVERRIDES = ["train.rounds=1", "methods=[fedavg]"]


@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("config-run")
    args = [a for o in OVERRIDES for a in ("--set", o)]
    res = flt("run", str(QUICKSTART), *args, "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    return out


@pytest.mark.slow
def test_overrides_are_applied_and_resolved_config_is_saved(one_round_run):
    saved = yaml.safe_load((one_round_run / "config.yaml").read_text())
    assert saved["train"]["rounds"] == 1
    assert saved["train"]["batch_size"] == 10
    assert saved["methods"] == [{"name": "fedavg", "label": "fedavg", "pool": "selected"}]  # defaults filled
    # the saved config runs again as it is
    assert config.load(one_round_run / "config.yaml")["train"]["rounds"] == 1
    # defaults the quickstart does not mention are filled in
    assert saved["train"]["vectorize"] == "auto"
    assert saved["train"]["target_accuracy"] is None
    assert saved["devices"]["threads"] == 1
    assert saved["devices"]["round_timeout_s"] == 120.0
    assert saved["partition"]["shared_classes"] == 0
    assert saved["data"]["root"] is None
    assert saved["output"] == "runs"
    # exactly what validation resolves
    assert config.load(one_round_run / "config.yaml") == config.load(QUICKSTART, OVERRIDES)
    s = json.loads((one_round_run / "summary.json").read_text())
    assert list(s["methods"]) == ["fedavg"]
    assert s["methods"]["fedavg"]["rounds"] == 1


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare-run")
    res = flt("compare", str(QUICKSTART), "--methods", "fedavg,local", "--set", "train.rounds=2", "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    return out


@pytest.mark.slow
def test_compare_runs_both_methods_on_one_partition(compare_run):
    s = json.loads((compare_run / "summary.json").read_text())
    assert set(s["methods"]) == {"fedavg", "local"}
    saved = yaml.safe_load((compare_run / "config.yaml").read_text())
    assert [m["name"] for m in saved["methods"]] == ["fedavg", "local"]
    assert saved["train"]["rounds"] == 2
    assert len(list(compare_run.glob("partition*.npz"))) == 1
    fedavg, local = s["methods"]["fedavg"], s["methods"]["local"]
    assert fedavg["rounds"] == local["rounds"] == 2
    assert fedavg["selections"] == local["selections"] == 2 * 0.5 * 20
    for label in ("fedavg", "local"):
        assert (compare_run / label / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_local_uploads_no_model_bytes(compare_run):
    s = json.loads((compare_run / "summary.json").read_text())
    local, fedavg = s["methods"]["local"], s["methods"]["fedavg"]
    assert local["bytes_payload"]["up"]["model"] == 0
    assert fedavg["bytes_payload"]["up"]["model"] > 0
    # w0 goes down once per client ever selected, never again
    assert local["bytes_payload"]["down"]["model"] == local["clients_initialised"] * local["model_bytes"]
    assert local["bytes_vs_formula"] == 1.0


@pytest.mark.slow
def test_help_lists_the_commands():
    res = flt("--help", timeout=120)
    assert res.returncode == 0, res.stderr
    for cmd in ("run", "compare", "device"):
        assert cmd in res.stdout


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "scenarios").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_scenario_validates(path):
    cfg = config.load(path)
    assert cfg["methods"] and cfg["train"]["rounds"] >= 1


def test_momentum_is_plain_sgd_unless_asked_and_bounded():
    assert config.load(QUICKSTART)["train"]["momentum"] == 0.0  # the paper's text: plain SGD
    assert config.load(QUICKSTART, ["train.momentum=0.5"])["train"]["momentum"] == 0.5  # its authors' code
    with pytest.raises(ConfigError, match=r"train\.momentum: 1\.5 is above the maximum 1"):
        config.load(QUICKSTART, ["train.momentum=1.5"])


def test_seed_is_bounded_by_what_every_seeded_library_accepts():
    import numpy as np
    import torch
    from sklearn.utils import check_random_state

    with pytest.raises(ConfigError, match=r"seed: 4294967296 is above the maximum 4294967295"):
        config.load(QUICKSTART, ["seed=4294967296"])  # was a torch traceback mid-run
    top = config.load(QUICKSTART, ["seed=4294967295"])["seed"]
    torch.manual_seed(top)  # initial weights
    check_random_state(top)  # k-means, PCA and UMAP take the seed as it is
    np.random.default_rng([top, 0x9B])  # partition and draws
    with pytest.raises(ValueError):
        check_random_state(top + 1)  # so the bound is scikit-learn's, not a guess


@pytest.mark.parametrize(
    "override, words",
    [  # each was a traceback (OverflowError, a C int) or a hang mid-run
        ("train.rounds=2147483648", r"train\.rounds: 2147483648 is out of range \(at most 2\^31 - 1"),
        ("methods=[{name: pca_km_hc, components: 99999999999999999999}]", r"components: 9+ is out of range"),
        ("methods=[{name: pacfl, clusters: 9223372036854775807}]", r"pacfl\)\.clusters: 9+\d+ is out of range"),
        ("devices.threads=2147483647", r"devices\.threads: 2147483647 is above the maximum 1024"),
    ],
)
def test_integers_beyond_what_the_libraries_take_are_refused(override, words):
    with pytest.raises(ConfigError, match=words):
        config.load(QUICKSTART, [override])
    assert config.load(QUICKSTART, ["train.rounds=2147483647"])["train"]["rounds"] == 2**31 - 1


@pytest.mark.parametrize(
    "method, key", [("ifca", "clusters"), ("fedsem", "centers"), ("fesem_soft", "centers"), ("fedgroup", "groups")]
)
def test_more_server_models_than_clients_are_refused(method, key, tmp_path):
    """IFCA with 10^20 clusters was an overflow traceback, and any count given above the
    clients only allocates (and for IFCA sends) models no client can train."""
    clients = config.load(QUICKSTART)["partition"]["clients"]
    ok = config.load(QUICKSTART, [f"methods=[{{name: {method}, {key}: {clients}}}]"])
    assert ok["methods"][0]["params"][key] == clients
    with pytest.raises(
        ConfigError, match=rf"methods\[0\]\({method}\)\.{key}: {clients + 1} models for {clients} clients"
    ):
        config.load(QUICKSTART, [f"methods=[{{name: {method}, {key}: {clients + 1}}}]"])
    few = config.load(QUICKSTART, ["partition.clients=3", "partition.clusters=3", f"methods=[{method}]"])
    assert few["methods"][0]["params"][key] == 3  # the default count (5) is cut to the clients, not refused
    again = tmp_path / "config.yaml"  # as a run saves it: a resume reads it back (tests/shape_sweep.py, seed 23)
    again.write_text(config.dump(few))
    assert config.load(again)["methods"][0]["params"][key] == 3


@pytest.mark.parametrize(
    "umap, words",
    [
        ("{metric: bogus}", r"umap\.metric: 'bogus' is not one of euclidean"),  # was a traceback mid-run
        ("{metric: mahalanobis}", r"umap\.metric: 'mahalanobis' is not one of"),  # needs a matrix V
        ("{min_dist: 2}", r"umap\.min_dist: 2\.0 is above the maximum 1"),  # UMAP: min_dist <= spread
    ],
)
def test_umap_settings_that_umap_would_refuse_mid_run_are_refused_first(umap, words):
    with pytest.raises(ConfigError, match=words):
        config.load(QUICKSTART, [f"methods=[{{name: flt, space: umap, umap: {umap}}}]"])


def test_a_folder_given_as_the_scenario_points_to_flt_suite():
    with pytest.raises(ConfigError, match=r"scenarios: a folder, not a scenario file \(`flt suite .*scenarios` runs"):
        config.load(REPO / "scenarios")


def test_a_fedprox_mu_that_makes_the_proximal_step_diverge_is_refused():
    """quickstart's lr 0.05: each step scales w - w_t by (1 - 0.05 mu), unstable from mu 40
    (from 60 with momentum 0.5, a heavy-ball step)."""
    prox = ["methods=[{name: fedprox, mu: %s}]"]
    assert config.load(QUICKSTART, [prox[0] % 39])["methods"][0]["params"]["mu"] == 39
    with pytest.raises(ConfigError, match=r"methods\[0\]\(fedprox\)\.mu: mu 40 with train\.lr 0\.05 .*give mu < 40"):
        config.load(QUICKSTART, [prox[0] % 40])
    assert config.load(QUICKSTART, [prox[0] % 40, "train.momentum=0.5"])["methods"][0]["params"]["mu"] == 40
    with pytest.raises(ConfigError, match="give mu < 60"):
        config.load(QUICKSTART, [prox[0] % 60, "train.momentum=0.5"])


def test_encoder_bottleneck_is_the_papers_for_grey_and_wider_for_colour():
    from flt.models.autoencoder import bottleneck_channels

    flt = next(m for m in config.load(QUICKSTART)["methods"] if m["name"] == "flt")
    assert flt["params"]["encoder"]["channels"] == "auto"
    assert bottleneck_channels("auto", 1) == 4  # the paper's ConvAE (28x28 grey)
    assert bottleneck_channels("auto", 3) == 32  # colour: measured on CIFAR-10 (docs/methods.md)
    assert bottleneck_channels(8, 3) == 8
    bad = "methods=[{name: flt, encoder: {channels: 0}}]"
    with pytest.raises(ConfigError, match=r"channels: .*a positive integer or 'auto'"):
        config.load(QUICKSTART, [bad])


def test_a_resumed_run_keeps_the_bottleneck_it_started_with(tmp_path):
    """A run folder's config.yaml from before `encoder.channels` existed ran the paper's 4
    channels on colour images too; resuming it must not switch to today's default."""
    cfg = config.load(QUICKSTART)
    old = {k: v for k, v in cfg.items() if k != "methods"}
    old["methods"] = [{"name": "flt", "label": "flt", "encoder": {"dataset": "public", "epochs": 1}}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    from flt.models.autoencoder import PAPER_CHANNELS

    assert config.load(path, saved=True)["methods"][0]["params"]["encoder"]["channels"] == PAPER_CHANNELS
    assert config.load(path)["methods"][0]["params"]["encoder"]["channels"] == "auto"
    old["methods"][0]["encoder"]["channels"] = 16  # a newer folder keeps what it says
    path.write_text(yaml.safe_dump(old))
    assert config.load(path, saved=True)["methods"][0]["params"]["encoder"]["channels"] == 16


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_s_saved_config_loads_back_unchanged(tmp_path, method):
    """What a run writes as config.yaml is what `flt run --resume` reads: pinning the ConvAE
    bottleneck in PCA+kM+HC's `encoder` section (which has none) once made every saved
    PCA+kM+HC run refuse to resume."""
    cfg = config.load(QUICKSTART, [f"methods=[{{name: {method}}}]"])
    path = tmp_path / "config.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path, saved=True) == cfg
