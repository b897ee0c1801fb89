"""Dataset loaders: every supported dataset as uint8 arrays, no downloads unless asked.

All loaders return a :class:`Dataset` whose ``x`` is ``uint8 [N, C, H, W]`` (0..255) and
whose ``y`` is ``int64 [N]``. Nothing is normalised here: a model's transform is the
model's business, and uint8 keeps shards small in memory and on disk.

Supported names (``DATASETS``):

``digits``
    scikit-learn's 8x8 digits (ships inside scikit-learn), upsampled to 28x28; a fixed
    stratified 75/25 split (``random_state=0``) because digits has no official split.
``mnist``, ``fashion_mnist``
    the four gzip'd IDX files, flat in ``root`` (as ``../shared/data/mnist``), in
    ``root/mnist`` / ``root/fashion-mnist``, or in torchvision's ``root/MNIST/raw`` /
    ``root/FashionMNIST/raw`` (``.gz`` or unzipped).
``emnist`` / ``emnist:<split>``
    torchvision's EMNIST IDX files (``emnist-<split>-train-images-idx3-ubyte[.gz]``...),
    default split ``balanced``. Images are stored transposed in the files; we undo it.
``cifar10``, ``cifar100``
    the official python-pickle batches, read with a restricted unpickler.
``cifar10_jpg`` (alias ``imagefolder``)
    an ImageFolder tree ``train/<class>/*.jpg``, ``test/<class>/*.jpg``, or a ``.tar.gz``
    holding one; a tarball is read as one stream (never extracted to disk) and the
    decoded arrays are cached, so only the first load pays for JPEG decoding. The root
    is the tree or tarball, or a folder whose only one sits in it or one folder down
    (a tree counts only if its class folders hold images).
``femnist``
    LEAF JSON (``root/train/*.json``, ``root/test/*.json``); the writer of every sample is
    returned in ``groups`` (index into the sorted list of all writer ids, the same in
    train and test) so writers can become natural clients. Pixels are inverted to bright
    ink on black, the convention of MNIST and EMNIST (LEAF stores dark ink on white).

Caches (decoded ``.npz`` arrays) live in ``$FLT_CACHE`` (default
``~/.cache/flt``). Cache keys include the source's path, size and mtime (all files for
FEMNIST) and a format version, and cache files are written to a temporary name and then
renamed, so several device processes may load the same dataset at once. A cache file
that cannot be read (cut short, damaged) is rebuilt, and one that cannot be written (a
read-only cache folder, a full disk) is skipped, each with a warning naming it.
:func:`load_shared` maps a split read-only from an uncompressed ``.npy`` cache named by
its content, so the device processes of one host share a single copy of its pages.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import pickle
import tarfile
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from flt.common.errors import FltError, short
from flt.common.files import cache_dir, npz_writer, read_cache, write_atomic, write_cache

log = logging.getLogger(__name__)

__all__ = [
    "DATASETS",
    "EMNIST_SPLITS",
    "DataError",
    "Dataset",
    "dataset_key",
    "load_dataset",
    "load_shared",
    "read_idx",
]

DATASETS = (
    "digits",
    "mnist",
    "fashion_mnist",
    "emnist",
    "cifar10",
    "cifar100",
    "cifar10_jpg",
    "imagefolder",
    "femnist",
)

# EMNIST split -> number of classes (torchvision's names).
EMNIST_SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}

# Bumped whenever the layout of a cached .npz changes, so stale caches are never reused.
_CACHE_VERSION = 1


class DataError(FltError):
    """A dataset cannot be loaded; the message names the dataset and what is missing."""


@dataclass
class Dataset:
    """One split of a dataset.

    ``groups``/``group_names`` are set only where samples have a natural owner (FEMNIST
    writers); ``classes`` holds class names where the source has them (image folders).
    """

    x: np.ndarray  # uint8 [N, C, H, W], 0..255
    y: np.ndarray  # int64 [N]
    num_classes: int
    name: str
    groups: np.ndarray | None = None  # int64 [N]: index into group_names
    group_names: list[str] | None = None
    classes: list[str] | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])


# ----------------------------------------------------------------------------- helpers


def _key(*parts: object) -> str:
    h = hashlib.sha256(repr((_CACHE_VERSION, *parts)).encode())
    return h.hexdigest()[:20]


# What a damaged file raises while it is read: a bad gzip header or CRC, a stream that
# ends early, a broken deflate block, a bad tar header.
_DAMAGED = (OSError, EOFError, zlib.error, tarfile.TarError, pickle.UnpicklingError)


def _read_bytes(path: Path) -> bytes:
    """A whole file, gunzipped when it ends in .gz; a corrupt or truncated file is a DataError."""
    try:
        with gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb") as f:
            return f.read()
    except _DAMAGED as exc:
        raise DataError(f"{path}: corrupt or truncated file ({type(exc).__name__}: {exc})") from None


_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip'd): magic ``0 0 <dtype> <ndim>``, then ``ndim``
    big-endian uint32 dimensions, then the big-endian data."""
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4]!r})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    count = int(np.prod(dims, dtype=np.int64))
    if len(raw) != header + count * dtype.itemsize:
        raise DataError(
            f"{path}: IDX header says {dims} x {dtype.itemsize} bytes but the file holds {len(raw) - header} data bytes"
        )
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)  # native order, writable


