"""Memory: device processes on one host share one read-only copy of each dataset (a
memory-mapped uint8 .npy cache), and a client's shard keeps indices, never float images."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from flt.common.files import cache_dir, write_atomic
from flt.devices.device import Images, _shard
from flt.emulator.processes import DeviceFleet
from flt.emulator.run import assign_clients
from flt.scenarios.datasets import load_dataset, load_shared
from flt.scenarios.partition import Partition
from flt.server.transport import Transport


def _mapped_files(pid: int) -> set[str]:
    """Paths of the files mapped into process `pid` (from /proc/PID/maps)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6}


def test_a_shared_split_is_a_read_only_map_of_one_cache_file_with_the_same_values():
    plain = load_dataset("digits", None, train=True)
    first, again = load_shared("digits", None, train=True), load_shared("digits", None, train=True)
    for ds in (first, again):
        assert isinstance(ds.x, np.memmap) and not ds.x.flags.writeable
        np.testing.assert_array_equal(ds.x, plain.x)
        np.testing.assert_array_equal(ds.y, plain.y)
    assert first.x.filename == again.x.filename
    assert Path(first.x.filename).parent == cache_dir() / "shared"


@pytest.mark.parametrize("keep", [1000, 0])
def test_a_cut_short_or_emptied_cache_file_is_written_again(tmp_path, monkeypatch, keep):
    monkeypatch.setenv("FLT_CACHE", str(tmp_path))
    path = Path(load_shared("digits", None, train=False).x.filename)
    path.write_bytes(path.read_bytes()[:keep])
    ds = load_shared("digits", None, train=False)
    np.testing.assert_array_equal(ds.x, load_dataset("digits", None, train=False).x)


def test_an_unwritable_cache_warns_and_keeps_a_private_copy(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")  # a folder under a file cannot be made, even by root
    monkeypatch.setenv("FLT_CACHE", str(tmp_path / "file" / "cache"))
    ds = load_shared("digits", None, train=False)
    assert "no shared cache" in caplog.text  # a warning of the flt loggers, as every other
    assert not isinstance(ds.x, np.memmap)
    np.testing.assert_array_equal(ds.x, load_dataset("digits", None, train=False).x)


def test_a_shard_holds_indices_and_labels_and_makes_the_old_floats_on_demand():
    ds = load_shared("digits", None, train=True)
    split = (Images(ds.x, torch.device("cpu")), torch.from_numpy(np.array(ds.y)))
    idx = np.array([5, 0, 17, 5, 300])
    shard = _shard(split, split, idx, idx[:2])
    held = [getattr(shard, f.name) for f in dataclasses.fields(shard)]
    assert not any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in held)
    # what the shard used to keep for the whole run: the same bits, made per task
    old = torch.from_numpy(load_dataset("digits", None, train=True).x)[torch.from_numpy(idx)].float().div_(255)
    assert torch.equal(shard.x, old) and torch.equal(shard.x_test, old[:2])
    assert shard.y.tolist() == ds.y[idx].tolist()
    one, two = shard.x, shard.x
    assert one.data_ptr() != two.data_ptr()  # made per access: nothing cached on the shard


@pytest.mark.parametrize("first_wins", [True, False])
def test_a_split_written_meanwhile_by_another_process_is_kept_not_renamed_over(tmp_path, first_wins):
    path = tmp_path / "split.npy"

    def write_while_another_process_finishes_first(f):
        f.write(b"ours")
        path.write_bytes(b"theirs")

    write_atomic(path, write_while_another_process_finishes_first, first_wins=first_wins)
    assert path.read_bytes() == (b"theirs" if first_wins else b"ours")
    assert [p.name for p in tmp_path.iterdir()] == ["split.npy"]  # no temporary file left


