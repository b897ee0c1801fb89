"""The device-side operation registry (devices/ops.py): a method's client step is looked
up by name, travels as a generic task over a real socket, and an unknown one is refused
with a reply that names it."""

import contextlib
import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flt.common.wire import Message, ProtocolError, decode, encode
from flt.devices import ops
from flt.devices.device import Device
from flt.devices.trainer import CohortTrainer
from flt.models.flat import flatten, param_spec
from flt.models.nets import build_model
from flt.server.exchange import Call
from flt.server.federation import Federation
from flt.server.ops import CHOOSE, TRAIN_BEST, TRAIN_RESIDENT
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Task
from flt.server.transport import Transport


def test_every_strategy_names_device_ops_that_exist():
    for name, cls in STRATEGIES.items():
        for op in cls.DEVICE_OPS:
            assert callable(ops.lookup(op.name)), (name, op)


def test_an_op_of_a_method_is_imported_by_its_name_and_unknown_ones_are_named():
    from flt.devices.methods.choose import choose

    assert ops.lookup("choose") is choose  # devices/methods/choose.py registered it
    for bad in ("nosuch", "../etc", "Choose"):
        with pytest.raises(ops.UnknownOp, match=r"unknown device op .*\(this device has: .*choose"):
            ops.lookup(bad)
    with pytest.raises(ValueError, match="registered twice"):
        ops.register("train")(lambda device, batch: [])
    with pytest.raises(ValueError, match="lower-case"):
        ops.register("Bad Name")


def test_the_built_in_kinds_keep_their_names_and_a_task_names_its_op():
    assert ops.op_name(Message("encoder")) == "embed"
    assert ops.op_name(Message("train", meta={"op": "choose"})) == "train"
    assert ops.op_name(Message("task", meta={"op": "choose"})) == "choose"


@pytest.mark.parametrize(
    "meta, what",
    [
        ({}, "needs meta 'op'"),
        ({"op": 3}, "needs meta 'op'"),
        ({"op": "x" * 41}, "needs meta 'op'"),
        ({"op": "choose", "traffic": "gossip"}, "meta 'traffic' must be one of"),
    ],
)
def test_a_generic_task_without_a_valid_op_or_traffic_class_does_not_travel(meta, what):
    with pytest.raises(ProtocolError, match=what):
        encode(Message("task", meta=meta))
    good = encode(Message("task", meta={"op": "choose"}))
    good[0] = good[0].replace(b'{"op":"choose"}', __import__("json").dumps(meta).encode())
    with pytest.raises(ProtocolError, match=what):
        decode(good)


def test_a_generic_message_is_billed_under_the_traffic_class_it_names():
    assert Message("task", meta={"op": "choose", "traffic": "model"}).traffic == "model"
    assert Message("result", meta={"op": "choose"}).traffic == "control"


