"""Dataset loaders: real data from ../shared/data when present, small files in each real
format written by the tests themselves otherwise. Nothing here downloads."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from flt_command import QUICKSTART, flt_run  # tests/ is on sys.path under pytest

from flt.scenarios import datasets as ds
from flt.scenarios.datasets import DATASETS, DataError, load_dataset, read_idx

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Never touch the user's ~/.cache/flt from tests."""
    monkeypatch.setenv("FLT_CACHE", str(tmp_path / "cache"))


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real data not available offline here: {path} is missing")
    return path


# ----------------------------------------------------------------------------- writers of real formats


def write_idx(path: Path, arr: np.ndarray) -> None:
    """IDX: magic 0 0 0x08 ndim, big-endian uint32 dims, uint8 data (gzip'd if *.gz)."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    raw = bytes([0, 0, 0x08, arr.ndim]) + np.array(arr.shape, ">u4").tobytes() + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if path.name.endswith(".gz") else raw)


def rand_images(rng, n, h=28, w=28):
    return rng.integers(0, 256, size=(n, h, w), dtype=np.uint8)


# ----------------------------------------------------------------------------- digits


def test_digits_shapes_and_fixed_split():
    tr, te = load_dataset("digits", None, train=True), load_dataset("digits", None, train=False)
    assert tr.x.shape == (1347, 1, 28, 28) and te.x.shape == (450, 1, 28, 28)
    assert tr.x.dtype == np.uint8 and tr.y.dtype == np.int64
    assert tr.num_classes == 10 and tr.x.max() == 255 and tr.x.min() == 0
    # Disjoint stratified split of the 1797 samples: sizes add up, every class in both.
    assert len(tr) + len(te) == 1797
    assert set(np.unique(tr.y)) == set(np.unique(te.y)) == set(range(10))
    again = load_dataset("digits", None, train=False)
    np.testing.assert_array_equal(again.x, te.x)  # stable across calls


# ----------------------------------------------------------------------------- IDX / MNIST-like


def test_read_idx_roundtrip_and_errors(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", a)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), a)
    # int32 big-endian payload
    b = np.array([1, -2, 70000], dtype=">i4")
    (tmp_path / "b").write_bytes(bytes([0, 0, 0x0C, 1]) + np.array([3], ">u4").tobytes() + b.tobytes())
    np.testing.assert_array_equal(read_idx(tmp_path / "b"), [1, -2, 70000])
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match="magic"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1]) + np.array([10], ">u4").tobytes() + b"abc")
    with pytest.raises(DataError, match="bytes"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("layout", ["flat_gz", "torchvision_raw"])
def test_mnist_layouts(tmp_path, layout):
    rng = np.random.default_rng(0)
    x, y = rand_images(rng, 7), rng.integers(0, 10, 7).astype(np.uint8)
    if layout == "flat_gz":
        d, sfx = tmp_path, ".gz"
    else:
        d, sfx = tmp_path / "FashionMNIST" / "raw", ""  # torchvision leaves them unzipped
    write_idx(d / f"t10k-images-idx3-ubyte{sfx}", x)
    write_idx(d / f"t10k-labels-idx1-ubyte{sfx}", y)
    got = load_dataset("fashion_mnist", tmp_path, train=False)
    assert got.x.shape == (7, 1, 28, 28) and got.x.dtype == np.uint8 and got.y.dtype == np.int64
    np.testing.assert_array_equal(got.x[:, 0], x)
    np.testing.assert_array_equal(got.y, y)
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        load_dataset("fashion_mnist", tmp_path, train=True)  # only the test files exist


@pytest.mark.parametrize("name,folder", [("mnist", "mnist"), ("fashion_mnist", "fashion-mnist")])
def test_real_mnist_like(name, folder):
    root = need(SHARED / folder)
    tr, te = load_dataset(name, root, train=True), load_dataset(name, root, train=False)
    assert tr.x.shape == (60000, 1, 28, 28) and te.x.shape == (10000, 1, 28, 28)
    assert tr.x.dtype == np.uint8 and tr.y.dtype == np.int64
    assert tr.y.min() == 0 and tr.y.max() == 9 and te.y.min() == 0 and te.y.max() == 9
    assert tr.num_classes == 10 and tr.name == name
    # The parent folder works too (root/mnist, root/fashion-mnist).
    assert len(load_dataset(name, root.parent, train=False)) == 10000


# ----------------------------------------------------------------------------- EMNIST


@pytest.mark.parametrize("split,ncls,offset", [("balanced", 47, 0), ("letters", 26, 1), ("digits", 10, 0)])
def test_emnist_split_transpose_and_labels(tmp_path, split, ncls, offset):
    rng = np.random.default_rng(1)
    img = rand_images(rng, 5)
    y = (rng.integers(0, ncls, 5) + offset).astype(np.uint8)
    raw = tmp_path / "EMNIST" / "raw"
    # The files store every image transposed.
    write_idx(raw / f"emnist-{split}-train-images-idx3-ubyte.gz", img.transpose(0, 2, 1))
    write_idx(raw / f"emnist-{split}-train-labels-idx1-ubyte.gz", y)
    name = "emnist" if split == "balanced" else f"emnist:{split}"
    got = load_dataset(name, tmp_path, train=True)
    assert got.num_classes == ncls and got.name == f"emnist:{split}"
    np.testing.assert_array_equal(got.x[:, 0], img)
    np.testing.assert_array_equal(got.y, y.astype(np.int64) - offset)
    assert got.x.flags.c_contiguous


def test_emnist_flat_root_and_errors(tmp_path):
    rng = np.random.default_rng(2)
    write_idx(tmp_path / "emnist-byclass-test-images-idx3-ubyte", rand_images(rng, 3))
    write_idx(tmp_path / "emnist-byclass-test-labels-idx1-ubyte", np.array([0, 61, 5], np.uint8))
    got = load_dataset("emnist:byclass", tmp_path, train=False)
    assert got.num_classes == 62 and len(got) == 3
    with pytest.raises(DataError, match="unknown EMNIST split"):
        load_dataset("emnist:nope", tmp_path, train=False)
    with pytest.raises(DataError, match="emnist-byclass-train-images"):
        load_dataset("emnist:byclass", tmp_path, train=True)


# ----------------------------------------------------------------------------- CIFAR pickles


def cifar_batch(rng, n, label_key, ncls, bytes_keys):
    """A batch dict shaped like the official ones (data [n, 3072] uint8, row-major CHW)."""
    d = {
        "batch_label": "testing batch",
        label_key: rng.integers(0, ncls, n).tolist(),
        "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        "filenames": [f"img_{i}.png" for i in range(n)],
    }
    return {k.encode(): v for k, v in d.items()} if bytes_keys else d


def test_cifar10_pickles(tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        b = cifar_batch(rng, 4, "labels", 10, bytes_keys=False)
        batches.append(b)
        (folder / name).write_bytes(pickle.dumps(b, protocol=2))  # the official protocol
    tr = load_dataset("cifar10", tmp_path, train=True)
    te = load_dataset("cifar10", tmp_path, train=False)
    assert tr.x.shape == (20, 3, 32, 32) and te.x.shape == (4, 3, 32, 32) and tr.x.dtype == np.uint8
    np.testing.assert_array_equal(tr.x[4], batches[1]["data"][0].reshape(3, 32, 32))
    np.testing.assert_array_equal(tr.y[:4], batches[0]["labels"])
    np.testing.assert_array_equal(te.y, batches[5]["labels"])
    assert tr.num_classes == 10 and tr.y.dtype == np.int64


def test_cifar100_pickles_bytes_keys(tmp_path):
    rng = np.random.default_rng(4)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 6), ("test", 3)):
        b = cifar_batch(rng, n, "fine_labels", 100, bytes_keys=True)
        b[b"coarse_labels"] = [0] * n
        (folder / name).write_bytes(pickle.dumps(b, protocol=5))
    tr = load_dataset("cifar100", tmp_path, train=True)
    assert tr.x.shape == (6, 3, 32, 32) and tr.num_classes == 100
    assert len(load_dataset("cifar100", tmp_path, train=False)) == 3


@pytest.mark.parametrize(
    "data, labels, words",
    [
        (np.zeros((4, 100), np.uint8), [0] * 4, "cannot reshape"),  # not 3 x 32 x 32 rows
        (np.zeros((4, 3072), np.uint8), [0] * 3, "4 images, 3 labels"),  # was accepted: 3 labels for 4 images
        ([1, 2, 3], "x", "ValueError"),
    ],
)
def test_a_cifar_batch_of_another_layout_is_named(tmp_path, data, labels, words):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps({"data": data, "labels": labels}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_1: expected 'data' as rows of 3 x 32 x 32 bytes") as exc:
        load_dataset("cifar10", tmp_path, train=True)
    assert words in str(exc.value)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_pickle_with_forbidden_global_is_rejected(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    evil = {"data": np.zeros((1, 3072), np.uint8), "fine_labels": [0], "x": _Evil(marker)}
    payload = pickle.dumps(evil, protocol=2)
    (folder / "test").write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError, match="forbidden"):
        ds._RestrictedUnpickler(io.BytesIO(payload), encoding="latin1").load()
    with pytest.raises(DataError, match="forbidden global"):
        load_dataset("cifar100", tmp_path, train=False)
    assert not marker.exists()


# ----------------------------------------------------------------------------- image folders


COLORS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "ant": (30, 30, 200)}


def write_tree(base: Path, n_train=3, n_test=2, ext=".jpg") -> None:
    from PIL import Image

    for split, n in (("train", n_train), ("test", n_test)):
        for cls, col in COLORS.items():
            d = base / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), col).save(d / f"{i:04d}{ext}")


def check_tree_dataset(tr, te):
    assert tr.classes == ["ant", "cat", "dog"]  # sorted folder names
    assert tr.x.shape == (9, 3, 32, 32) and te.x.shape == (6, 3, 32, 32) and tr.x.dtype == np.uint8
    np.testing.assert_array_equal(tr.y, np.repeat([0, 1, 2], 3))
    for i, cls in enumerate(tr.classes):
        px = tr.x[tr.y == i].reshape(3, 3, -1).mean(axis=(0, 2))
        assert np.abs(px - COLORS[cls]).max() < 4  # JPEG is lossy, a flat colour barely


def test_imagefolder_tarball_cached(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write_tree(src / "cifar10-jpg")
    tar_dir = tmp_path / "data"
    tar_dir.mkdir()
    with tarfile.open(tar_dir / "tiny.tar.gz", "w:gz") as tf:
        tf.add(src / "cifar10-jpg", arcname="cifar10-jpg")
    tr = load_dataset("cifar10_jpg", tar_dir, train=True)
    te = load_dataset("imagefolder", tar_dir / "tiny.tar.gz", train=False)
    check_tree_dataset(tr, te)

    # Second load must come from the .npz cache, not the tarball.
    def boom(*a, **k):
        raise AssertionError("tarball re-read instead of the cache")

    monkeypatch.setattr(ds, "_read_tarball", boom)
    t = time.perf_counter()
    again = load_dataset("cifar10_jpg", tar_dir, train=True)
    assert time.perf_counter() - t < 1.0
    np.testing.assert_array_equal(again.x, tr.x)
    assert list((tmp_path / "cache" / "imagefolder").glob("*.npz"))


def test_imagefolder_plain_tree_png(tmp_path):
    write_tree(tmp_path / "tree", ext=".png")  # not JPEG: the PIL path
    check_tree_dataset(
        load_dataset("imagefolder", tmp_path / "tree", train=True),
        load_dataset("imagefolder", tmp_path / "tree", train=False),
    )


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_an_image_that_does_not_decode_is_named_with_its_folder(tmp_path, ext):
    """A truncated or mislabelled file in an image folder was a PIL traceback."""
    write_tree(tmp_path / "tree", ext=ext)
    (tmp_path / "tree" / "train" / "dog" / f"0001{ext}").write_bytes(b"not an image")
    with pytest.raises(DataError, match=rf"tree/train/dog/0001\{ext}: not an image PIL can read \(Unidentified"):
        load_dataset("imagefolder", tmp_path / "tree", train=True)


@pytest.mark.slow
def test_flt_runs_on_an_image_folder_whose_pictures_are_not_multiples_of_4(tmp_path):
    """10 x 14 pictures: FLT's ConvAE raised "divisible by 4" after FedAvg had run; it
    now pads them, and finds the two planted clusters."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 60), ("test", 20)):
        for c in range(4):
            (tmp_path / "tree" / split / f"c{c}").mkdir(parents=True)
            for i in range(n):
                pixels = (rng.random((10, 14, 3)) * 60 + c * 60).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / "tree" / split / f"c{c}" / f"{i}.png")
    res = flt_run(
        QUICKSTART,
        tmp_path / "run",
        "data.dataset=imagefolder",
        f"data.root={tmp_path / 'tree'}",
        "partition.clients=8",
        "partition.clusters=2",
        "partition.samples_per_client=20",
        "partition.test_per_client=5",
        "train.rounds=2",
        "methods=[fedavg, {name: flt, encoder: {dataset: public, epochs: 2}}]",
    )
    assert res.returncode == 0, res.stderr
    fcr = json.loads((tmp_path / "run" / "summary.json").read_text())["methods"]["flt"]["fcr"]
    assert fcr["clusters"] == 2 and fcr["ari"] == 1.0, fcr
    # the CIFAR CNN's two 5x5 convolutions need 16 x 16: one line, before any run folder
    small = flt_run(
        QUICKSTART, tmp_path / "cnn", "data.dataset=imagefolder", f"data.root={tmp_path / 'tree'}", "model=cifar_cnn"
    )
    assert small.returncode == 2 and small.stderr.startswith("error: model: cifar_cnn cannot take 10 x 14 images (")
    assert "Traceback" not in small.stderr and not (tmp_path / "cnn").exists()


