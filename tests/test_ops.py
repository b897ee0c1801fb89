"""The device-side operation registry (devices/ops.py): a method's client step is looked
up by name, travels as a generic task over a real socket, and an unknown one is refused
with a reply that names it."""

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flt.devices import ops
from flt.devices.device import Device
from flt.devices.trainer import CohortTrainer
from flt.models.flat import flatten, param_spec
from flt.models.nets import build_model
from flt.models.wire import Message, ProtocolError, decode, encode
from flt.server.federation import Federation
from flt.server.strategies import STRATEGIES
from flt.server.transport import Transport


def test_every_strategy_names_device_ops_that_exist():
    for name, cls in STRATEGIES.items():
        for op in cls.DEVICE_OPS:
            assert callable(ops.lookup(op)), (name, op)


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


@pytest.fixture()
def served_device():
    """A real Device loop (in a thread) with two clients, behind a real server socket."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    server = Transport()
    dev = Device(server.endpoint, name="dev-ops")
    g = torch.Generator().manual_seed(1)
    for c in (4, 7):
        x = torch.rand(12, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (12,), generator=g)
        dev.shards[c] = SimpleNamespace(x=x, y=y, x_test=x[:4], y_test=y[:4])  # what ops read of a shard
    dev.trainer = CohortTrainer(model, param_spec(model))
    thread = threading.Thread(target=dev.run, daemon=True)
    thread.start()
    assert server.wait_devices(1, 20) == ["dev-ops"]
    server.client_device.update({4: "dev-ops", 7: "dev-ops"})
    yield server, dev, flatten(model).detach()
    server.broadcast(Message("shutdown"))
    thread.join(10)
    dev.sock.close(linger=0)
    server.sock.close(linger=0)


def test_a_new_op_travels_as_a_task_and_answers_over_a_real_socket(served_device):
    server, dev, w0 = served_device
    candidates = torch.stack([w0, w0 * 0.5, w0 + 0.01 * torch.randn_like(w0)]).numpy()
    msgs = {
        c: Message("task", 1, c, tensors={"model": candidates}, meta={"op": "choose", "traffic": "model"})
        for c in (4, 7)
    }
    # the path a strategy takes: the federation's one exchange call, reported as an event
    fed = Federation(server, {}, seed=0, timeout_s=30, device=torch.device("cpu"))
    ex = fed.exchange("choose", 1, msgs, "result")
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