@contextlib.contextmanager
def device_served(cls: type[Device] = Device, clients=(4, 7)):
    """A real Device loop (in a thread) with a few clients, behind a real server socket."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    server = Transport()
    dev = cls(server.endpoint, name="dev-ops")
    g = torch.Generator().manual_seed(1)
    for c in clients:
        x = torch.rand(12, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (12,), generator=g)
        dev.shards[c] = SimpleNamespace(x=x, pixels=x, y=y, x_test=x[:4], y_test=y[:4])  # what ops read of a shard
    dev.trainer = CohortTrainer(model, param_spec(model))
    thread = threading.Thread(target=dev.run, daemon=True)
    thread.start()
    assert server.wait_devices(1, 20) == ["dev-ops"]
    server.client_device.update(dict.fromkeys(clients, "dev-ops"))
    try:
        yield server, dev, flatten(model).detach()
    finally:
        server.broadcast(Message("shutdown"))
        thread.join(10)
        dev.sock.close(linger=0)
        server.sock.close(linger=0)


@pytest.fixture()
def served_device():
    with device_served() as served:
        yield served


def test_a_new_op_travels_as_a_task_and_answers_over_a_real_socket(served_device):
    server, dev, w0 = served_device
    candidates = torch.stack([w0, w0 * 0.5, w0 + 0.01 * torch.randn_like(w0)]).numpy()
    # the path a strategy takes: the federation's typed call, reported as an event
    fed = Federation(server, {}, seed=0, timeout_s=30, device=torch.device("cpu"))
    ex = fed.run(CHOOSE, 1, {c: Call({"model": candidates}) for c in (4, 7)})
    replies = ex.results
    assert sorted(replies) == sorted(ex.kept) == [4, 7] and fed.take_events() == [ex.report]
    assert ex.report["bytes"]["down"]["model"] > 2 * candidates.nbytes  # payload + headers
    for c, r in replies.items():
        shard = dev.shards[c]
        want = dev.trainer.losses_of(torch.from_numpy(candidates), [shard.x], [shard.y])[0]
        np.testing.assert_allclose(r.tensors["losses"], want.numpy(), rtol=1e-6)
        assert r.meta["choice"] == int(want.argmin()) and r.meta["op"] == "choose" and r.meta["n"] == 12
    down = server.ledger.totals()["down"]
    assert down["model"]["payload"] == 2 * candidates.nbytes  # billed as the class the task names


def test_an_unknown_op_gets_an_error_reply_that_names_it(served_device, caplog):
    server, _, _ = served_device
    with caplog.at_level(logging.ERROR, logger="flt.server"):
        replies = server.gather({4: Message("task", 1, 4, meta={"op": "nosuch"})}, "result", 30)
    assert replies == {}
    assert any("unknown device op 'nosuch'" in r.getMessage() for r in caplog.records), caplog.text


# -- methods' own training ops: Local's train_resident, IFCA's train_best ---------------
def _fed(server) -> Federation:
    cfg = {"local_epochs": 2, "batch_size": 5, "lr": 0.05, "vectorize": True}
    return Federation(server, cfg, seed=3, timeout_s=30, device=torch.device("cpu"))


def _plain(fed, rnd, starts: dict) -> dict:
    """What the plain `train` op makes of each client's start model [P] in round `rnd`."""
    ex = fed.train(rnd, {c: Task(w[None]) for c, w in starts.items()})
    return {c: r.model for c, r in ex.results.items()}


def test_plain_train_knows_neither_candidates_nor_resident_models(served_device, caplog):
    server, _, w0 = served_device
    three = np.stack([w0.numpy()] * 3)
    base = {"epochs": 1, "batch_size": 5, "lr": 0.1}
    with caplog.at_level(logging.ERROR, logger="flt.server"):
        assert server.gather({4: Message("train", 1, 4, tensors={"model": three}, meta=base)}, "update", 30) == {}
        assert server.gather({7: Message("train", 1, 7, meta={**base, "resident": True})}, "update", 30) == {}
    text = caplog.text
    assert "'train' takes one model, the task carries 3" in text and "train_best" in text, text
    assert "clients [7]: the 'train' task carries no tensor 'model'" in text, text


def test_train_best_picks_the_lowest_loss_candidate_then_trains_it(served_device):
    server, dev, w0 = served_device
    g = torch.Generator().manual_seed(5)
    candidates = torch.stack([w0 * 0.5, w0, w0 + 0.05 * torch.randn(w0.shape, generator=g)])
    fed = _fed(server)
    ex = fed.train(2, {c: Task(candidates, op=TRAIN_BEST) for c in (4, 7)})
    assert sorted(ex.kept) == [4, 7]
    down, up = server.ledger.totals()["down"]["model"], server.ledger.totals()["up"]["model"]
    assert down["payload"] == 2 * candidates.numel() * 4 and up["payload"] == 2 * w0.numel() * 4  # model traffic
    picked = {}
    for c, r in ex.results.items():
        shard = dev.shards[c]
        want = int(dev.trainer.losses_of(candidates, [shard.x], [shard.y])[0].argmin())
        assert r.meta["choice"] == want and r.meta["op"] == "train_best" and r.n == 12
        picked[c] = candidates[want]
    plain = _plain(fed, 2, picked)  # the same round's seed: the same batches
    for c, r in ex.results.items():
        torch.testing.assert_close(r.model, plain[c], rtol=0, atol=0)


