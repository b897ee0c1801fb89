"""What a device reports, checked against what the server already knows.

The server built the partition, so it knows every client's shard sizes, and it sent
the task, so it knows the model's size, the candidates, the epochs and the batch size.
A reply that disagrees (a sample count that would weigh a client a million times in
FedAvg, evaluation totals that would fake an accuracy, a non-finite model that would
poison an average) is rejected by the transport like a malformed message: counted by
reason, its bytes kept apart, its client named in the log and left out of the round.

Each `*_check` returns a function `(client, reply) -> (reason, detail) | None` for
`Transport.gather`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TypeGuard

import numpy as np

from flt.common.errors import short
from flt.common.wire import Message

# (train samples, test samples) of a client, as the partition says now (drift moves shards)
ShardSizes = Callable[[int], tuple[int, int]]
Check = Callable[[int, Message], "tuple[str, str] | None"]


def update_check(sent: dict[int, Message], sizes: ShardSizes | None, stays: Collection[int] = ()) -> Check:
    """An `update` (or a training op's `result`) must carry exactly the client's
    training-sample count, the steps that count implies, a candidate index it was offered,
    and (unless the model stays on the device: clients in `stays`) one finite model of
    the size that was sent."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        task, meta = sent[client], reply.meta
        n, expected_n = meta.get("n"), sizes(client)[0] if sizes else None
        if not _is_int(n) or n < 1 or (expected_n is not None and n != expected_n):
            return "wrong sample count", f"n = {short(n, 24)}, its shard holds {expected_n}"
        steps = -(-n // task.meta["batch_size"]) * task.meta["epochs"]
        if meta.get("steps") != steps:
            return "wrong step count", f"steps = {short(meta.get('steps'), 24)}, {n} samples make {steps}"
        offered = task.tensors["model"].shape[0] if "model" in task.tensors else 1
        if not _is_int(meta.get("choice", 0)) or not 0 <= meta.get("choice", 0) < offered:
            return "bad meta", f"choice = {short(meta.get('choice'), 24)} of {offered} candidates"
        loss = meta.get("loss", 0.0)
        if isinstance(loss, float) and not math.isfinite(loss):  # an honest client's SGD can blow up
            return "non-finite update", f"loss {loss}: local training diverged (a smaller train.lr may help)"
        if meta.get("flag", 0) not in (0, 1) or not _is_number(loss):
            return "bad meta", f"flag {short(meta.get('flag'), 24)}, loss {short(meta.get('loss'), 24)}"
        return _model_problem(task, reply, client in stays)

    return check


def _model_problem(task: Message, reply: Message, stays: bool) -> tuple[str, str] | None:
    if stays:  # the model stays on the device (Local): none travels back
        return ("bad model", f"tensors {sorted(reply.tensors)} for a device-resident model") if reply.tensors else None
    model, size = reply.tensors.get("model"), task.tensors["model"].shape[-1]
    if model is None or model.dtype != np.float32 or model.shape != (size,) or len(reply.tensors) != 1:
        return "bad model", f"expected one float32 model of {size} parameters"
    return _too_large(model, MAX_WEIGHT, "update", "it would overflow the average")


# Largest |weight| a model may carry. Finite float32 weights of 1e37 pass a NaN check yet
# overflow the weighted average (n x w past 3.4e38) and leave every client an infinite
# model from then on; below 1e18, sums over any real population's samples stay finite.
# No trained network comes near it (MNIST's MLP: |w| < 10).
MAX_WEIGHT = 1e18


def _too_large(a: np.ndarray, bound: float, what: str, why: str) -> tuple[str, str] | None:
    """Why `a` must not be used: NaN, infinity, or a value past `bound` in size (one pass
    when it is clean: NaN fails the comparison too)."""
    largest = float(np.abs(a).max()) if a.size else 0.0
    if largest <= bound:
        return None
    if not np.isfinite(a).all():
        return f"non-finite {what}", f"{int((~np.isfinite(a)).sum())} of {a.size} values are NaN or inf"
    return f"non-finite {what}", f"a value of {largest:.3g}, past {bound:g}: {why}"


def metrics_check(sizes: ShardSizes | None) -> Check:
    """`metrics` must count exactly the client's test shard, and a whole number of correct
    answers between 0 and that."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        correct, total = reply.meta.get("correct"), reply.meta.get("total")
        expected = sizes(client)[1] if sizes else total
        if not (
            _is_number(correct)
            and _is_number(total)
            and total == expected
            and 0 <= correct <= total
            and float(correct).is_integer()
        ):
            return "wrong evaluation totals", (
                f"correct {short(correct, 24)} of total {short(total, 24)}, its test shard holds {expected}"
            )
        if not _is_number(reply.meta.get("loss", 0.0)) or reply.tensors:
            return "bad meta", f"loss {short(reply.meta.get('loss'), 24)}, tensors {sorted(reply.tensors)}"
        return None

    return check


def choose_check(sent: dict[int, Message], sizes: ShardSizes | None) -> Check:
    """`choose`'s result: the client's training-sample count, one float loss per candidate
    it was sent (K), and a choice among them."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        n, expected_n = reply.meta.get("n"), sizes(client)[0] if sizes else None
        if not _is_int(n) or n < 1 or (expected_n is not None and n != expected_n):
            return "wrong sample count", f"n = {short(n, 24)}, its shard holds {expected_n}"
        offered = sent[client].tensors["model"].shape[0]
        losses = reply.tensors.get("losses")
        if losses is None or losses.shape != (offered,) or losses.dtype.kind != "f" or len(reply.tensors) != 1:
            return "bad losses", f"expected one float loss for each of {offered} candidates"
        if not _is_int(reply.meta.get("choice")) or not 0 <= reply.meta["choice"] < offered:
            return "bad meta", f"choice = {short(reply.meta.get('choice'), 24)} of {offered} candidates"
        return None

    return check


def subspace_check(sent: dict[int, Message], sizes: ShardSizes | None) -> Check:
    """`subspace`'s result (PACFL): the client's training-sample count and one float basis
    [rows, d] of at most `basis` unit vectors per class, d the sent image size."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        n, expected_n = reply.meta.get("n"), sizes(client)[0] if sizes else None
        if not _is_int(n) or n < 1 or (expected_n is not None and n != expected_n):
            return "wrong sample count", f"n = {short(n, 24)}, its shard holds {expected_n}"
        meta = sent[client].meta
        basis, most = reply.tensors.get("basis"), meta["basis"] * MAX_CLASSES
        dim = meta.get("dim")  # the image size, when the server knows it
        if basis is None or basis.ndim != 2 or dim not in (None, basis.shape[1]) or len(reply.tensors) != 1:
            return "bad basis", f"expected one float array [rows, {dim or 'd'}]"
        if basis.dtype.kind != "f" or not 1 <= len(basis) <= most or not np.isfinite(basis).all():
            return "bad basis", f"expected 1..{most} finite rows"
        if not np.allclose(np.linalg.norm(basis, axis=1), 1.0, atol=1e-3):
            return "bad basis", "rows are not unit vectors"
        return None

    return check


MAX_CLASSES = 64  # label-conditioned centroids: at most one row per class (FEMNIST has 62)


def centroids_check(
    sizes: ShardSizes | None, max_k: int = 64, labelled: bool = False, width: int | None = None
) -> Check:
    """`centroids`: the client's whole training shard embedded, into 1..max_k finite rows
    of the encoder's `width` (when known: rows of another width would meet the other
    clients' in one array on the server), and `shares`: each row's share of the shard, k
    fractions that sum to 1; `labelled`: each row ends with its class, distinct whole
    numbers in [0, max_k)."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        n, expected_n = reply.meta.get("n"), sizes(client)[0] if sizes else None
        if not _is_int(n) or (expected_n is not None and n != expected_n):
            return "wrong sample count", f"n = {short(n, 24)}, its shard holds {expected_n}"
        halves = "halves" in reply.tensors
        if set(reply.tensors) != ({"centroids", "shares"} | ({"halves", "half_shares"} if halves else set())):
            return "bad centroids", "expected centroids and shares, and optionally halves and half_shares"
        c = reply.tensors["centroids"]
        if width is not None and (c.ndim != 2 or c.shape[1] != width + labelled):
            return "bad centroids", f"expected rows of {width + labelled} values, the encoder's embedding"
        bad = _summary_fault(c, reply.tensors["shares"], max_k, labelled, "centroid")
        if bad or not halves:
            return bad
        h, k = reply.tensors["halves"], reply.meta.get("half_k")
        if h.ndim != 2 or h.shape[1:] != c.shape[1:] or not _is_int(k) or not 1 <= k < len(h):
            return "bad halves", f"expected two summaries of {c.shape[1:]} rows stacked, the first half_k of them"
        w = reply.tensors["half_shares"]
        if w.shape != (len(h),):
            return "bad halves", f"expected {len(h)} half shares, one per row"
        return _summary_fault(h[:k], w[:k], max_k, labelled, "half") or _summary_fault(
            h[k:], w[k:], max_k, labelled, "half"
        )

    return check


_PLURAL = {"centroid": "centroids", "half": "halves"}
# Largest |value| of an embedding row. The encoders FCR sends give values of order 1 to
# 100 (a PCA basis: at most the square root of the image size); rows of 1e37 passed the
# NaN check, squashed every honest client's differences in the whitening, and float64
# rows of 1e300 overflowed the set distance to inf and ended the run in the linkage.
# Below 1e15, squared distances over up to 1e5 dimensions stay finite even in float32.
MAX_EMBEDDING = 1e15


def _summary_fault(c: np.ndarray, w: np.ndarray, max_k: int, labelled: bool, what: str) -> tuple[str, str] | None:
    """One summary of a client's data: 1..max_k finite float rows (with `labelled`, a last
    column of distinct classes in [0, max_k)) and a share per row, >= 0, summing to 1."""
    if c.ndim != 2 or not 1 <= c.shape[0] <= max_k or c.dtype != np.float32:
        return f"bad {_PLURAL[what]}", f"expected one float32 k x e array, k in 1..{max_k}, and its shares"
    if too_large := _too_large(c, MAX_EMBEDDING, _PLURAL[what], "no encoder gives one"):
        return too_large
    if w.shape != (c.shape[0],) or w.dtype.kind != "f" or not np.isfinite(w).all():
        return "bad shares", f"expected {c.shape[0]} finite float shares, one per {what}"
    if w.min() < 0 or abs(float(w.sum()) - 1) > 1e-3:
        return "bad shares", f"shares must be >= 0 and sum to 1 (sum {float(w.sum()):.4g})"
    if labelled:
        cls = c[:, -1]
        if c.shape[1] < 2 or (cls != np.round(cls)).any() or cls.min() < 0 or cls.max() >= max_k:
            return f"bad {what} classes", f"expected a last column of classes in [0, {max_k})"
        if len(np.unique(cls)) != len(cls):
            return f"bad {what} classes", "a class appears twice"
    return None


# Rows of a change test's reference: devices/watch.py SAMPLE, the images a test embeds
# (the server half imports nothing of the devices'; tests/test_ops.py keeps them equal).
REFERENCE_ROWS = 256


def state_check(model_size: int | None) -> Check:
    """`state` (a checkpoint's snapshot of what a device keeps for a client): a 0/1 change
    flag; if the device keeps a model for the client (Local), one finite float32 model of
    the run's size; if it tests the client's data changes (FLT), the embedded sample it
    tests them against, at most REFERENCE_ROWS finite float32 rows. A wrong one would be
    written into the checkpoint and handed back to the device on resume."""

    def check(client: int, reply: Message) -> tuple[str, str] | None:
        for key in ("flag", "watched"):
            if reply.meta.get(key, 0) not in (0, 1):
                return "bad meta", f"{key} {short(reply.meta.get(key), 24)}"
        if set(reply.tensors) - {"model", "reference"}:
            return "bad state", f"tensors {sorted(reply.tensors)[:4]}: only 'model' and 'reference'"
        reference = reply.tensors.get("reference")
        if reference is not None:
            rows = reference.shape[0] if reference.ndim == 2 else 0
            if reference.dtype != np.float32 or not 1 <= rows <= REFERENCE_ROWS:
                return "bad state", f"reference {reference.dtype} {reference.shape}: float32 [1..{REFERENCE_ROWS}, e]"
            if wrong := _too_large(reference, MAX_EMBEDDING, "state reference", "no encoder gives one"):
                return wrong
        model = reply.tensors.get("model")
        if model is None:
            return None
        size = model_size if model_size is not None else model.size
        if model.dtype != np.float32 or model.shape != (size,):
            return "bad state", f"expected no model or one float32 model of {size} parameters"
        return _too_large(model, MAX_WEIGHT, "state", "it would overflow the average")

    return check


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> TypeGuard[int | float]:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)