def _find_or_download(
    find: Callable[[], list[Path] | None], tv_name: str, root: Path, train: bool, download: bool
) -> list[Path] | None:
    """Local files first; torchvision's downloader only when asked (and online)."""
    found = find()
    if found is None and download:
        import torchvision.datasets as tvd

        getattr(tvd, tv_name)(str(root), train=train, download=True)
        found = find()
    return found


def _find_file(dirs: list[Path], name: str) -> Path | None:
    for d in dirs:
        for cand in (d / name, d / (name + ".gz")):
            if cand.is_file():
                return cand
    return None


def _need_root(name: str, root: str | os.PathLike | None) -> Path:
    if root is None:
        raise DataError(f"dataset '{name}': needs a root folder (root=None given)")
    return Path(root).expanduser()


# a scenario's fields first: the command line is where most users meet this error
FETCH_HINT = "set data.root to the folder that holds them, or data.download: true (download=True) to fetch them"


def _fmt_dirs(dirs: list[Path]) -> str:
    return ", ".join(str(d) for d in dirs)


# ----------------------------------------------------------------------------- digits


def _load_digits(train: bool) -> Dataset:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    y = d.target.astype(np.int64)
    idx_tr, idx_te = train_test_split(np.arange(len(y)), test_size=0.25, random_state=0, stratify=y)
    idx = np.sort(idx_tr if train else idx_te)  # keep the original sample order
    img = torch.from_numpy(d.images[idx].astype(np.float32))[:, None]  # [N,1,8,8], 0..16
    up = F.interpolate(img, size=(28, 28), mode="bilinear", align_corners=False)
    x = (up * (255.0 / 16.0)).round().clamp(0, 255).to(torch.uint8).numpy()
    return Dataset(x=x, y=y[idx], num_classes=10, name="digits")


# ----------------------------------------------------------------------------- MNIST-like


_MNIST_LIKE = {
    # name: (torchvision class name, extra flat sub-folder names)
    "mnist": ("MNIST", ("mnist",)),
    "fashion_mnist": ("FashionMNIST", ("fashion-mnist", "fashion_mnist", "FashionMNIST")),
}


def _load_mnist_like(name: str, root: Path | None, train: bool, download: bool) -> Dataset:
    tv_name, flat_names = _MNIST_LIKE[name]
    root = _need_root(name, root)
    prefix = "train" if train else "t10k"
    files = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    # Dataset-specific folders first: MNIST and Fashion-MNIST share their file names.
    dirs = [root / tv_name / "raw", *(root / n for n in flat_names), root]

    def find() -> list[Path] | None:
        found = [p for p in (_find_file(dirs, f) for f in files) if p is not None]
        return found if len(found) == len(files) else None

    found = _find_or_download(find, tv_name, root, train, download)
    if found is None:
        raise DataError(
            f"dataset '{name}': no IDX files in {root} (looked for "
            f"{files[0]}[.gz] and {files[1]}[.gz] in {_fmt_dirs(dirs)}; {FETCH_HINT})"
        )
    x, y = read_idx(found[0]), read_idx(found[1])
    return _idx_dataset(name, x, y, 10, found)