@pytest.mark.parametrize("bad", ["../evil.jpg", "/abs/train/cat/0.jpg", "symlink"])
def test_imagefolder_rejects_unsafe_tarball(tmp_path, bad):
    path = tmp_path / "bad.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("train/cat/0001.jpg")
        if bad == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
        else:
            info.name, info.size = bad, 3
            tf.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(DataError, match=r"unsafe|non-regular"):
        load_dataset("imagefolder", path, train=True)
    assert not (tmp_path / "evil.jpg").exists()


@pytest.mark.slow
def test_real_cifar10_jpg():
    # The one-off decode of all 60k JPEGs takes ~6 s; the reload must come from the cache.
    root = need(SHARED / "cifar10-jpg")
    tr = load_dataset("cifar10_jpg", root, train=True)
    t = time.perf_counter()
    te = load_dataset("cifar10_jpg", root, train=False)
    assert time.perf_counter() - t < 1.0
    assert tr.x.shape == (50000, 3, 32, 32) and te.x.shape == (10000, 3, 32, 32)
    assert tr.classes[:3] == ["airplane", "automobile", "bird"] and tr.num_classes == 10
    assert np.bincount(te.y).tolist() == [1000] * 10


# ----------------------------------------------------------------------------- FEMNIST


def write_leaf(root: Path) -> None:
    rng = np.random.default_rng(5)

    def user(n):
        return {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}

    files = {
        "train": [{"f_b": 3, "f_a": 2}, {"f_c": 4}],
        "test": [{"f_b": 1, "f_a": 1}, {"f_c": 2}],
    }
    for part, chunks in files.items():
        (root / part).mkdir(parents=True)
        for i, users in enumerate(chunks):
            d = {
                "users": list(users),
                "num_samples": list(users.values()),
                "user_data": {u: user(n) for u, n in users.items()},
            }
            (root / part / f"all_data_{i}.json").write_text(json.dumps(d))


