"""benchmarks/jpeg_dose.py: the re-encoded tree must be the same images (names, classes,
splits) at the asked quality, readable by the loader a scenario uses, and a lower quality
must cost more pixel error, or the dose-response it measures means nothing."""

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image, JpegImagePlugin

from flt.scenarios.datasets import load_dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import jpeg_dose  # noqa: E402


def textured_tarball(tmp_path: Path) -> Path:
    """A cifar10-jpg-shaped tarball of noisy images (flat colours would survive any quality)."""
    rng = np.random.default_rng(0)
    tree = tmp_path / "src" / "cifar10-jpg"
    for split, n in (("train", 3), ("test", 2)):
        for cls in ("cat", "dog"):
            (tree / split / cls).mkdir(parents=True)
            for i in range(n):
                px = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(px).save(tree / split / cls / f"{i:04d}.jpg", quality=jpeg_dose.SHIPPED_QUALITY)
    tar = tmp_path / "cifar10-jpg.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(tree, arcname="cifar10-jpg")
    return tar


def test_reencoded_tree_is_the_same_images_at_the_asked_quality(tmp_path):
    out = tmp_path / "q30"
    sample = jpeg_dose.reencode_tree(textured_tarball(tmp_path), out, quality=30)
    assert len(sample) == 10
    # a data root holding the tarball reads the same images, as a scenario's data.root does
    again = jpeg_dose.reencode_tree(tmp_path, tmp_path / "again", quality=30)
    assert all(np.array_equal(a, b) for a, b in zip(sample, again, strict=True))
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jpg"))
    names = [f"{s}/{c}/{i:04d}.jpg" for s, n in (("train", 3), ("test", 2)) for c in ("cat", "dog") for i in range(n)]
    assert files == sorted(names)
    want = Image.open(io.BytesIO(jpeg_dose.encode(Image.fromarray(sample[0]), 30))).quantization
    written = Image.open(out / files[0])
    assert written.quantization == want
    assert JpegImagePlugin.get_sampling(written) == 2  # 4:2:0, the shipped copy's subsampling
    train = load_dataset("cifar10_jpg", out, train=True)
    assert train.classes == ["cat", "dog"] and train.x.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(train.y, [0, 0, 0, 1, 1, 1])


def test_lower_quality_costs_more_pixel_error():
    tiles = jpeg_dose.lossless_tiles(8)
    assert tiles and all(t.shape == (32, 32, 3) for t in tiles)
    errors = [jpeg_dose.pass_error(tiles, q) for q in (90, 75, 50, 25)]
    assert errors == sorted(errors) and errors[0] > 0
