"""Device-reported figures checked against what the server knows (server/replies.py)."""

import numpy as np
import pytest

from flt.common.wire import Message
from flt.server.replies import centroids_check, metrics_check, update_check

SIZES = {3: (50, 20)}.__getitem__  # client 3: 50 training, 20 test samples
P = 6


def _train(resident=False, candidates=1):
    tensors = {} if resident else {"model": np.zeros((candidates, P), np.float32)}
    return {3: Message("train", 1, 3, tensors=tensors, meta={"batch_size": 10, "epochs": 2})}


STAYS = {3}  # Local: client 3's model stays on its device


ONES = np.ones(P, np.float32)


def _update(model=ONES, **meta):
    tensors = {} if model is None else {"model": model}
    return Message(
        "update", 1, 3, tensors=tensors, meta={"n": 50, "steps": 10, "choice": 0, "flag": 0, "loss": 0.5, **meta}
    )


def test_an_honest_update_passes():
    assert update_check(_train(), SIZES)(3, _update()) is None
    assert update_check(_train(), SIZES)(3, _update(model=np.full(P, -1e18, np.float32))) is None  # the bound
    assert update_check(_train(resident=True), SIZES, STAYS)(3, _update(model=None)) is None
    assert update_check(_train(candidates=3), SIZES)(3, _update(choice=2)) is None


@pytest.mark.parametrize(
    "reply, reason",
    [
        (_update(n=1_000_000_000), "wrong sample count"),  # would outweigh every honest client
        (_update(n=49), "wrong sample count"),
        (_update(n="50"), "wrong sample count"),
        (_update(n=True), "wrong sample count"),
        (_update(steps=1), "wrong step count"),  # would fake a fast device's clock
        (_update(choice=1), "bad meta"),  # one candidate was offered
        (_update(choice=[0]), "bad meta"),
        (_update(flag="yes"), "bad meta"),
        (_update(loss="low"), "bad meta"),
        (_update(model=np.ones(P + 1, np.float32)), "bad model"),
        (_update(model=np.ones(P, np.float64)), "bad model"),
        (_update(model=None), "bad model"),
        (_update(model=np.array([1, np.nan, 0, 0, 0, 0], np.float32)), "non-finite update"),
        (_update(model=np.array([np.inf] * P, np.float32)), "non-finite update"),
        (_update(model=np.full(P, 1e37, np.float32)), "non-finite update"),  # overflows n x w
        (_update(model=np.array([0, 0, -2e18, 0, 0, 0], np.float32)), "non-finite update"),
    ],
)
def test_a_dishonest_update_is_rejected_with_its_reason(reply, reason):
    got = update_check(_train(), SIZES)(3, reply)
    assert got is not None and got[0] == reason, got


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_diverged_update_is_named_so_with_the_setting_to_change(loss):
    """Too large a train.lr makes an honest client's loss NaN: its update is left out,
    and the log says why in the user's terms rather than as a malformed message."""
    reason, detail = update_check(_train(), SIZES)(3, _update(loss=loss))
    assert reason == "non-finite update" and "diverged" in detail and "train.lr" in detail


def test_a_resident_model_must_not_travel_back():
    assert update_check(_train(resident=True), SIZES, STAYS)(3, _update())[0] == "bad model"


@pytest.mark.parametrize(
    "correct, total, ok",
    [
        (17.0, 20.0, True),
        (0, 20, True),
        (20, 20, True),
        (20, 21, False),  # more test samples than the shard holds
        (1e9, 1e9, False),  # fake totals
        (21, 20, False),
        (-1, 20, False),
        (10.5, 20, False),
        (float("nan"), 20, False),
        ("17", 20, False),
        (None, 20, False),
    ],
)
def test_evaluation_totals_must_match_the_test_shard(correct, total, ok):
    reply = Message("metrics", 1, 3, meta={"correct": correct, "total": total, "loss": 0.1})
    got = metrics_check(SIZES)(3, reply)
    assert (got is None) == ok, got
    if not ok:
        assert got[0] == "wrong evaluation totals"