def _idx_dataset(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, files: list[Path]) -> Dataset:
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"dataset '{name}': {files[0]} / {files[1]} shapes {x.shape} / {y.shape} do not match")
    return Dataset(
        x=np.ascontiguousarray(x.astype(np.uint8, copy=False)[:, None]),
        y=y.astype(np.int64),
        num_classes=num_classes,
        name=name,
    )


# ----------------------------------------------------------------------------- EMNIST


def _load_emnist(split: str, root: Path | None, train: bool, download: bool) -> Dataset:
    name = f"emnist:{split}"
    if split not in EMNIST_SPLITS:
        raise DataError(f"dataset '{name}': unknown EMNIST split (known: {', '.join(EMNIST_SPLITS)})")
    root = _need_root(name, root)
    part = "train" if train else "test"
    files = (f"emnist-{split}-{part}-images-idx3-ubyte", f"emnist-{split}-{part}-labels-idx1-ubyte")
    # torchvision unpacks its gzip.zip into EMNIST/raw (older versions left EMNIST/raw/gzip).
    dirs = [root, root / "EMNIST" / "raw", root / "EMNIST" / "raw" / "gzip", root / "emnist", root / "gzip"]

    def find() -> list[Path] | None:
        found = [p for p in (_find_file(dirs, f) for f in files) if p is not None]
        return found if len(found) == len(files) else None

    found = find()
    if found is None and download:
        import torchvision.datasets as tvd

        tvd.EMNIST(str(root), split=split, train=train, download=True)
        found = find()
    if found is None:
        raise DataError(
            f"dataset '{name}': no IDX files in {root} (looked for {files[0]}[.gz] and "
            f"{files[1]}[.gz] in {_fmt_dirs(dirs)}; {FETCH_HINT})"
        )
    x, y = read_idx(found[0]), read_idx(found[1])
    ds = _idx_dataset(name, x, y, EMNIST_SPLITS[split], found)
    # The EMNIST files store each image transposed (column-major); swap H and W back.
    ds.x = np.ascontiguousarray(ds.x.transpose(0, 1, 3, 2))
    if split == "letters":
        ds.y = ds.y - 1  # letters are labelled 1..26
    if len(ds.y) and (ds.y.min() < 0 or ds.y.max() >= ds.num_classes):
        raise DataError(f"dataset '{name}': labels span {ds.y.min()}..{ds.y.max()}, expected 0..{ds.num_classes - 1}")
    return ds


# ----------------------------------------------------------------------------- CIFAR pickles


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR batches that can only rebuild numpy arrays.

    The official batches are plain dicts of lists, strings and one ndarray; an arbitrary
    pickle can run any callable on load, so every global outside this list is refused.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # protocol-5 pickles of arrays
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol 2 spells a bytes object under Python 3
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"forbidden global in pickle: {module}.{name}")
        if module.startswith("numpy.core."):
            module = "numpy._core." + module[len("numpy.core.") :]  # numpy>=2 location
        if module.startswith("numpy._core."):
            try:
                __import__(module)
            except ImportError:  # numpy 1.x
                module = "numpy.core." + module[len("numpy._core.") :]
        return super().find_class(module, name)


def _load_pickle(path: Path) -> dict:
    with open(path, "rb") as f:
        d = _RestrictedUnpickler(f, encoding="latin1").load()
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a dict, got {type(d).__name__}")
    # Python-2 pickles give str keys with latin1; pickles written as bytes keep bytes.
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in d.items()}


_CIFAR = {
    # name: (folder, train files, test files, label key, classes, torchvision class)
    "cifar10": (
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "labels",
        10,
        "CIFAR10",
    ),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "fine_labels", 100, "CIFAR100"),
}


