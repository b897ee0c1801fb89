"""Feature and concept shift: each transform on small arrays (exact pixels and labels),
determinism, the IID partition's groups, validation, and the device's shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flt.common.schema import ConfigError
from flt.devices.device import Images, _shard
from flt.emulator.config import resolve
from flt.emulator.run import build_partition, hold_out_public, load_data
from flt.scenarios.partition import partition_iid
from flt.scenarios.shift import ClientShift, ShiftPlan, client_shifts, default_levels, derangements, group_of


def ramp(n: int = 1, c: int = 1, h: int = 3, w: int = 3) -> torch.Tensor:
    return torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w) / (n * c * h * w)


def test_rotate_by_quarters_moves_pixels_exactly():
    x = ramp()  # [[0,1,2],[3,4,5],[6,7,8]] / 9
    img = (x[0, 0] * 9).round().long()
    ccw = (ClientShift("rotate", 90.0, 0).images(x.clone())[0, 0] * 9).round().long()
    assert ccw.tolist() == [[2, 5, 8], [1, 4, 7], [0, 3, 6]]  # counter-clockwise
    half = (ClientShift("rotate", 180.0, 0).images(x.clone())[0, 0] * 9).round().long()
    assert half.tolist() == img.flip(0).flip(1).tolist()
    assert torch.equal(ClientShift("rotate", 360.0, 0).images(x.clone()), x)
    assert torch.equal(ClientShift("rotate", -90.0, 0).images(x.clone()), ClientShift("rotate", 270.0, 0).images(x))


def test_rotate_by_other_angles_interpolates_and_keeps_shape():
    x = torch.zeros(2, 1, 9, 9)
    x[:, :, 4, :] = 1.0  # a horizontal bar through the centre
    y = ClientShift("rotate", 45.0, 0).images(x.clone())
    assert y.shape == x.shape and y[0, 0, 4, 4] == pytest.approx(1.0)
    # counter-clockwise, as rot90: the bar now runs from bottom left to top right
    assert y[0, 0, 2, 6] > 0.9 and y[0, 0, 6, 2] > 0.9 and y[0, 0, 4, 0] < 0.1 and y[0, 0, 2, 2] < 0.1
    # the interpolating path turns the same way as the exact one, rectangles included
    for shape, quarter in (((2, 3, 9, 9), 1), ((1, 1, 6, 10), 2)):
        x = torch.rand(shape)
        near = ClientShift("rotate", 90.0 * quarter - 1e-4, 0).images(x.clone())
        assert torch.allclose(near, torch.rot90(x, quarter, dims=(-2, -1)), atol=1e-4)


def test_invert_and_level_zero_leave_what_they_should():
    x = ramp()
    assert torch.allclose(ClientShift("invert", 1.0, 0).images(x.clone()), 1 - x)
    for kind in ("invert", "noise", "blur"):
        assert torch.equal(ClientShift(kind, 0.0, 0).images(x.clone()), x)


def test_noise_is_the_clients_own_and_the_same_every_access():
    x = torch.full((4, 1, 8, 8), 0.5)
    a = ClientShift("noise", 0.2, seed=11)
    first, again = a.images(x.clone()), a.images(x.clone())
    assert torch.equal(first, again)  # the same noisy images every round
    assert not torch.equal(first, ClientShift("noise", 0.2, seed=12).images(x.clone()))  # another client
    assert not torch.equal(first, a.images(x.clone(), split=1))  # its test images: another stream
    assert first.min() >= 0 and first.max() <= 1
    assert float((first - 0.5).std()) == pytest.approx(0.2, rel=0.15)


def test_blur_spreads_a_point_into_a_normalised_symmetric_kernel():
    x = torch.zeros(1, 1, 9, 9)
    x[0, 0, 4, 4] = 1.0
    y = ClientShift("blur", 1.0, 0).images(x.clone())[0, 0]
    assert float(y.sum()) == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(y, y.flip(0)) and torch.allclose(y, y.T)
    g = torch.exp(-(torch.tensor([0.0, 1.0]) ** 2) / 2)  # Gaussian weights at 0 and 1 pixel
    assert float(y[4, 5] / y[4, 4]) == pytest.approx(float(g[1] / g[0]), rel=1e-4)


def test_label_maps_are_seeded_derangements_after_an_identity():
    perms = derangements(4, 10, seed=3)
    assert perms[0].tolist() == list(range(10))
    for p in perms[1:]:
        assert sorted(p.tolist()) == list(range(10)) and not (p == np.arange(10)).any()
    assert np.array_equal(perms, derangements(4, 10, seed=3))
    assert not np.array_equal(perms, derangements(4, 10, seed=4))
    shift = ClientShift("labels", 0.0, 0, perm=perms[1])
    y = torch.tensor([0, 3, 9, 3])
    assert shift.labels(y).tolist() == [int(perms[1][v]) for v in (0, 3, 9, 3)]


def test_plan_gives_each_group_its_level_and_moves_with_a_swap():
    plan = ShiftPlan.build({"kind": "rotate", "levels": None}, 8, 4, 10, seed=0)
    assert plan.level.tolist() == [0, 0, 90, 90, 180, 180, 270, 270]
    plan.swap(0, 7)
    assert plan.level[[0, 7]].tolist() == [270, 0]
    assert default_levels("noise", 3) == pytest.approx([0.0, 0.3, 0.6])
    assert group_of(10, 4).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]


def test_malformed_shift_from_the_wire_is_refused():
    meta = {"kind": "labels", "seed": 0}
    good = {"shift_level": np.zeros(2), "shift_perm": np.array([[1, 0], [0, 1]])}
    assert set(client_shifts(meta, good, [5, 6])) == {5, 6}
    with pytest.raises(ValueError, match="not permutations"):
        client_shifts(meta, {"shift_level": np.zeros(2), "shift_perm": np.array([[0, 0], [0, 1]])}, [5, 6])
    with pytest.raises(ValueError, match="malformed shift"):
        client_shifts({"kind": "warp", "seed": 0}, {"shift_level": np.zeros(1)}, [5])
    with pytest.raises(ValueError, match="malformed shift"):
        client_shifts({"kind": "rotate", "seed": 0}, {"shift_level": np.array([np.nan])}, [5])


def test_device_shard_transforms_its_float_copy_and_relabels_once():
    x = np.arange(2 * 1 * 2 * 2, dtype=np.uint8).reshape(2, 1, 2, 2)
    y = torch.tensor([0, 1])
    split = (Images(x, torch.device("cpu")), y)
    rot = _shard(split, split, [0, 1], [1], ClientShift("rotate", 180.0, 0))
    assert torch.equal(rot.x, torch.from_numpy(x).float().div(255).flip(-1).flip(-2))
    assert np.array_equal(x, np.arange(8, dtype=np.uint8).reshape(2, 1, 2, 2))  # the shared images are untouched
    swapped = _shard(split, split, [0, 1], [1], ClientShift("labels", 0.0, 0, perm=np.array([1, 0])))
    assert swapped.y.tolist() == [1, 0] and swapped.y_test.tolist() == [0] and swapped.shift is None
    assert y.tolist() == [0, 1]  # the device's label copy is untouched


def test_iid_partition_groups_draw_the_whole_split_without_duplicates_inside_a_group():
    y = np.repeat(np.arange(10), 30)  # 300 samples
    yt = np.repeat(np.arange(10), 10)
    kw = dict(n_clients=6, samples_per_client=100, test_per_client=10, groups=np.repeat([0, 1], 3))
    p = partition_iid(y, yt, rng=np.random.default_rng(0), **kw)
    assert p == partition_iid(y, yt, rng=np.random.default_rng(0), **kw)
    for members in ([0, 1, 2], [3, 4, 5]):
        drawn = np.concatenate([p.train[m] for m in members])
        assert len(drawn) == 300 and len(np.unique(drawn)) == 300  # each group: the whole split, once
    assert (p.cluster == -1).all() and not p.notes
    short = partition_iid(y, yt, n_clients=4, samples_per_client=100, test_per_client=5, rng=np.random.default_rng(0))
    assert [len(t) for t in short.train] == [75] * 4 and "each got 75" in short.notes[0]


def digits_cfg(shift: dict | None, kind: str = "iid", **extra) -> dict:
    part = {"kind": kind, "clients": 8, "clusters": 4, "samples_per_client": 40, "test_per_client": 10}
    return resolve({"data": {"dataset": "digits"}, "partition": {**part, "shift": shift, **extra}})


def test_shift_plants_the_groups_as_clusters_and_is_deterministic():
    cfg = digits_cfg({"kind": "rotate"})
    train, test = load_data(cfg)
    a = build_partition(cfg, train, test, hold_out_public(cfg, len(train.y)))
    b = build_partition(cfg, train, test, hold_out_public(cfg, len(train.y)))
    assert a.cluster.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and a == b
    assert a.shift.level.tolist() == b.shift.level.tolist() == [0, 0, 90, 90, 180, 180, 270, 270]
    plain = digits_cfg(None)
    assert (build_partition(plain, train, test, hold_out_public(plain, len(train.y))).cluster == -1).all()


@pytest.mark.parametrize(
    "shift, words",
    [
        ({"kind": "warp"}, ["partition.shift.kind", "warp"]),
        ({"kind": "rotate", "levels": [0, 90]}, ["partition.shift.levels", "2 levels for 4 groups"]),
        ({"kind": "invert", "levels": [0, 1, 2, 0]}, ["partition.shift.levels", "0 (as is) or 1"]),
        ({"kind": "noise", "levels": [0, 0.1, -0.1, 0.2]}, ["partition.shift.levels", ">= 0"]),
        ({"kind": "labels", "levels": [0, 1, 2, 3]}, ["partition.shift.levels", "seeded"]),
        ({"kind": "rotate", "levels": [0, "a", 1, 2]}, ["partition.shift.levels", "numbers"]),
        ({"kind": "rotate", "angle": 90}, ["partition.shift.angle", "unknown field"]),
    ],
)
def test_bad_shift_names_the_field(shift, words):
    with pytest.raises(ConfigError) as exc:
        digits_cfg(shift)
    for w in words:
        assert w in str(exc.value), str(exc.value)


# -- label-conditioned centroids: FLT's remedy for concept shift ---------------------------
def test_label_means_are_one_row_per_class_with_its_class_last():
    from flt.devices.embedding import label_means

    emb = np.array([[0.0, 2.0], [2.0, 2.0], [10.0, 0.0]], np.float32)
    rows, shares = label_means(emb, np.array([7, 7, 3]))
    assert rows.tolist() == [[10.0, 0.0, 3.0], [1.0, 2.0, 7.0]]
    np.testing.assert_allclose(shares, [1 / 3, 2 / 3])


def test_class_matched_set_distance_sees_a_label_swap_that_chamfer_cannot():
    from flt.server.fcr import set_distance

    mean = {0: np.array([0.0, 0.0]), 1: np.array([5.0, 0.0])}  # two classes' mean embeddings
    upright = np.stack([mean[0], mean[1]])
    classes = [np.array([0, 1]), np.array([0, 1]), np.array([0, 1])]
    points = [upright, upright + 0.1, upright[::-1].copy()]  # client 2's class-0 images are labelled 1
    plain = set_distance(points, "chamfer")
    matched = set_distance(points, "chamfer", classes=classes)
    assert plain[0, 2] == pytest.approx(0.0)  # same inputs: inputs alone cannot tell them apart
    assert matched[0, 2] == pytest.approx(5.0) and matched[0, 1] == pytest.approx(0.02**0.5, abs=1e-6)
    # a class the other client lacks costs more than any matched pair
    lone = set_distance([upright[:1], upright[1:]], "chamfer", classes=[np.array([0]), np.array([1])])
    assert lone[0, 1] > 5.0


def test_labelled_centroids_are_checked_before_use():
    from flt.common.wire import Message
    from flt.server.replies import centroids_check

    check = centroids_check(lambda c: (3, 1), 64, labelled=True)

    def reply(rows):
        shares = np.full(len(rows), 1 / len(rows), np.float32)
        return Message(
            "centroids", 0, 1, tensors={"centroids": np.array(rows, np.float32), "shares": shares}, meta={"n": 3}
        )

    assert check(1, reply([[0.1, 0.2, 3.0], [0.3, 0.1, 5.0]])) is None
    assert check(1, reply([[0.1, 0.2, 3.5]]))[0] == "bad centroid classes"
    assert check(1, reply([[0.1, 0.2, 64.0]]))[0] == "bad centroid classes"
    assert check(1, reply([[0.1, 0.2, 3.0], [0.3, 0.1, 3.0]]))[1] == "a class appears twice"


@pytest.mark.slow
def test_relate_over_processes_is_blind_to_label_swaps_unless_centroids_are_label_conditioned(tmp_path):
    """Real device processes embed label-swapped digits: the default relatedness (inputs
    only) sees one cluster, k: labels finds the four groups; the run folder records the shift."""
    import json

    import yaml
    from flt_command import flt

    scenario = {
        "name": "swap",
        "seed": 0,
        "data": {"dataset": "digits"},
        "partition": {
            "kind": "iid",
            "clients": 16,
            "clusters": 4,
            "samples_per_client": 60,
            "test_per_client": 20,
            "public_fraction": 0.2,
            "shift": {"kind": "labels"},
        },
        "devices": {"processes": 2},
        "methods": [
            {"name": "flt", "encoder": {"dataset": "public", "epochs": 60}},
            {"name": "flt", "label": "by_label", "encoder": {"dataset": "public", "epochs": 60}, "k": "labels"},
        ],
    }
    path = tmp_path / "swap.yaml"
    path.write_text(yaml.safe_dump(scenario))
    found = {}
    for method in ("flt", "by_label"):
        out = tmp_path / method
        done = flt("relate", str(path), "--method", method, "--no-umap", "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        with np.load(out / method / "fcr.npz") as z:
            found[method] = (len(np.unique(z["labels"])), z["labels"], z["truth"])
        shift = json.loads((out / "shift.json").read_text())
        assert shift["kind"] == "labels" and [g["clients"] for g in shift["groups"]] == [4, 4, 4, 4]
        assert (out / "shift_examples.png").stat().st_size > 1000
    assert found["flt"][0] == 1
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(found["by_label"][2], found["by_label"][1]) == pytest.approx(1.0)


@pytest.mark.slow
def test_a_shifted_run_is_the_same_on_one_or_two_device_processes(tmp_path):
    """The client's noise and rotation are its own: they do not depend on which device
    hosts it or which clients share its cohort."""
    from flt_command import QUICKSTART, flt, results_without_timing

    runs = []
    for n in (1, 2):
        done = flt(
            "run",
            str(QUICKSTART),
            "--set",
            "partition={kind: iid, clients: 8, clusters: 2, samples_per_client: 40, test_per_client: 10, "
            "public_fraction: 0.2, shift: {kind: noise, levels: [0.1, 0.4]}}",
            "--set",
            "train.rounds=3",
            "--set",
            "methods=[fedavg, local]",
            "--set",
            f"devices.processes={n}",
            "--out",
            str(tmp_path / f"p{n}"),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(results_without_timing(tmp_path / f"p{n}"))
    assert runs[0] == runs[1]