def test_train_resident_keeps_the_model_on_the_device_across_rounds(served_device):
    server, dev, w0 = served_device
    fed = _fed(server)
    first = fed.train(1, {c: Task(w0[None], op=TRAIN_RESIDENT) for c in (4, 7)})
    assert all(r.model is None and r.meta["op"] == "train_resident" for r in first.results.values())
    assert server.ledger.totals()["up"]["model"]["payload"] == 0  # nothing but headers came back
    after_one = _plain(fed, 1, {4: w0, 7: w0})
    for c in (4, 7):
        torch.testing.assert_close(dev.resident[c], after_one[c], rtol=0, atol=0)
    # round 2 sends nothing: the device trains on from what it kept
    second = fed.train(2, {4: Task(None, op=TRAIN_RESIDENT)})
    assert second.kept == [4]
    torch.testing.assert_close(dev.resident[4], _plain(fed, 2, {4: after_one[4]})[4], rtol=0, atol=0)
    kept = server.gather({4: Message("snapshot", 2, 4)}, "state", 30)[4]  # what a checkpoint saves
    np.testing.assert_array_equal(kept.tensors["model"], dev.resident[4].numpy())


def test_one_round_may_mix_ops(served_device):
    server, _, w0 = served_device
    fed = _fed(server)
    candidates = torch.stack([w0 * 0.5, w0])
    ex = fed.train(1, {4: Task(w0[None]), 7: Task(candidates, op=TRAIN_BEST)})
    assert sorted(ex.kept) == [4, 7] and ex.results[4].meta["choice"] == 0 and "op" not in ex.results[4].meta
    assert ex.results[7].meta["op"] == "train_best"
    torch.testing.assert_close(ex.results[4].model, _plain(fed, 1, {4: w0})[4], rtol=0, atol=0)


def test_an_op_the_method_did_not_declare_is_refused_by_name(served_device):
    server, _, w0 = served_device
    fed = _fed(server)
    fed.declare("fedavg", STRATEGIES["fedavg"].DEVICE_OPS)
    with pytest.raises(ValueError, match=r"method 'fedavg' asks for device op 'choose', which its DEVICE_OPS"):
        fed.run(CHOOSE, 1, {4: Call({"model": w0[None].numpy()})})
    with pytest.raises(ValueError, match=r"method 'fedavg' asks for device op 'train_best'"):
        fed.train(1, {4: Task(w0[None]), 7: Task(w0[None], op=TRAIN_BEST)})


def test_a_checkpoint_snapshot_takes_no_batch_id_of_the_method(served_device):
    """How often a run checkpoints must not change its results: batch ids are in every
    billed header, so the snapshot that gathers device-held models uses ids of its own."""
    server, dev, w0 = served_device
    fed = _fed(server)
    fed.train(1, {4: Task(w0[None], op=TRAIN_RESIDENT)})
    first, again = fed.state_dict(1), fed.state_dict(1)
    assert first["batch"] == again["batch"] == 2  # round 1 took id 1; two snapshots took none
    np.testing.assert_array_equal(again["clients"]["models"][4], dev.resident[4].numpy())


class _NoStateFor(Device):
    """A device that never reports the state of client 7, and a wrong one for client 4."""

    def send(self, msg: Message) -> None:
        if msg.kind == "state" and msg.client == 7:
            return
        if msg.kind == "state" and msg.client == 4:
            msg = Message("state", msg.round, 4, tensors={"model": np.zeros(5, np.float32)}, meta=msg.meta)
        super().send(msg)