def test_femnist_small_leaf_json(tmp_path):
    write_leaf(tmp_path / "femnist")
    tr = load_dataset("femnist", tmp_path / "femnist", train=True)
    te = load_dataset("femnist", tmp_path / "femnist", train=False)
    assert tr.x.shape == (9, 1, 28, 28) and te.x.shape == (4, 1, 28, 28) and tr.x.dtype == np.uint8
    assert tr.num_classes == 62 and tr.group_names == te.group_names == ["f_a", "f_b", "f_c"]
    # File order, then the file's user order: f_b (3), f_a (2), f_c (4).
    np.testing.assert_array_equal(tr.groups, [1, 1, 1, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(te.groups, [1, 0, 2, 2])
    raw = json.loads((tmp_path / "femnist" / "train" / "all_data_0.json").read_text())
    ink = 1 - np.array(raw["user_data"]["f_b"]["x"][0], dtype=np.float32)  # bright ink
    first = np.rint(ink * 255).reshape(28, 28)
    np.testing.assert_array_equal(tr.x[0, 0], first)
    np.testing.assert_array_equal(tr.y[:3], raw["user_data"]["f_b"]["y"])
    assert list((tmp_path / "cache" / "femnist").glob("*.npz"))  # parsed once, cached


@pytest.mark.slow
def test_real_femnist():
    root = need(SHARED / "femnist")
    tr, te = load_dataset("femnist", root, train=True), load_dataset("femnist", root, train=False)
    assert len(tr) == 14708 and len(te) == 1685
    assert len(tr.group_names) == 105 and len(np.unique(tr.groups)) == 105 and len(np.unique(te.groups)) == 105
    assert tr.x.shape[1:] == (1, 28, 28) and tr.y.max() < 62 and tr.y.min() >= 0
    t = time.perf_counter()
    again = load_dataset("femnist", root, train=True)
    assert time.perf_counter() - t < 1.0
    np.testing.assert_array_equal(again.groups, tr.groups)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "digits"] + ["emnist:letters"])
