"""The shipped scenario files: every one validates, the ablation grid matches its
generator, and each new data/model combination runs end to end in a tiny version
(real device processes over loopback sockets, real data from ../shared/data)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from flt.common.schema import ConfigError
from flt.emulator.config import load, resolve_paths
from flt.models.nets import build_model
from flt.scenarios.datasets import load_dataset
from flt.scenarios.partition import Partition
from flt.server.encoder import fit_shape
from tests.conftest import REPO, SHARED_DATA, need_shared

SCENARIOS = REPO / "scenarios"
FILES = sorted(SCENARIOS.rglob("*.yaml"))
_spec = importlib.util.spec_from_file_location("make_grid", SCENARIOS / "ablation" / "make_grid.py")
make_grid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_grid)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SCENARIOS)))
def test_every_scenario_file_validates_and_names_shared_data(path):
    cfg = load(path)
    roots = [cfg["data"]["root"]] if cfg["data"]["dataset"] != "emnist:balanced" else []  # the user's
    roots += [m["params"]["encoder"]["root"] for m in cfg["methods"] if "encoder" in m["params"]]
    for root in filter(None, roots):  # resolved against the file's own folder
        assert Path(root).is_relative_to(SHARED_DATA), root


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_ablation_files_are_the_generator_output(dataset):
    grid, folder = make_grid.grid(dataset), make_grid.FOLDER[dataset]
    assert len(grid) == 16
    on_disk = {p.name: p.read_text() for p in folder.glob("*.yaml")}
    assert on_disk == grid, "run python scenarios/ablation/make_grid.py"
    configs = [load(folder / n) for n in grid]
    values = {
        (c["partition"]["clients"], c["train"]["participation"], c["train"]["local_epochs"], c["train"]["rounds"])
        for c in configs
    }
    assert values == {(m, r, e, t) for m in (100, 500) for r in (0.2, 0.5) for e in (1, 5) for t in (50, 100)}
    assert {c["data"]["dataset"] for c in configs} == {"cifar10_jpg" if dataset == "cifar10" else dataset}


def test_fit_shape_gives_grey_images_the_clients_colour_shape():
    grey = np.zeros((3, 1, 28, 28), np.uint8)
    grey[:, :, 4:24, 4:24] = 200
    out = fit_shape(grey, (3, 32, 32), "fashion_mnist")
    assert out.shape == (3, 3, 32, 32) and out.dtype == np.uint8
    assert np.array_equal(out[:, 0], out[:, 2])  # grey replicated, not invented colour
    assert out[:, :, 16, 16].min() == 200 and out[:, :, 0, 0].max() == 0  # resized, not shifted
    back = fit_shape(out, (1, 28, 28), "cifar10")
    assert back.shape == (3, 1, 28, 28) and abs(int(back[0, 0, 14, 14]) - 200) <= 1
    assert fit_shape(grey, (1, 28, 28), "x") is grey
    with pytest.raises(ConfigError, match="2-channel"):
        fit_shape(np.zeros((1, 2, 8, 8), np.uint8), (3, 8, 8), "odd")


def test_s4_emnist_when_the_user_has_it():
    cfg = load(SCENARIOS / "s4_emnist.yaml")
    if not Path(cfg["data"]["root"]).exists():
        pytest.skip(f"EMNIST-balanced not found at {cfg['data']['root']} (see the s4_emnist.yaml header)")
    from flt.emulator.run import build_partition, hold_out_public, load_data

    train, test = load_data(cfg)
    p = build_partition(cfg, train, test, hold_out_public(cfg, len(train.y)))
    assert p.n_clients == 2400 and min(len(t) for t in p.train) >= 20


def tiny(path: Path, tmp: Path, labels: list[str], enc2: dict | None = None, **partition) -> dict:
    """Run `path` shrunk to 2 rounds, one device process, 1-epoch encoders (`enc2` updates
    the flt_enc2 method's encoder); its relative paths resolved against its own folder
    before the copy moves to `tmp`."""
    raw = yaml.safe_load(path.read_text())
    resolve_paths(raw, path.parent)
    raw["partition"].update(partition)
    raw["train"].update(rounds=2, eval_every=1)
    raw["devices"]["processes"] = 1
    raw["methods"] = [m for m in raw["methods"] if (m if isinstance(m, str) else m.get("label", m["name"])) in labels]
    for m in raw["methods"]:
        if isinstance(m, dict) and "encoder" in m:
            m["encoder"].update(epochs=1, finetune_epochs=min(1, m["encoder"].get("finetune_epochs", 0)))
            if m.get("label") == "flt_enc2" and enc2:
                m["encoder"].update(enc2)
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(raw))
    res = subprocess.run(
        [sys.executable, "-m", "flt.emulator.cli", "run", str(tmp / "tiny.yaml"), "--out", str(tmp / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    return json.loads((tmp / "run" / "summary.json").read_text())["methods"]


@pytest.mark.slow  # decoding 60,000 JPEGs into a fresh cache: ~35 s on 2 cores
def test_cifar10_cnn_with_public_slice_and_enc2_stand_in_runs(tmp_path):
    need_shared("cifar10-jpg")
    # Enc2 from scikit-learn's grey digits, not the file's Fashion-MNIST: the same path (another
    # dataset, grey made colour and resized, fine-tuned on the clients) on 1/45 of the images
    # (pretraining on Fashion-MNIST's 60,000 took a minute of this test on 2 cores)
    methods = tiny(
        SCENARIOS / "s1_cifar10.yaml",
        tmp_path,
        ["flt_enc1", "flt_enc2"],
        enc2={"dataset": "digits"},
        clients=10,
        samples_per_client=40,
        test_per_client=10,
        public_fraction=0.02,
    )
    public = np.load(tmp_path / "run" / "public_indices.npy")
    assert len(public) == 1000  # 2 % of the 50,000 train images, kept from every client
    train = np.concatenate(Partition.load(tmp_path / "run" / "partition.npz").train)
    assert not np.isin(public, train).any()
    assert methods["flt_enc1"]["fcr"]["public_images"] == 1000
    assert methods["flt_enc2"]["fcr"]["public_images"] == len(load_dataset("digits", None, train=True).y)
    assert methods["flt_enc2"]["fcr"]["encoder_channels"] == 32  # the colour default, from the clients' shape
    cifar_cnn = build_model("cifar_cnn", (3, 32, 32), 10)
    for m in methods.values():
        assert m["rounds"] == 2 and m["bytes_vs_formula"] == 1.0
        assert m["model_bytes"] == 4 * sum(w.numel() for w in cifar_cnn.parameters())


@pytest.mark.slow  # parsing FEMNIST's 83 MB of LEAF JSON into a fresh cache: ~25 s on 2 cores
def test_structured_sampler_on_pooled_femnist_runs_with_a_public_slice(tmp_path):
    need_shared("femnist")
    methods = tiny(SCENARIOS / "s4_femnist_enc1.yaml", tmp_path, ["fedavg", "flt_enc1"], clients=20, test_per_client=5)
    assert methods["fedavg"]["rounds"] == methods["flt_enc1"]["rounds"] == 2
    shards = Partition.load(tmp_path / "run" / "partition.npz")
    assert np.array_equal(np.bincount(shards.cluster), [2] * 10)  # ten planted clusters of two
    assert min(len(t) for t in shards.train) >= 1 and "cluster 9: classes" in " ".join(shards.notes)
    # Enc1 learns from the held-out 10 % only: the structured sampler never hands it out
    public = np.load(tmp_path / "run" / "public_indices.npy")
    assert len(public) == methods["flt_enc1"]["fcr"]["public_images"] > 1000
    assert not np.isin(public, np.concatenate(shards.train)).any()