@pytest.mark.slow
def test_a_checkpoint_is_written_without_the_state_a_device_did_not_give_and_resume_names_it():
    """A device that does not answer the checkpoint's snapshot, or answers it wrong, must
    not stop the run (it did: RuntimeError): the state is checked like any reply, and the
    checkpoint lists whose state it lacks."""
    with device_served(_NoStateFor, clients=(4, 7, 9)) as (server, dev, w0):
        cfg = {"local_epochs": 1, "batch_size": 4, "lr": 0.05, "vectorize": True}
        fed = Federation(server, cfg, seed=3, timeout_s=2, device=torch.device("cpu"), model_size=w0.numel())
        fed.train(1, {c: Task(w0[None], op=TRAIN_RESIDENT) for c in (4, 7, 9)})
        state = fed.state_dict(1)
        assert state["clients"]["missing"] == [4, 7]  # 7 said nothing; 4 sent a model of the wrong size
        assert sorted(state["clients"]["models"]) == [9]
        np.testing.assert_array_equal(state["clients"]["models"][9], dev.resident[9].numpy())
        assert server.rejections.by_reason["bad state"][0] == 1
        assert fed.load_state_dict(state) == [4, 7]  # what resume reports as lacking


def test_a_method_declaring_an_op_no_device_has_is_refused_at_start_up(monkeypatch):
    from flt.common.schema import ConfigError
    from flt.emulator.session import check_device_ops
    from flt.server.ops import DeviceOp

    methods = [{"name": "fedavg", "label": "mine"}]
    check_device_ops({"methods": methods})  # the shipped declaration is fine
    monkeypatch.setattr(STRATEGIES["fedavg"], "DEVICE_OPS", (*STRATEGIES["fedavg"].DEVICE_OPS, DeviceOp("nosuch")))
    with pytest.raises(ConfigError, match=r"method 'mine' \(fedavg\) declares device op 'nosuch', which no device"):
        check_device_ops({"methods": methods})