def test_missing_root_names_dataset_and_path(tmp_path, name):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as e:
        load_dataset(name, missing, train=True)
    assert str(missing) in str(e.value) and name.split(":")[0] in str(e.value)
    if name.split(":")[0] in ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100"):  # torchvision fetches
        assert "data.root" in str(e.value) and "data.download: true" in str(e.value)  # the scenario's fields


def test_no_root_and_unknown_name():
    with pytest.raises(DataError, match="needs a root"):
        load_dataset("mnist", None, train=True)
    with pytest.raises(DataError, match="unknown"):
        load_dataset("imagenet", "/tmp", train=True)


# ----------------------------------------------------------------------------- finding the image folder


def write_empty_leaf(base: Path) -> None:
    """A FEMNIST-like folder: train/ and test/ of JSON files, no class folders."""
    for split in ("train", "test"):
        (base / split).mkdir(parents=True)
        (base / split / "all.json").write_text(json.dumps({"users": [], "num_samples": [], "user_data": {}}))


def test_imagefolder_in_a_folder_of_datasets_skips_trees_without_class_images(tmp_path):
    # the shared data layout: FEMNIST's train/ and test/ sit beside the image tree
    write_empty_leaf(tmp_path / "data" / "femnist")
    write_tree(tmp_path / "data" / "cifar10-jpg", ext=".png")
    tr = load_dataset("cifar10_jpg", tmp_path / "data", train=True)
    check_tree_dataset(tr, load_dataset("cifar10_jpg", tmp_path / "data", train=False))


