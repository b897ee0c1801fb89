"""How much a further JPEG pass costs a CIFAR-10 run, to bound what the shipped JPEG copy
costs against the original (lossless) CIFAR-10, which cannot be had offline.

The shipped copy (`cifar10-jpg.tar.gz`) is PIL's baseline JPEG at quality 75 with 4:2:0
chroma subsampling (its quantisation tables are PIL's quality-75 tables). This script
writes the same ImageFolder tree, train and test, re-encoded at a lower quality, so the
same scenario can be rerun on it with `--set data.root=OUT`: the accuracy lost to that
further pass is the dose-response that bounds the first one.

It also prints each pass's pixel error, so the two passes can be compared:
- the shipped pass, measured on natural images of the same size without JPEG blocks of
  their own (32 x 32 tiles of scikit-learn's two sample photographs, each pixel the mean
  of a 4 x 4, 8 x 8 or 12 x 12 block: the coarser, the more detail a tile holds, as a
  CIFAR-10 image, reduced from a photograph, does) encoded at the shipped setting;
- the further pass, measured on the shipped images themselves.

    python benchmarks/jpeg_dose.py SRC OUT_DIR --quality 50   # SRC: the tarball or a data root
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_images

from flt.scenarios.datasets import read_image_folder

SHIPPED_QUALITY = 75  # read off the shipped files' quantisation tables


def encode(img: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality)  # PIL's default 4:2:0 chroma subsampling, as shipped
    return out.getvalue()


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def lossless_tiles(f: int, size: int = 32) -> list[np.ndarray]:
    """size x size tiles of scikit-learn's sample photographs, each pixel the mean of an
    f x f block: the photographs' own JPEG blocks average out."""
    tiles = []
    for photo in load_sample_images().images:
        h, w = (photo.shape[0] // f) * f, (photo.shape[1] // f) * f
        small = photo[:h, :w].reshape(h // f, f, w // f, f, 3).mean(axis=(1, 3)).round().astype(np.uint8)
        for y in range(0, small.shape[0] - size + 1, size):
            for x in range(0, small.shape[1] - size + 1, size):
                tiles.append(small[y : y + size, x : x + size])
    return tiles


def pass_error(images: list[np.ndarray], quality: int) -> float:
    """Mean over images of the RMSE (0-255 scale) that one JPEG pass at `quality` adds."""
    return float(np.mean([rmse(im, one_pass(im, quality)) for im in images]))


def one_pass(im: np.ndarray, quality: int) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(encode(Image.fromarray(im), quality))))


def reencode_tree(src: Path, out: Path, quality: int) -> list[np.ndarray]:
    """Write the train/ and test/ images under src (a data root, read by the scenario's own
    loader) re-encoded at `quality` under out; returns 500 source images spread over the
    splits and classes, decoded, for the error figure."""
    items = sorted(read_image_folder(src))
    for split, cls, name, data in items:
        target = out / split / cls / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(encode(decode(data), quality))
    print(f"re-encoded {len(items)} images at quality {quality} into {out}")
    return [np.asarray(decode(data)) for *_, data in items[:: max(1, len(items) // 500)][:500]]


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="the shipped cifar10-jpg.tar.gz, or a folder holding it or its tree")
    ap.add_argument("out", type=Path, help="folder for the re-encoded train/ and test/ tree")
    ap.add_argument("--quality", type=int, required=True, help="JPEG quality of the further pass (1-95)")
    args = ap.parse_args()
    shipped = reencode_tree(args.src, args.out, args.quality)
    for f in (4, 8, 12):
        tiles = lossless_tiles(f)
        err = pass_error(tiles, SHIPPED_QUALITY)
        print(f"shipped pass (quality {SHIPPED_QUALITY}) on {len(tiles)} tiles reduced {f}x: RMSE {err:.2f}")
    err = pass_error(shipped, args.quality)
    print(f"further pass (quality {args.quality}) on {len(shipped)} shipped images: RMSE {err:.2f}")


if __name__ == "__main__":
    main()