def _load_cifar(name: str, root: Path | None, train: bool, download: bool) -> Dataset:
    folder, tr_files, te_files, label_key, ncls, tv_name = _CIFAR[name]
    root = _need_root(name, root)
    files = tr_files if train else te_files
    dirs = [root / folder, root]

    def find() -> list[Path] | None:
        for d in dirs:
            if all((d / f).is_file() for f in files):
                return [d / f for f in files]
        return None

    found = _find_or_download(find, tv_name, root, train, download)
    if found is None:
        raise DataError(
            f"dataset '{name}': no pickle batches in {root} (looked for {', '.join(files)} "
            f"in {_fmt_dirs(dirs)}; {FETCH_HINT})"
        )
    xs, ys = [], []
    for p in found:
        try:
            d = _load_pickle(p)
        except _DAMAGED as e:
            raise DataError(f"dataset '{name}': {p}: {type(e).__name__}: {e}") from None
        if "data" not in d or label_key not in d:
            raise DataError(f"dataset '{name}': {p} lacks 'data' or '{label_key}'")
        try:
            data = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(d[label_key], dtype=np.int64).reshape(-1)
            if len(labels) != len(data):
                raise ValueError(f"{len(data)} images, {len(labels)} labels")
        except (TypeError, ValueError) as e:  # another layout than CIFAR's [N, 3072] rows
            raise DataError(
                f"dataset '{name}': {p}: expected 'data' as rows of 3 x 32 x 32 bytes and one "
                f"'{label_key}' each ({type(e).__name__}: {short(str(e))})"
            ) from None
        xs.append(data)
        ys.append(labels)
    return Dataset(x=np.concatenate(xs), y=np.concatenate(ys), num_classes=ncls, name=name)


# ----------------------------------------------------------------------------- image folders


_IMG_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


def _split_member(name: str) -> tuple[str, str, str, str] | None:
    """``[prefix/]train|test/<class>/<file>`` -> (prefix, split, class, file), else None."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if len(parts) < 3 or parts[-3] not in ("train", "test"):
        return None
    if not parts[-1].lower().endswith(_IMG_EXT):
        return None
    return "/".join(parts[:-3]), parts[-3], parts[-2], parts[-1]


def _read_tarball(tar_path: Path) -> list[tuple[str, str, str, bytes]]:
    """All images of an image-folder tarball as (split, class, file name, bytes).

    The tarball is read as one stream and nothing is written to disk, which is safe by
    construction and ~5x faster than extracting 60k small files first (file creation
    dominates: 8-45 s measured here, against ~2 s to read the stream). Members with an
    absolute path, a '..' component or a link/device type are still refused, so a
    crafted archive is reported instead of half-loaded.
    """
    try:
        found = _tar_members(tar_path)
    except _DAMAGED as exc:
        raise DataError(f"{tar_path}: corrupt or truncated archive ({type(exc).__name__}: {exc})") from None
    if not found:
        raise DataError(f"{tar_path}: holds no train/<class>/ or test/<class>/ images")
    # Several trees in one archive: take the shallowest (the usual single top folder).
    return found[min(found, key=lambda k: (k.count("/") + bool(k), k))]


def _tar_members(tar_path: Path) -> dict[str, list[tuple[str, str, str, bytes]]]:
    """The archive's images grouped by the folder that holds train/ and test/."""
    found: dict[str, list[tuple[str, str, str, bytes]]] = {}
    with tarfile.open(tar_path, "r:*") as tf:
        for m in tf:
            name = m.name.replace("\\", "/")
            parts = name.split("/")
            if name.startswith("/") or os.path.isabs(name) or ".." in parts or ":" in parts[0]:
                raise DataError(f"{tar_path}: unsafe member path {m.name!r}")
            if m.isdir():
                continue
            if not m.isfile():
                raise DataError(
                    f"{tar_path}: refusing non-regular member {m.name!r} (links and devices are not allowed)"
                )
            hit = _split_member(name)
            if hit is not None:
                prefix, split, cls, fname = hit
                member = tf.extractfile(m)
                assert member is not None  # a regular file (checked above) always has a reader
                found.setdefault(prefix, []).append((split, cls, fname, member.read()))
    return found


def _read_tree(tree: Path) -> list[tuple[str, str, str, bytes]]:
    items = []
    for split in ("train", "test"):
        for cdir in sorted(p for p in (tree / split).iterdir() if p.is_dir()):
            for f in sorted(cdir.iterdir()):
                if f.is_file() and f.name.lower().endswith(_IMG_EXT):
                    items.append((split, cdir.name, f.name, f.read_bytes()))
    return items