def test_imagefolder_with_no_or_several_candidates_names_what_it_found(tmp_path):
    write_empty_leaf(tmp_path / "data" / "femnist")
    with pytest.raises(DataError) as exc:
        load_dataset("cifar10_jpg", tmp_path / "data", train=True)
    msg = str(exc.value)
    assert "cifar10_jpg" in msg and str(tmp_path / "data") in msg
    assert str(tmp_path / "data" / "femnist") in msg and "without class folders of images" in msg

    write_tree(tmp_path / "data" / "a", ext=".png")
    write_tree(tmp_path / "data" / "b", ext=".png")
    with pytest.raises(DataError, match="several image folders") as exc:
        load_dataset("cifar10_jpg", tmp_path / "data", train=True)
    assert str(tmp_path / "data" / "a") in str(exc.value) and str(tmp_path / "data" / "b") in str(exc.value)


def test_an_empty_dataset_is_a_data_error_naming_dataset_and_root(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rand_images(rng, 0))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(0, np.uint8))
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", tmp_path, train=True)
    assert "'mnist'" in str(exc.value) and str(tmp_path) in str(exc.value) and "0 images" in str(exc.value)


def test_labels_outside_the_datasets_classes_are_a_data_error(tmp_path):
    """MNIST-format files with labels up to 199: the run went on to fail far away (every
    device's k-means on empty shards, "FCR: no client sent centroids")."""
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rand_images(rng, 50))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.full(50, 199, np.uint8))
    with pytest.raises(DataError, match=r"train split's labels run from 199 to 199, outside its 10 classes 0\.\.9"):
        load_dataset("mnist", tmp_path, train=True)