def test_subspace_sends_each_class_top_singular_vectors_and_is_checked(served_device):
    """PACFL's client step over a real socket: p unit rows per class the client holds, the
    right singular vectors of that class's images; a reply the server cannot use is refused."""
    from flt.devices.methods.subspace import class_bases
    from flt.server.ops import SUBSPACE

    server, dev, _ = served_device
    fed = _fed(server)
    fed.shard_sizes = lambda c: (12, 4)
    ex = fed.run(SUBSPACE, 0, {c: Call({}, {"basis": 2, "dim": 784}) for c in (4, 7)}, "pacfl")
    assert sorted(ex.kept) == [4, 7] and ex.report["bytes"]["up"]["embedding"] > 0
    for c, r in ex.results.items():
        shard = dev.shards[c]
        counts = torch.unique(shard.y, return_counts=True)[1]
        basis = r.tensors["basis"]
        assert basis.shape == (int(counts.clamp(max=2).sum()), 784)  # a class of one image has one direction
        np.testing.assert_allclose(np.linalg.norm(basis, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(basis, class_bases(shard.x, shard.y, 2).numpy(), atol=1e-6)
        first = shard.x[shard.y == shard.y.min()].reshape(-1, 784).double()  # the lowest class's own SVD
        top = torch.linalg.svd(first, full_matrices=False).Vh[0]
        assert float((top @ torch.from_numpy(basis[0]).double()).abs()) == pytest.approx(1.0, abs=1e-5)
    fed.shard_sizes = lambda c: (13, 4)  # a count the partition does not agree with: refused
    assert fed.run(SUBSPACE, 0, {4: Call({}, {"basis": 2, "dim": 784})}).results == {}


def test_with_no_basis_sent_each_client_embeds_in_its_own_principal_axes(served_device):
    """PCA+kM+HC `basis: client` (the FLT authors' code) over a real socket: nothing goes
    down but e; each client's centroids are k-means of its own PCA coordinates, so their
    share-weighted mean is 0 and the axes its 12 images cannot fill are zero columns."""
    from flt.devices.embedding import embed_own_pca

    server, dev, _ = served_device
    fed = _fed(server)
    fed.shard_sizes = lambda c: (12, 4)
    ex = fed.embed(0, np.array([4, 7]), {}, {"format": "own_pca", "k": 2, "latent": 16})
    assert sorted(ex.kept) == [4, 7]
    assert server.ledger.totals()["down"]["encoder"]["payload"] == 0  # no basis travels
    for c, (cents, shares, halves) in ex.results.items():
        assert cents.shape == (2, 16) and halves is not None
        np.testing.assert_allclose(shares @ cents, 0.0, atol=1e-5)  # its own data's mean
        np.testing.assert_array_equal(cents[:, 12:], 0.0)
        own = embed_own_pca([dev.shards[c].x], 16, [0])[0]
        # the summary spans the client's own top axis (|first coordinate| of its centroids)
        assert np.abs(cents[:, 0]).max() <= np.abs(own[:, 0]).max() + 1e-5
    a, b = (embed_own_pca([dev.shards[c].x], 16, [0])[0] for c in (4, 7))
    together = embed_own_pca([dev.shards[4].x, dev.shards[7].x], 16, [0, 0])
    np.testing.assert_array_equal(together[0], a)  # a client's axes are its own alone
    np.testing.assert_array_equal(together[1], b)
    from sklearn.decomposition import PCA

    pixels = dev.shards[4].x.flatten(1).double().numpy()
    np.testing.assert_allclose(a[:, :12], PCA(n_components=12).fit_transform(pixels), atol=1e-5)


def test_a_client_summarises_all_its_data_and_each_of_two_disjoint_halves():
    from flt.devices.embedding import split_halves

    rng = np.random.default_rng(0)
    emb = np.concatenate([rng.normal(size=(20, 4)), rng.normal(size=(21, 4)) + 10]).astype(np.float32)
    y = np.repeat([0, 1], [20, 21])
    a, b = split_halves(len(emb), seed=7)
    assert len(np.intersect1d(a, b)) == 0 and sorted(np.concatenate([a, b]).tolist()) == list(range(41))
    assert split_halves(41, seed=7)[0].tolist() == a.tolist()  # seeded
    tensors, half_k = ops._summaries(emb, y, 2, seed=7)
    assert set(tensors) == {"centroids", "shares", "halves", "half_shares"} and half_k == 2
    halves, shares = tensors["halves"], tensors["half_shares"]
    assert abs(shares[:half_k].sum() - 1) < 1e-6 and abs(shares[half_k:].sum() - 1) < 1e-6
    # each half's centroids are its own samples' k-means: two class means of that half
    means_a = sorted(emb[a][y[a] == c].mean(0)[0] for c in (0, 1))
    assert np.allclose(sorted(halves[:half_k, 0]), means_a, atol=1e-4)
    labelled, k = ops._summaries(emb, y, "labels", seed=7)
    assert k == 2 and labelled["halves"][:k, -1].tolist() == [0.0, 1.0]
    alone, none = ops._summaries(emb[:1], y[:1], 2, seed=7)  # one sample cannot be halved
    assert none == 0 and set(alone) == {"centroids", "shares"}


def test_a_state_reply_carries_at_most_one_bounded_reference_of_the_change_test():
    """A checkpoint keeps what each device tests its clients' changes against and hands it
    back on resume: a malformed or absurd one is refused like any wrong reply."""
    from flt.devices.watch import SAMPLE
    from flt.server.replies import REFERENCE_ROWS, state_check

    assert REFERENCE_ROWS == SAMPLE  # the server's bound is the images a device's test embeds
    check = state_check(5)

    def verdict(**tensors):
        return check(3, Message("state", 1, 3, tensors=tensors, meta={"flag": 0, "watched": 1}))

    good = np.zeros((REFERENCE_ROWS, 8), np.float32)
    assert verdict(reference=good) is None and verdict(reference=good, model=np.zeros(5, np.float32)) is None
    for bad in (
        np.zeros((REFERENCE_ROWS + 1, 8), np.float32),  # more rows than a test embeds
        np.zeros((4, 8), np.float64),
        np.zeros(8, np.float32),
        np.full((4, 8), 1e30, np.float32),  # finite, but no encoder gives it
        np.full((4, 8), np.nan, np.float32),
    ):
        assert verdict(reference=bad) is not None, bad.shape
    assert verdict(reference=good, other=good) is not None  # nothing else rides along