def _read_source(source: Path) -> list[tuple[str, str, str, bytes]]:
    return _read_tarball(source) if source.is_file() else _read_tree(source)


def read_image_folder(root: str | os.PathLike) -> list[tuple[str, str, str, bytes]]:
    """Every image under an image-folder root, found as a scenario's ``data.root`` is (the
    tree or tarball itself, or the only one in it or a folder below), as (split, class,
    file name, bytes); a tarball's unsafe members are refused as on loading."""
    return _read_source(_find_image_folder("imagefolder", Path(root), download=False))


_TAR_EXT = (".tar.gz", ".tgz", ".tar")


def _is_image_tree(d: Path) -> bool:
    """train/ and test/, each with class folders that hold images (FEMNIST's train/ and
    test/ of JSON files do not count)."""
    return all(_holds_class_images(d / s) for s in ("train", "test"))


def _holds_class_images(split: Path) -> bool:
    return split.is_dir() and any(
        c.is_dir() and any(f.name.lower().endswith(_IMG_EXT) for f in c.iterdir()) for c in split.iterdir()
    )


def _image_sources(d: Path) -> list[Path]:
    """What folder d offers: itself when it is an image tree, else the tarballs it holds."""
    if _is_image_tree(d):
        return [d]
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(_TAR_EXT))


def _find_image_folder(name: str, root: Path, download: bool) -> Path:
    """The tree or tarball to read: root itself when it is one, else the only one in root
    or one folder below it. None, or several, is a DataError naming what is there."""
    if root.is_file() and root.name.endswith(_TAR_EXT):
        return root
    if not root.is_dir():
        raise DataError(f"dataset '{name}': root {root} is not a folder or a .tar.gz")
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    found = _image_sources(root) or [p for s in subdirs for p in _image_sources(s)]
    if len(found) == 1:
        return found[0]
    if found:
        raise DataError(
            f"dataset '{name}': several image folders under {root}: "
            f"{', '.join(str(p) for p in found)}; set the root to one of them"
        )
    # the usual mistake: a folder of datasets, one of which has train/ and test/ of other files
    misses = [str(d) for d in [root, *subdirs] if (d / "train").is_dir() and (d / "test").is_dir()]
    seen = (
        f"; train/ and test/ without class folders of images in {', '.join(misses)}"
        if misses
        else f"; it holds {', '.join(p.name for p in sorted(root.iterdir())[:10]) or 'nothing'}"
    )
    raise DataError(
        f"dataset '{name}': no image folder under {root} (looked in it and its sub-folders for "
        f"train/<class>/ and test/<class>/ holding images, or a .tar.gz of such a tree){seen}"
        + (" (no download is available for it)" if download else "")
    )


def _decode_images(items: list[tuple[str, bytes]]) -> np.ndarray:
    """Decode (file name, encoded bytes) pairs to uint8 [N, 3, H, W] (one size for all).

    JPEGs go through torchvision's batched libjpeg-turbo decoder (about 2x faster than a
    PIL loop, bit-identical output on CIFAR-10); anything else, or a JPEG it rejects,
    goes through PIL.
    """
    import torch
    from PIL import Image

    out: list[np.ndarray | None] = [None] * len(items)
    jpg = [i for i, (n, _) in enumerate(items) if n.lower().endswith((".jpg", ".jpeg"))]
    try:
        with warnings.catch_warnings():
            # torchvision 0.29 flags its decoders as deprecated; PIL below is the fallback
            # for the day they are gone.
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_jpeg

            for s in range(0, len(jpg), 4096):
                chunk = jpg[s : s + 4096]
                dec = decode_jpeg(
                    [torch.frombuffer(bytearray(items[i][1]), dtype=torch.uint8) for i in chunk],
                    mode=ImageReadMode.RGB,
                )
                for i, t in zip(chunk, dec, strict=True):
                    out[i] = t.numpy()
    except Exception:  # old torchvision without batched decode, odd JPEGs: PIL below
        pass
    images: list[np.ndarray] = []
    for (file, data), a in zip(items, out, strict=True):
        if a is None:
            try:
                with Image.open(io.BytesIO(data)) as im:
                    a = np.asarray(im.convert("RGB")).transpose(2, 0, 1)
            except (OSError, ValueError, Image.DecompressionBombError) as exc:  # PIL's errors for a bad file
                raise DataError(f"{file}: not an image PIL can read ({type(exc).__name__}); remove it") from None
        images.append(a)
    if not images:
        return np.zeros((0, 3, 0, 0), np.uint8)
    shapes = sorted({a.shape for a in images})
    if len(shapes) > 1:
        raise DataError(f"images differ in size ({shapes[:4]}); resize them first")
    return np.ascontiguousarray(np.stack(images))