# ----------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_gzip_is_a_data_error_naming_the_file(tmp_path, damage):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", rand_images(rng, 50))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 50).astype(np.uint8))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else raw[:20] + b"\xff" * 200 + raw[220:])
    with pytest.raises(DataError, match="corrupt or truncated") as exc:
        load_dataset("mnist", tmp_path, train=True)
    assert str(path) in str(exc.value)


def test_truncated_tarball_and_broken_leaf_json_are_data_errors(tmp_path):
    write_tree(tmp_path / "src", ext=".png")
    tar = tmp_path / "t.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(tmp_path / "src", arcname="src")
    tar.write_bytes(tar.read_bytes()[:300])
    with pytest.raises(DataError, match="corrupt or truncated archive"):
        load_dataset("imagefolder", tar, train=True)

    leaf = tmp_path / "leaf"
    write_empty_leaf(leaf)
    (leaf / "train" / "all.json").write_text('{"users": ["a"], "user_data": {"a": {"x": [[0.1')
    with pytest.raises(DataError, match=r"all.json: not LEAF JSON"):
        load_dataset("femnist", leaf, train=True)
    write_empty_leaf(tmp_path / "empty")
    with pytest.raises(DataError, match="no samples"):
        load_dataset("femnist", tmp_path / "empty", train=True)


@pytest.mark.parametrize(
    "record, words",
    [
        ({"x": [[0.5]], "y": [1]}, "cannot reshape"),  # one pixel, not 784
        ({"x": [[0.5] * 784] * 2, "y": [1]}, "2 images, 1 labels"),
        ({"x": [[0.5] * 784], "y": [-3]}, "labels >= 0"),
        ({"x": [[0.5] * 784]}, "KeyError"),
        ([1, 2], "TypeError"),
    ],
)
def test_a_leaf_writer_of_the_wrong_shape_is_named_with_its_file(tmp_path, record, words):
    """Valid JSON, wrong record: was a numpy traceback ("cannot reshape") on load."""
    write_leaf(tmp_path / "leaf")
    bad = tmp_path / "leaf" / "train" / "all_data_1.json"
    bad.write_text(json.dumps({"users": ["f_c"], "user_data": {"f_c": record}}))
    with pytest.raises(DataError, match=r"all_data_1\.json: writer 'f_c': expected 'x' of 784-pixel") as exc:
        load_dataset("femnist", tmp_path / "leaf", train=True)
    assert words in str(exc.value)


