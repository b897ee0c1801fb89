"""What `flt run` and `flt relate` both stand up before a method runs: the server socket, the
device processes (or Ray actors, or devices started by hand), the clients each device hosts,
and the federation the strategies talk to, with every reply checked against the partition.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from flt.common.determinism import deterministic_kernels
from flt.common.errors import DeviceError, short
from flt.common.schema import ConfigError
from flt.common.wire import Message
from flt.emulator.config import check_crash
from flt.emulator.fleet import make_fleet
from flt.reports.terminal import Progress
from flt.scenarios import partition as part
from flt.server.auth import gate_for
from flt.server.encoder import image_source
from flt.server.federation import Federation
from flt.server.routing import host_blocks
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context
from flt.server.transport import DeviceLost, Transport


class Session:
    """The transport and the device fleet of one run folder. `external` False: only the
    devices this machine starts (`flt relate`); `crash` False: no injected device crash."""

    def __init__(
        self,
        cfg: dict,
        run_dir: Path,
        init: torch.Tensor,
        model_spec: dict,
        n_clients: int,
        external: bool = True,
        crash: bool = True,
    ):
        d = cfg["devices"]
        self.cfg, self.external = cfg, d["external"] if external else 0
        n_proc = d["processes"]
        self.n_proc = min(os.cpu_count() or 1 if n_proc is None else n_proc, n_clients)
        if crash:
            check_crash(d["crash"], self.n_proc)  # the cap at one per client is known only now
        # the server's own tensor work is light; leave the cores to the device processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - self.n_proc * d["threads"]))
        self.transport = Transport(
            d["bind"],
            gate_for(d["bind"], d["security"], d["keys"], self.external),
            max_inbound=max_upload(cfg, init, model_spec),
        )
        fleet_cfg = d if crash else {**d, "crash": {}}
        self.fleet = make_fleet(fleet_cfg, self.transport.endpoint, run_dir / "logs", enroll=self.transport.gate.enroll)
        self.transport.alive = self.fleet.alive
        self.transport.cpu_seconds = self.fleet.cpu_seconds
        self.devices: list[str] = []
        self.meta: dict = {}
        self.model_spec = model_spec

    def start(self, partition: part.Partition, model_spec: dict, clients: np.ndarray, progress: Progress) -> list[str]:
        """Start the devices, wait for them (and for external ones), give them `clients`."""
        d = self.cfg["devices"]
        with self.transport.expecting("hello"):
            self.fleet.start(self.n_proc)
            own = self.fleet.wait(self.transport, d["start_timeout_s"])
            self.devices = own + wait_external(self.transport, own, self.external, d["start_timeout_s"], progress)
        self.meta = assign_meta(self.cfg, model_spec)
        assign_clients(self.transport, partition, self.devices, self.meta, d["start_timeout_s"], clients, pool=own)
        return self.devices

    def federation(
        self, partition: part.Partition, init: torch.Tensor, public: np.ndarray
    ) -> tuple[Context, Federation]:
        """What strategies are built with, and the federation they talk to (replies checked
        against the partition's shard sizes and the model's size)."""
        cfg = self.cfg
        ctx = Context(
            init=init,
            n_clients=partition.n_clients,
            n_train=partition.train_sizes,
            device=aggregation_device(),
            seed=cfg["seed"],
            truth=partition.cluster.copy(),
            train=cfg["train"],
            public_images=image_source(cfg["data"], public),
            in_shape=tuple(self.model_spec["in_shape"]),
            num_classes=int(self.model_spec["num_classes"]),
        )
        fed = Federation(
            self.transport,
            cfg["train"],
            cfg["seed"],
            cfg["devices"]["round_timeout_s"],
            ctx.device,
            shard_sizes=lambda c: (len(partition.train[c]), len(partition.test[c])),
            model_size=init.numel(),
        )
        return ctx, fed

    def close(self) -> None:
        self.transport.close()
        self.fleet.stop()


def max_upload(cfg: dict, init: torch.Tensor, model_spec: dict) -> int:
    """The largest message a device may send: one model, or what a method's own device op
    sends up when that is larger (PACFL's bases); anything larger is refused unread."""
    shape, classes = tuple(model_spec["in_shape"]), int(model_spec["num_classes"])
    ops = [STRATEGIES[m["name"]].max_upload(m["params"], shape, classes) for m in cfg["methods"]]
    return max([init.numel() * init.element_size(), *ops])


def check_device_ops(cfg: dict) -> None:
    """Every device op the scenario's methods declare exists on the device side (devices/ops.py
    or devices/methods/<name>.py): else a ConfigError naming the method and the op, before
    any process starts."""
    from flt.devices import ops  # the device half's registry (imports each method's own ops)

    for spec in cfg["methods"]:
        for op in STRATEGIES[spec["name"]].DEVICE_OPS:
            try:
                ops.lookup(op.name)
            except ops.UnknownOp:
                raise ConfigError(
                    f"method {spec['label']!r} ({spec['name']}) declares device op {op.name!r}, which no device "
                    f"has: register it in devices/methods/{op.name}.py"
                ) from None


def check_local_accelerator(devices: dict) -> None:
    """`accelerator: cuda` with device processes started on this host, which has no GPU:
    each of them would fail to load its clients (exit 3, after the run folder was made);
    say so first. Devices on other hosts (external, Ray) answer for their own GPUs."""
    local = devices["launcher"] == "local" and devices["processes"] != 0
    if devices["accelerator"] == "cuda" and local and not torch.cuda.is_available():
        raise ConfigError(
            "devices.accelerator is cuda, but this host has no CUDA GPU (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda}) and its device processes "
            "(dev-0, ...) run here; use auto (the GPU where there is one) or cpu"
        )


def aggregation_device() -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deterministic_kernels(device)  # the encoder's pretraining runs here too
    return device


def assign_meta(cfg: dict, model_spec: dict) -> dict:
    """What every device needs to host its clients: where the data is, the model, where to train."""
    return {
        "dataset": {
            "name": cfg["data"]["dataset"],
            "root": data_root(cfg["data"]["root"]),
            "download": cfg["data"]["download"],
        },
        "model": model_spec,
        "accelerator": cfg["devices"]["accelerator"],
    }


def assign_clients(
    transport: Transport,
    partition: part.Partition,
    devices: list[str],
    meta: dict,
    timeout_s: float,
    clients: np.ndarray,
    pool: Collection[str] = (),
) -> None:
    """Give each device a block of `clients` to host (their shard indices, never data),
    balanced by training samples (server/routing.py: host_blocks). The devices in `pool`
    (the emulator's own processes, not devices started by hand) also get the shard indices
    of every client the pool hosts: any of them may then train any of these clients from a
    sent model (server/routing.py). A device that cannot
    take its block (it reports an error, does not answer within the timeout, or says ready
    for other clients) is lost with its clients, named in the log, and the run goes on
    without it; with no device left, nobody can train (DeviceError)."""
    clients = np.asarray(clients, dtype=np.int64)
    blocks = dict(zip(devices, host_blocks(clients, partition.train_sizes[clients], len(devices)), strict=True))
    shared = [d for d in devices if d in pool] if len(set(pool) & set(devices)) > 1 else []
    pooled = np.concatenate([blocks[d] for d in shared]) if shared else np.zeros(0, np.int64)
    if partition.shift is not None:
        meta = {**meta, "shift": partition.shift.meta()}
    expected: dict[str, list[int]] = {}
    with transport.expecting("ready", blocks):
        for device, block in blocks.items():
            for c in block:
                transport.client_device[int(c)] = device
            expected[device] = block.tolist()
            # a device outside the pool (a newcomer's: its assign is billed) holds what it hosts
            tensors = {**_shards(partition, pooled), "hosted": block} if device in shared else _shards(partition, block)
            try:
                transport.send(device, Message("assign", meta=meta, tensors=tensors))
            except DeviceLost as exc:
                transport.lose(device, str(exc))
        live = {d: c for d, c in expected.items() if d not in transport.lost_devices}
        failed = _await_ready(transport, live, timeout_s)
    for device, why in failed.items():
        transport.lose(device, why)
    if not transport.active_devices():
        reasons = "; ".join(f"{d}: {why}" for d, why in sorted(failed.items())[:3])
        raise DeviceError(f"no device could load its clients ({reasons})")
    ready = tuple(d for d in shared if d not in transport.lost_devices)
    for c in pooled.tolist():
        transport.holders[c] = ready


def _shards(partition: part.Partition, clients: np.ndarray) -> dict[str, np.ndarray]:
    """The assign message's tensors for `clients`: their shard indices (and shift levels)."""
    tensors = {"clients": clients.astype(np.int64)}
    for name, shards in (("train", partition.train), ("test", partition.test)):
        chosen = [shards[c] for c in clients]
        tensors[f"{name}_offsets"] = np.cumsum([0] + [len(s) for s in chosen]).astype(np.int64)
        tensors[f"{name}_idx"] = (np.concatenate(chosen) if chosen else np.zeros(0)).astype(np.int64)
    if partition.shift is not None:
        tensors.update(partition.shift.tensors(clients))
    return tensors


def _await_ready(transport: Transport, expected: dict[str, list[int]], timeout_s: float) -> dict[str, str]:
    """Wait for each device's `ready` naming exactly its clients; returns why each device
    that did not send one failed."""
    failed: dict[str, str] = {}
    waiting, deadline = set(expected), time.monotonic() + timeout_s
    while waiting:
        # anything else is rejected, not billed: a broken device's extra set-up message
        # would otherwise count in the ledger of the method a newcomer arrives in
        got = transport.recv(max(0.0, deadline - time.monotonic()), ("ready", "error"), waiting.__contains__)
        if got is None:
            failed.update({d: f"did not load its clients within {timeout_s:g} s" for d in waiting})
            break
        device, msg = got
        if msg.kind == "error":
            failed[device] = f"could not load its clients: {short(msg.meta.get('reason'), 300)}"
        elif msg.meta.get("clients") != expected[device]:
            failed[device] = f"said ready for clients {short(msg.meta.get('clients'), 60)}, not the ones it was given"
        waiting.discard(device)
    return failed


def wait_external(transport: Transport, local: list[str], n: int, timeout_s: float, progress: Progress) -> list[str]:
    """Devices started by hand (`flt device --connect ...`), possibly on other hosts."""
    if n == 0:
        return []
    progress(f"waiting for {n} external device(s): flt device --connect {transport.endpoint}")
    transport.wait_devices(len(local) + n, timeout_s)
    return sorted(d for d in transport.devices if d not in local)  # by name, not arrival


def data_root(root: str | None) -> str | None:
    """The scenario's data root as an absolute path (devices may run in another folder)."""
    return str(Path(root).expanduser().resolve()) if root else None