@pytest.mark.parametrize(
    "centroids, n, reason",
    [
        (np.ones((5, 128), np.float32), 50, None),
        (np.ones((5, 128), np.float32), 51, "wrong sample count"),
        (np.ones((11, 128), np.float32), 50, "bad centroids"),
        (np.ones(128, np.float32), 50, "bad centroids"),
        (np.ones((5, 128), np.int64), 50, "bad centroids"),
        (np.full((5, 128), np.nan, np.float32), 50, "non-finite centroids"),
        (np.full((5, 128), 1e300), 50, "bad centroids"),  # float64: its squares overflowed the set distance
        (np.full((5, 128), -1e37, np.float32), 50, "non-finite centroids"),  # dwarfed every honest client
        (np.full((5, 128), -1e15, np.float32), 50, None),  # the bound
    ],
)
def test_centroids_are_checked(centroids, n, reason):
    shares = np.full(len(centroids), 1 / len(centroids), np.float32)
    got = centroids_check(SIZES, max_k=10)(
        3, Message("centroids", 1, 3, tensors={"centroids": centroids, "shares": shares}, meta={"n": n})
    )
    assert (got and got[0]) == reason


@pytest.mark.parametrize(
    "shares, problem",
    [
        (None, "bad centroids"),  # not there: the reply is not the two arrays it must be
        (np.full(4, 0.25, np.float32), "bad shares"),  # one fewer than the centroids
        (np.full(5, 0.3, np.float32), "bad shares"),  # sum 1.5
        (np.array([1.2, -0.2, 0, 0, 0], np.float32), "bad shares"),
        (np.array([np.nan, 1, 0, 0, 0], np.float32), "bad shares"),
        (np.array([0.5, 0.5, 0, 0, 0], np.float32), None),
    ],
)
def test_centroid_shares_are_checked(shares, problem):
    tensors = {"centroids": np.ones((5, 8), np.float32)} | ({} if shares is None else {"shares": shares})
    got = centroids_check(SIZES, max_k=10)(3, Message("centroids", 1, 3, tensors=tensors, meta={"n": 50}))
    assert (got and got[0]) == problem


def halves_reply(halves, half_shares, half_k, extra=None):
    tensors = {"centroids": np.ones((5, 8), np.float32), "shares": np.full(5, 0.2, np.float32)}
    tensors |= {"halves": halves, "half_shares": half_shares} | (extra or {})
    return Message("centroids", 1, 3, tensors=tensors, meta={"n": 50, "half_k": half_k})


@pytest.mark.parametrize(
    "halves, half_shares, half_k, problem",
    [
        (np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), 4, None),
        (np.ones((7, 8), np.float32), np.array([0.5, 0.5, 0.25, 0.25, 0.25, 0.25, 0.0], np.float32), 2, None),
        (np.ones((8, 9), np.float32), np.full(8, 0.25, np.float32), 4, "bad halves"),  # other columns
        (np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), 8, "bad halves"),  # no second half
        (np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), "4", "bad halves"),
        (np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), 3, "bad shares"),  # halves sum 0.75 / 1.25
        (np.ones((8, 8), np.float32), np.full(7, 0.25, np.float32), 4, "bad halves"),
        (np.full((8, 8), np.inf, np.float32), np.full(8, 0.25, np.float32), 4, "non-finite halves"),
        (np.ones((30, 8), np.float32), np.full(30, 1 / 15, np.float32), 15, "bad halves"),  # k above max_k
    ],
)
def test_half_summaries_are_checked(halves, half_shares, half_k, problem):
    got = centroids_check(SIZES, max_k=10)(3, halves_reply(halves, half_shares, half_k))
    assert (got and got[0]) == problem


def test_a_reply_with_halves_missing_a_part_is_refused():
    reply = halves_reply(np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), 4)
    del reply.tensors["half_shares"]
    assert centroids_check(SIZES, max_k=10)(3, reply)[0] == "bad centroids"
    extra = halves_reply(np.ones((8, 8), np.float32), np.full(8, 0.25, np.float32), 4, {"x": np.ones(2)})
    assert centroids_check(SIZES, max_k=10)(3, extra)[0] == "bad centroids"


@pytest.mark.parametrize(
    "columns, labelled, problem",
    [
        (8, False, None),
        (7, False, "bad centroids"),
        (9, False, "bad centroids"),
        (9, True, None),
        (8, True, "bad centroids"),
    ],
)
def test_centroids_must_be_as_wide_as_the_encoders_embedding(columns, labelled, problem):
    """Rows of another width than the encoder's (8 here; a class column more with k:
    labels) passed, and ended the run where the server pooled every client's rows."""
    rows = np.ones((2, columns), np.float32)
    if labelled:
        rows[:, -1] = [0, 1]
    tensors = {"centroids": rows, "shares": np.full(2, 0.5, np.float32)}
    check = centroids_check(SIZES, max_k=10, labelled=labelled, width=8)
    got = check(3, Message("centroids", 1, 3, tensors=tensors, meta={"n": 50}))
    assert (got and got[0]) == problem