def _load_imagefolder(name: str, root: Path | None, train: bool, download: bool) -> Dataset:
    root = _need_root(name, root)
    source = _find_image_folder(name, root, download)
    is_tarball = source.is_file()  # else an image tree
    if is_tarball:
        st = source.stat()
        key = _key("tar", str(source.resolve()), st.st_size, st.st_mtime_ns)
    else:
        # A plain tree: key by every file's name, size and mtime (a cheap walk).
        stats = []
        for dirpath, _, fnames in os.walk(source):
            for fn in fnames:
                s = os.stat(os.path.join(dirpath, fn))
                stats.append((os.path.relpath(os.path.join(dirpath, fn), source), s.st_size, s.st_mtime_ns))
        key = _key("tree", str(source.resolve()), sorted(stats))
    npz = cache_dir() / "imagefolder" / f"{key}.npz"
    part = "train" if train else "test"
    arrays = read_cache(npz, partial(_read_npz, keys=["classes", f"x_{part}", f"y_{part}"]))
    if arrays is None:
        arrays = _decode_image_folder(name, source)
        write_cache(npz, npz_writer(arrays))
    classes = [str(c) for c in arrays["classes"]]
    return Dataset(x=arrays[f"x_{part}"], y=arrays[f"y_{part}"], num_classes=len(classes), name=name, classes=classes)


def _decode_image_folder(name: str, source: Path) -> dict[str, np.ndarray]:
    """Both splits of an image tree or tarball, decoded: the arrays its cache file holds."""
    items = _read_source(source)
    # ImageFolder's order: classes by sorted name (from train), files sorted inside.
    items.sort(key=lambda t: (t[0], t[1], t[2]))
    classes = sorted({c for sp, c, _, _ in items if sp == "train"})
    extra = sorted({c for sp, c, _, _ in items if sp == "test"} - set(classes))
    if extra:
        raise DataError(f"dataset '{name}': test classes {extra} are not in the train split")
    cidx = {c: i for i, c in enumerate(classes)}
    arrays = {"classes": np.array(classes, dtype=str)}
    for part in ("train", "test"):
        sel = [t for t in items if t[0] == part]
        arrays[f"x_{part}"] = _decode_images([(f"{source}/{sp}/{c}/{f}", b) for sp, c, f, b in sel])
        arrays[f"y_{part}"] = np.array([cidx[c] for _, c, _, _ in sel], dtype=np.int64)
    return arrays