@pytest.mark.slow  # two device processes import torch: about 15 s on 2 cores
def test_two_device_processes_map_the_same_cache_file(tmp_path):
    """Run first in a session (an empty cache), both devices write the split at once, and
    the second renamed its copy over the first's, which then mapped a deleted file."""
    transport = Transport()
    fleet = DeviceFleet(transport.endpoint, tmp_path / "logs")
    try:
        fleet.start(2)
        devices = fleet.wait(transport, 60)
        partition = Partition(
            train=[np.arange(i, 400, 4) for i in range(4)],
            test=[np.arange(i, 100, 4) for i in range(4)],
            cluster=np.zeros(4, np.int64),
        )
        meta = {
            "dataset": {"name": "digits", "root": None, "download": False},
            "accelerator": "cpu",
            "model": {"name": "mlp", "in_shape": [1, 28, 28], "num_classes": 10},
        }
        assign_clients(transport, partition, devices, meta, 60, np.arange(4))
        maps = [_mapped_files(fleet.procs[d].pid) for d in devices]
        shared = str(cache_dir() / "shared")
        cached = [{p for p in m if p.startswith(shared) and p.endswith(".x.npy")} for m in maps]
        assert len(cached[0]) == 2 and cached[0] == cached[1]  # train and test, the same files in both
    finally:
        transport.close()
        fleet.stop()


def test_evaluating_in_slices_of_clients_gives_each_client_the_same_figures():
    from flt.common.wire import Message
    from flt.devices import ops
    from flt.devices.device import Device
    from flt.devices.trainer import CohortTrainer
    from flt.models.flat import flatten, param_spec
    from flt.models.nets import build_model

    ds = load_shared("digits", None, train=False)
    split = (Images(ds.x, torch.device("cpu")), torch.from_numpy(np.array(ds.y)))
    dev = Device("tcp://127.0.0.1:9", name="t")  # connect is lazy: no server needed here
    try:
        model = build_model("mlp", (1, 28, 28), 10)
        dev.trainer = CohortTrainer(model, param_spec(model))
        base = flatten(model).detach().numpy()
        batch = []
        for c in range(5):  # unequal test shards, a different model each
            dev.shards[c] = _shard(split, split, np.arange(c, 40, 5), np.arange(3 * c, 3 * c + 4 + 7 * c))
            batch.append(Message("evaluate", 1, c, tensors={"model": (base + 0.01 * c)[None]}, meta={"batch": 1}))
        whole = [m.meta for m in ops.evaluate(dev, batch)]
        assert [m.meta for m in ops.evaluate(dev, batch, slice_size=2)] == whole
        assert [m["total"] for m in whole] == [4.0, 11.0, 18.0, 25.0, 32.0]
    finally:
        dev.sock.close(linger=0)


HEAP_PROBE = """
import resource
import torch
from flt.common.heap import limit_heap_retention, working_heap
from flt.devices.seeds import client_generator
from flt.devices.trainer import CohortTrainer, TrainConfig
from flt.models.flat import flatten, param_spec
from flt.models.nets import build_model

if not limit_heap_retention():  # as a device process does
    print("not glibc")
    raise SystemExit
torch.set_num_threads(1)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
net = build_model("leaf_cnn", (1, 28, 28), 62)  # its 26 MB dense layer: a 26 MB gradient a step
trainer, w0 = CohortTrainer(net, param_spec(net)), flatten(net)
x, y = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8), torch.randint(0, 62, (40,))


def train():  # one client, 4 SGD steps, the per-client loop a CNN takes on a CPU
    f0 = faults()
    trainer.train(w0[None], [x], [y], TrainConfig(epochs=1, vectorize=False), [client_generator(0, 0)])
    return faults() - f0


train()
outside = train()
before = rss()
with working_heap():
    train()
    inside = train()
    held = [torch.ones(5 << 20) for _ in range(10)]  # 200 MB, freed before the op ends
    del held
print(outside, inside, rss() - before)
"""


def test_a_devices_working_heap_reuses_large_blocks_and_hands_them_back_after():
    """Device processes send blocks over 256 kB to mmap (fresh pages, faulted in anew each
    time); while an op computes they come from the heap instead, and the heap is trimmed
    when it ends, so memory held between rounds does not grow."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=300, check=True)
    if out.stdout.strip() == "not glibc":
        pytest.skip("the C library is not glibc: the heap keeps its defaults")
    outside, inside, grown = (int(v) for v in out.stdout.split())
    assert outside > 4 * 6000  # each step's 26 MB gradient faulted in page by page
    assert inside < outside / 4  # reused from step to step
    assert grown < 50 << 20  # what the op freed went back to the system