def test_emnist_balanced_feeds_s4s_structured_sampler(tmp_path):
    """scenarios/s4_emnist.yaml end to end up to the partition, on a small EMNIST-balanced
    written here in its own format (flat folder, gzip'd IDX, transposed images)."""
    from flt.emulator.config import load
    from flt.emulator.run import build_partition, hold_out_public, load_data

    rng = np.random.default_rng(3)
    for part, per_class in (("train", 60), ("test", 10)):
        y = np.repeat(np.arange(47, dtype=np.uint8), per_class)
        write_idx(tmp_path / f"emnist-balanced-{part}-images-idx3-ubyte.gz", rand_images(rng, len(y)))
        write_idx(tmp_path / f"emnist-balanced-{part}-labels-idx1-ubyte.gz", y)
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "s4_emnist.yaml"
    cfg = load(scenario, [f"data.root={tmp_path}", "partition.clients=50"])
    train, test = load_data(cfg)
    assert train.num_classes == 47 and len(train) == 47 * 60
    public = hold_out_public(cfg, len(train.y))
    p = build_partition(cfg, train, test, public)
    assert min(len(t) for t in p.train) >= 20 and len(public) == int(0.05 * 47 * 60)
    # every image of classes 0-40 (41-46 belong to no cluster) outside the public slice, once
    used = np.sort(np.concatenate(p.train))
    assert np.array_equal(used, np.setdiff1d(np.flatnonzero(train.y <= 40), public))
    # C = 10 clusters of 5 classes, 4 apart over 47: neighbours share one class
    for c in range(10):
        held = np.unique(np.concatenate([train.y[p.train[m]] for m in np.flatnonzero(p.cluster == c)]))
        assert held.tolist() == list(range(4 * c, 4 * c + 5))


# ----------------------------------------------------------------------------- a damaged or unwritable cache


def damage(path: Path, how: str) -> None:
    """A cache file emptied, cut in half, or overwritten with other bytes of its length."""
    data = path.read_bytes()
    new = {"empty": b"", "half": data[: len(data) // 2], "garbage": np.random.default_rng(1).bytes(len(data))}
    path.write_bytes(new[how])


def write_dataset(kind: str, base: Path) -> tuple[str, Path]:
    if kind == "imagefolder":
        write_tree(base / "tree")
        return "imagefolder", base / "tree"
    write_leaf(base / "femnist")
    return "femnist", base / "femnist"


@pytest.mark.parametrize("how", ["empty", "half", "garbage"])
@pytest.mark.parametrize("kind", ["imagefolder", "femnist"])
def test_a_damaged_decoded_cache_is_decoded_again_with_a_warning(tmp_path, kind, how, caplog):
    """A cache only saves work: a file cut short (a crash, a full disk) or overwritten is
    rebuilt from the source, never a traceback that stops the run."""
    name, root = write_dataset(kind, tmp_path)
    first = load_dataset(name, root, train=True)
    (npz,) = (tmp_path / "cache").rglob("*.npz")
    damage(npz, how)
    again = load_dataset(name, root, train=True)
    np.testing.assert_array_equal(again.x, first.x)
    np.testing.assert_array_equal(again.y, first.y)
    assert f"cache file {npz} cannot be read" in caplog.text
    caplog.clear()
    np.testing.assert_array_equal(load_dataset(name, root, train=False).y, load_dataset(name, root, False).y)
    assert "cannot be read" not in caplog.text  # the rebuilt file is whole again


@pytest.mark.parametrize("kind", ["imagefolder", "femnist"])
def test_an_unwritable_cache_folder_decodes_and_warns(tmp_path, monkeypatch, kind, caplog):
    (tmp_path / "file").write_text("")  # a folder under a file cannot be made, even by root
    monkeypatch.setenv("FLT_CACHE", str(tmp_path / "file" / "cache"))
    name, root = write_dataset(kind, tmp_path)
    got = load_dataset(name, root, train=False)
    assert len(got.y) == len(got.x) > 0
    assert "cannot write the cache file" in caplog.text and str(tmp_path / "file") in caplog.text