def _read_npz(path: Path, keys: list[str]) -> dict[str, np.ndarray]:
    """The named arrays of a cache .npz, read into memory; a missing one is a KeyError."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in keys}


# ----------------------------------------------------------------------------- FEMNIST


def _load_femnist(root: Path | None, train: bool, download: bool) -> Dataset:
    name = "femnist"
    root = _need_root(name, root)
    tr_files = sorted((root / "train").glob("*.json")) if (root / "train").is_dir() else []
    te_files = sorted((root / "test").glob("*.json")) if (root / "test").is_dir() else []
    if not tr_files or not te_files:
        hint = " (no download is available for it: run LEAF's preprocessing)" if download else ""
        raise DataError(
            f"dataset '{name}': no LEAF JSON in {root} (looked for {root / 'train'}/*.json "
            f"and {root / 'test'}/*.json){hint}"
        )
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in tr_files + te_files]
    npz = cache_dir() / "femnist" / f"{_key('femnist-v2', stats)}.npz"
    part = "train" if train else "test"
    arrays = read_cache(npz, partial(_read_npz, keys=["group_names", f"x_{part}", f"y_{part}", f"g_{part}"]))
    if arrays is None:
        arrays = _parse_femnist(root, tr_files, te_files)
        write_cache(npz, npz_writer(arrays))
    return Dataset(
        x=arrays[f"x_{part}"],
        y=arrays[f"y_{part}"],
        num_classes=62,
        name=name,
        groups=arrays[f"g_{part}"],
        group_names=[str(u) for u in arrays["group_names"]],
    )


def _parse_femnist(root: Path, tr_files: list[Path], te_files: list[Path]) -> dict[str, np.ndarray]:
    """Both splits of LEAF's JSON, with one writer index: the arrays its cache file holds.
    Parsing ~80 MB of JSON takes seconds, so it is done once for both splits."""
    parsed = {}
    for part, files in (("train", tr_files), ("test", te_files)):
        xs, ys, users = [], [], []
        for p in files:
            d = _leaf_json(p)
            for u in d["users"]:
                x, y = _leaf_user(p, u, d["user_data"][u])
                if len(y) == 0:
                    continue
                xs.append(x)
                ys.append(y)
                users.append((u, len(y)))
        parsed[part] = (xs, ys, users)
    all_users = sorted({u for part in parsed.values() for u, _ in part[2]})
    lookup = {u: i for i, u in enumerate(all_users)}
    arrays = {"group_names": np.array(all_users, dtype=str)}
    for part, (xs, ys, users) in parsed.items():
        if not xs:
            raise DataError(f"dataset 'femnist' at {root}: its {part}/ LEAF files hold no samples")
        x = np.concatenate(xs)
        # LEAF stores ink dark on a white (1.0) page; invert to MNIST/EMNIST's bright ink,
        # so encoders and models see one convention across handwriting datasets
        arrays[f"x_{part}"] = np.clip(np.rint((1.0 - x) * 255.0), 0, 255).astype(np.uint8)[:, None]
        arrays[f"y_{part}"] = np.concatenate(ys)
        arrays[f"g_{part}"] = np.repeat(np.array([lookup[u] for u, _ in users], dtype=np.int64), [n for _, n in users])
    return arrays


def _leaf_user(path: Path, user: str, data: dict) -> tuple[np.ndarray, np.ndarray]:
    """One writer's images [n, 28, 28] (floats in [0, 1], LEAF's) and labels; a record of
    another shape is a DataError naming the file and the writer."""
    try:
        x = np.asarray(data["x"], dtype=np.float32).reshape(-1, 28, 28)
        y = np.asarray(data["y"], dtype=np.int64).reshape(-1)
        if len(x) != len(y) or not np.isfinite(x).all() or (len(y) and y.min() < 0):
            raise ValueError(f"{len(x)} images, {len(y)} labels")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: writer {short(user)}: expected 'x' of 784-pixel images and 'y' of as many "
            f"class labels >= 0 ({type(exc).__name__}: {short(str(exc))})"
        ) from None
    return x, y


def _leaf_json(path: Path) -> dict:
    """One LEAF file; a damaged or foreign one is a DataError naming it."""
    try:
        d = json.loads(_read_bytes(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not LEAF JSON ({type(exc).__name__}: {short(str(exc))})") from None
    users = d.get("users") if isinstance(d, dict) else None
    if (
        not isinstance(users, list)
        or not isinstance(d.get("user_data"), dict)
        or any(u not in d["user_data"] for u in users)
    ):
        raise DataError(f"{path}: not LEAF JSON (expected 'users' and 'user_data' for each of them)")
    return d


# ----------------------------------------------------------------------------- entry point


def dataset_key(name: str) -> tuple[str, str] | None:
    """(loader, EMNIST split or '') for a dataset name, or None when no loader knows it.
    ``-`` and ``_`` are interchangeable, case does not matter."""
    base, _, split = name.strip().lower().replace("-", "_").partition(":")
    if base not in DATASETS or (split and (base != "emnist" or split not in EMNIST_SPLITS)):
        return None
    return base, split


def load_dataset(name: str, root: str | os.PathLike | None, train: bool, download: bool = False) -> Dataset:
    """Load one split of a dataset as uint8 ``[N, C, H, W]`` images and int64 labels.

    ``name`` is one of ``DATASETS`` (``-`` and ``_`` are interchangeable; EMNIST takes
    ``emnist:<split>``). ``root`` is the data folder (ignored for ``digits``). With
    ``download=True`` torchvision fetches MNIST, Fashion-MNIST, EMNIST and CIFAR into
    ``root`` when they are not found; otherwise a missing file raises :class:`DataError`.
    """
    base, _, split = name.strip().lower().replace("-", "_").partition(":")
    r = Path(root).expanduser() if root is not None else None
    ds = _load_split(base, split, r, train, download)
    if ds is None:
        raise DataError(f"dataset '{name}': unknown (supported: {', '.join(DATASETS)})")
    if len(ds) == 0 or ds.num_classes == 0:  # a partition of nothing would fail far from the cause
        raise DataError(
            f"dataset '{name}' (root {r}): the {'train' if train else 'test'} split holds "
            f"{len(ds)} images of {ds.num_classes} classes"
        )
    if len(ds.y) != len(ds.x):
        raise DataError(f"dataset '{name}' (root {r}): {len(ds.x)} images but {len(ds.y)} labels")
    low, high = int(ds.y.min()), int(ds.y.max())
    if low < 0 or high >= ds.num_classes:  # would index past the model's outputs mid-run
        raise DataError(
            f"dataset '{name}' (root {r}): the {'train' if train else 'test'} split's labels run "
            f"from {low} to {high}, outside its {ds.num_classes} classes 0..{ds.num_classes - 1}"
        )
    return ds


def load_shared(name: str, root: str | os.PathLike | None, train: bool, download: bool = False) -> Dataset:
    """:func:`load_dataset`, with ``x`` and ``y`` memory-mapped read-only from an
    uncompressed ``.npy`` pair in ``cache_dir()/shared``.

    The files are named by a hash of the split's content, written once (atomically) by
    whichever process comes first and mapped by every process that loads the same split,
    so n processes on a host share one copy of its pages (PSS counts it once). The split
    is still decoded here to learn its name, then freed. Where the cache cannot be
    written, the in-memory split is returned, with a warning.
    """
    ds = load_dataset(name, root, train, download)
    digest = hashlib.sha256(repr((_CACHE_VERSION, ds.x.shape, ds.x.dtype.str, ds.y.dtype.str)).encode())
    for arr in (ds.x, ds.y):
        digest.update(np.ascontiguousarray(arr).data)
    stem = f"{ds.name.replace(':', '-')}-{'train' if train else 'test'}-{digest.hexdigest()[:20]}"
    folder = cache_dir() / "shared"
    try:
        x, y = (_mapped(folder / f"{stem}.{part}.npy", arr) for part, arr in (("x", ds.x), ("y", ds.y)))
    except OSError as exc:
        log.warning("dataset '%s': no shared cache in %s (%s); this process keeps its own copy", name, folder, exc)
        return ds
    return replace(ds, x=x, y=y)


def _mapped(path: Path, arr: np.ndarray) -> np.ndarray:
    """`arr` as a read-only memory map of `path`, written there first unless a whole copy is."""
    try:
        done = np.load(path, mmap_mode="r")
        if done.shape == arr.shape and done.dtype == arr.dtype:
            return done
    except (OSError, ValueError, EOFError):  # missing, cut short or emptied: (re)write it
        pass
    # a damaged file is replaced; a missing one may be written by a device beside this one
    # meanwhile, and then that one is mapped by both
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: np.save(f, np.ascontiguousarray(arr)), first_wins=not path.exists())
    return np.load(path, mmap_mode="r")


def _load_split(base: str, split: str, r: Path | None, train: bool, download: bool) -> Dataset | None:
    if base == "digits":
        return _load_digits(train)
    if base in _MNIST_LIKE:
        return _load_mnist_like(base, r, train, download)
    if base == "emnist":
        return _load_emnist(split or "balanced", r, train, download)
    if base in _CIFAR:
        return _load_cifar(base, r, train, download)
    if base in ("cifar10_jpg", "imagefolder"):
        return _load_imagefolder(base, r, train, download)
    if base == "femnist":
        return _load_femnist(r, train, download)
    return None
