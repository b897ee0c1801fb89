"""`flt run`: one scenario, end to end.

Builds the partition once (saved in the run folder), starts the server socket and the
device processes, runs every method on the same partition, initial weights and
participation draws, and writes the results as they come: config.yaml, partition.npz,
<method>/metrics.jsonl, summary.json, convergence.png.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from flt.common.errors import DeviceError, short
from flt.common.wire import Message, encode, frame_bytes
from flt.emulator import processes
from flt.emulator.config import dump, load_encoder_sources
from flt.emulator.fleet import make_fleet
from flt.emulator.population import Population, assign_profiles, schedule_from
from flt.models.flat import flatten
from flt.models.nets import build_model
from flt.reports import summary as report
from flt.scenarios import partition as part
from flt.scenarios import shift
from flt.scenarios.datasets import Dataset, load_shared
from flt.server import checkpoint
from flt.server.auth import gate_for
from flt.server.encoder import image_source
from flt.server.federation import CHECKPOINT, Federation, run_method
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context
from flt.server.transport import DeviceLost, Ledger, Transport


def make_run_dir(cfg: dict, out: str | None) -> Path:
    if out:
        run_dir = Path(out)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg["output"]) / f"{cfg['name']}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump(cfg))
    (run_dir / "command.txt").write_text(report.command_line() + "\n")  # for `flt report`
    return run_dir


def load_data(cfg: dict) -> tuple[Dataset, Dataset]:
    d = cfg["data"]
    # mapped, not copied: the server reads labels only, and shares the pages with its devices
    return (
        load_shared(d["dataset"], d["root"], train=True, download=d["download"]),
        load_shared(d["dataset"], d["root"], train=False, download=d["download"]),
    )


def hold_out_public(cfg: dict, n_train: int) -> np.ndarray:
    """Indices of the train split kept away from every client (the public set)."""
    frac = cfg["partition"]["public_fraction"]
    rng = np.random.default_rng([cfg["seed"], 0x9B])
    return np.sort(rng.choice(n_train, size=int(frac * n_train), replace=False))


def build_partition(cfg: dict, train: Dataset, test: Dataset, public: np.ndarray) -> part.Partition:
    """The scenario's partition; with a shift, clients without a planted cluster take
    their shift group as their true cluster (the clusters kind's blocks are the groups)."""
    partition = _label_partition(cfg, train, test, public)
    p = cfg["partition"]
    if p["shift"]:
        unplanted = partition.cluster < 0
        partition.cluster[unplanted] = shift.group_of(partition.n_clients, p["clusters"])[unplanted]
    return attach_shift(cfg, partition, train.num_classes)


def attach_shift(cfg: dict, partition: part.Partition, num_classes: int) -> part.Partition:
    """Give the partition its clients' transforms (none without partition.shift)."""
    p = cfg["partition"]
    if p["shift"]:
        plan = shift.ShiftPlan.build(p["shift"], partition.n_clients, p["clusters"], num_classes, cfg["seed"])
        partition.shift = plan
    return partition


def _label_partition(cfg: dict, train: Dataset, test: Dataset, public: np.ndarray) -> part.Partition:
    p = cfg["partition"]
    rng = np.random.default_rng([cfg["seed"], 0xDA7A])
    common = dict(test_per_client=p["test_per_client"], rng=rng, exclude=public)
    if p["kind"] == "clusters":
        return part.partition_clusters(
            train.y,
            test.y,
            n_clients=p["clients"],
            n_clusters=p["clusters"],
            classes_per_cluster=p["classes_per_cluster"],
            shared_classes=p["shared_classes"],
            samples_per_client=p["samples_per_client"],
            on_short=p["on_short"],
            **common,
        )
    if p["kind"] == "iid":  # with a shift, each group draws from the whole split (IFCA's construction)
        groups = shift.group_of(p["clients"], p["clusters"]) if p["shift"] else None
        return part.partition_iid(
            train.y, test.y, n_clients=p["clients"], samples_per_client=p["samples_per_client"], groups=groups, **common
        )
    if p["kind"] == "dirichlet":
        return part.partition_dirichlet(
            train.y,
            test.y,
            n_clients=p["clients"],
            alpha=p["alpha"],
            samples_per_client=p["samples_per_client"],
            **common,
        )
    if p["kind"] == "structured":
        return part.partition_structured(
            train.y,
            test.y,
            n_clients=p["clients"],
            n_clusters=p["clusters"],
            classes_per_cluster=p["classes_per_cluster"],
            alpha=p["alpha"],
            delta=p["delta"],
            **common,
        )
    if train.groups is None:
        raise part.PartitionError(
            f"partition.kind: 'writers' needs a dataset with writers (femnist), not {cfg['data']['dataset']!r}"
        )
    return part.partition_groups(train.groups, test.groups, n_clients=p["clients"], rng=rng)


def record_shift(run_dir: Path, cfg: dict, partition: part.Partition, train: Dataset, per_group: int = 6) -> None:
    """shift.json (each group's transform) and shift_examples.png in the run folder."""
    plan = partition.shift
    if plan is None:
        return
    group = shift.group_of(partition.n_clients, cfg["partition"]["clusters"])
    described = plan.describe(group)
    (run_dir / "shift.json").write_text(json.dumps(described, indent=1) + "\n")
    rows = []
    for g, entry in zip(np.unique(group), described["groups"], strict=True):
        c = int(np.flatnonzero(group == g)[0])
        idx = partition.train[c][:per_group]
        cs = shift.client_shifts(plan.meta(), plan.tensors([c]), [c])[c]
        x = cs.images(torch.from_numpy(train.x[idx]).float().div_(255)).numpy()
        y = cs.labels(torch.from_numpy(train.y[idx]).long()).numpy()
        what = f"level {entry['level']:g}" if "level" in entry else "own label map"
        rows.append((f"group {g}: {plan.kind} {what}\n(client {c})", x, y))
    report.plot_shift_examples(run_dir / "shift_examples.png", rows)


def initial_weights(cfg: dict, train: Dataset) -> tuple[torch.Tensor, dict]:
    """Seeded initial model: the same starting point for every method of the run."""
    torch.manual_seed(cfg["seed"])
    spec = {"name": cfg["model"], "in_shape": list(train.x.shape[1:]), "num_classes": train.num_classes}
    return flatten(build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"])), spec


def aggregation_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assign_meta(cfg: dict, model_spec: dict) -> dict:
    """What every device needs to host its clients: where the data is, the model, where to train."""
    return {
        "dataset": {
            "name": cfg["data"]["dataset"],
            "root": _abs(cfg["data"]["root"]),
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
) -> None:
    """Give each device a contiguous block of `clients`: their shard indices, never data.
    A device that cannot take its block (it reports an error, does not answer within the
    timeout, or says ready for other clients) is lost with its clients, named in the log,
    and the run goes on without it; with no device left, nobody can train (DeviceError)."""
    blocks = np.array_split(np.asarray(clients, dtype=np.int64), len(devices))
    if partition.shift is not None:
        meta = {**meta, "shift": partition.shift.meta()}
    expected: dict[str, list[int]] = {}
    for device, block in zip(devices, blocks, strict=True):
        tensors = {"clients": block.astype(np.int64)}
        for name, shards in (("train", partition.train), ("test", partition.test)):
            chosen = [shards[c] for c in block]
            tensors[f"{name}_offsets"] = np.cumsum([0] + [len(s) for s in chosen]).astype(np.int64)
            tensors[f"{name}_idx"] = (np.concatenate(chosen) if chosen else np.zeros(0)).astype(np.int64)
        if partition.shift is not None:
            tensors.update(partition.shift.tensors(block))
        for c in block:
            transport.client_device[int(c)] = device
        expected[device] = block.tolist()
        try:
            transport.send(device, Message("assign", meta=meta, tensors=tensors))
        except DeviceLost as exc:
            transport.lose(device, str(exc))
    failed = _await_ready(transport, {d: c for d, c in expected.items() if d not in transport.lost_devices}, timeout_s)
    for device, why in failed.items():
        transport.lose(device, why)
    if not transport.active_devices():
        reasons = "; ".join(f"{d}: {why}" for d, why in sorted(failed.items())[:3])
        raise DeviceError(f"no device could load its clients ({reasons})")


def _await_ready(transport: Transport, expected: dict[str, list[int]], timeout_s: float) -> dict[str, str]:
    """Wait for each device's `ready` naming exactly its clients; returns why each device
    that did not send one failed."""
    failed: dict[str, str] = {}
    waiting, deadline = set(expected), time.monotonic() + timeout_s
    while waiting:
        got = transport.recv(max(0.0, deadline - time.monotonic()))
        if got is None:
            failed.update({d: f"did not load its clients within {timeout_s:.0f} s" for d in waiting})
            break
        device, msg = got
        if device not in waiting or msg.kind not in ("ready", "error"):
            continue
        if msg.kind == "error":
            failed[device] = f"could not load its clients: {short(msg.meta.get('reason'), 300)}"
        elif msg.meta.get("clients") != expected[device]:
            failed[device] = f"said ready for clients {short(msg.meta.get('clients'), 60)}, not the ones it was given"
        waiting.discard(device)
    return failed


class Dynamics:
    """The process side of arrivals and drift: newcomer device processes and shard swaps.
    Everything is undone when a method ends, so the next method replays the same story."""

    def __init__(
        self,
        transport: Transport,
        fleet: processes.DeviceFleet,
        partition: part.Partition,
        meta: dict,
        ctx: Context,
        cfg: dict,
        progress,
    ):
        self.transport, self.fleet, self.partition, self.meta = transport, fleet, partition, meta
        self.ctx, self.cfg, self.progress = ctx, cfg, progress
        self.newcomer_devices: list[str] = []
        self.applied: list[dict] = []
        self.method = 0

    def arrive(self, rnd: int, clients: np.ndarray) -> None:
        name = self.fleet.start(1, prefix=f"new-m{self.method}-r{rnd}")[0]
        self.fleet.wait(self.transport, self.cfg["devices"]["start_timeout_s"])
        assign_clients(
            self.transport, self.partition, [name], self.meta, self.cfg["devices"]["start_timeout_s"], clients
        )
        self.newcomer_devices.append(name)
        self.progress(f"round {rnd}: {len(clients)} newcomers joined on new device process {name}")

    def drift(self, rnd: int, changes: list[dict]) -> list[int]:
        """Send the changed shards; every changed client's device answers with a notice
        saying whether its own test found the data moved (devices/watch.py). Returns the
        clients it did for: what a device would report at once, unprompted. Only those
        notices are the method's traffic (billed as control); the answers that say "no"
        exist to make delivery deterministic and are not billed."""
        msgs = [m for change in changes for m in self._apply(change, live=True)]
        self.applied += changes
        last = {m.client: m for m in msgs}  # a client changed twice answers for its last change
        for m in msgs:
            if last[m.client] is not m:
                self.transport.send(self.transport.client_device[m.client], m)
        for m in last.values():
            m.meta["notice"] = 1
        t = self.transport
        billed, t.ledger = t.ledger, Ledger()
        try:
            replies = t.gather(last, "notice", self.cfg["devices"]["round_timeout_s"], own=True)
        finally:
            t.ledger = billed
        noticed = sorted(c for c, r in replies.items() if r.meta.get("flag") == 1)
        size = frame_bytes(encode(Message("notice", rnd, 0, meta={"flag": 1})))  # not the batch id's digits
        for c in noticed:
            billed.add(rnd, c, "up", "control", *size)
        self.progress(f"round {rnd}: data drift: {changes}; devices noticed a move for clients {noticed}")
        return noticed

    def _apply(self, change: dict, live: bool) -> list[Message]:
        """A move swaps two clients' shards; a label swap trades two labels (its own
        inverse). Returns the drift messages, in order; `live` False (an undo or a
        resume's replay) marks them as no change to notice."""
        p, c = self.partition, change["client"]
        if change["kind"] == "swap_labels":
            return [self._shard_message(c, live, {"label_swap": change["labels"]})]
        b = change["partner"]
        p.train[c], p.train[b] = p.train[b], p.train[c]
        p.test[c], p.test[b] = p.test[b], p.test[c]
        if p.shift is not None:  # the data moves with its transform
            p.shift.swap(c, b)
        self.ctx.truth[[c, b]] = self.ctx.truth[[b, c]]
        return [self._shard_message(c, live), self._shard_message(b, live)]

    def _shard_message(self, c: int, live: bool, extra: dict | None = None) -> Message:
        p = self.partition
        meta, tensors = {"flag": live, **(extra or {})}, {"train": p.train[c], "test": p.test[c]}
        if p.shift is not None:
            meta["shift"], tensors = p.shift.meta(), {**tensors, **p.shift.tensors([c])}
        return Message("drift", client=c, meta=meta, tensors=tensors)

    def _send(self, msgs: list[Message]) -> None:
        for m in msgs:
            self.transport.send(self.transport.client_device[m.client], m)

    def undo(self) -> None:
        for change in reversed(self.applied):
            self._send(self._apply(change, live=False))
        self.applied.clear()
        for name in self.newcomer_devices:
            self.transport.send(name, Message("shutdown"))
            self.fleet.retire(name)
            self.transport.forget(name)
        self.newcomer_devices.clear()
        self.method += 1


def wait_external(transport: Transport, local: list[str], n: int, timeout_s: float, progress) -> list[str]:
    """Devices started by hand (`flt device --connect ...`), possibly on other hosts."""
    if n == 0:
        return []
    progress(f"waiting for {n} external device(s): flt device --connect {transport.endpoint}")
    transport.wait_devices(len(local) + n, timeout_s)
    return sorted(d for d in transport.devices if d not in local)  # by name, not arrival


def run_scenario(cfg: dict, out: str | None = None, progress=print, resume: bool = False) -> Path:
    """Run `cfg` into a new run folder, or (`resume`) continue the killed run in folder
    `out`: finished methods are kept, the interrupted one continues after its last
    checkpointed round, on the folder's own partition."""
    data = cfg["data"]
    progress(f"data: {data['dataset']}" + (f" from {_abs(data['root'])}" if data["root"] else ""))
    train, test = load_data(cfg)
    if resume:
        if out is None:
            raise ValueError("run_scenario: resume=True needs out, the run folder to continue")
        run_dir = Path(out)
        public = np.load(run_dir / "public_indices.npy")
        partition = attach_shift(cfg, part.Partition.load(run_dir / "partition.npz"), train.num_classes)
    else:
        public = hold_out_public(cfg, len(train.y))
        partition = build_partition(cfg, train, test, public)
    # checked against the partition before any folder or process exists
    schedule = schedule_from(cfg, partition.cluster, train.num_classes)
    profiles = assign_profiles(cfg["population"]["profiles"], partition.n_clients, cfg["seed"])
    load_encoder_sources(cfg)
    if not resume:
        run_dir = make_run_dir(cfg, out)
        partition.save(run_dir / "partition.npz")
        np.save(run_dir / "public_indices.npy", public)
        record_shift(run_dir, cfg, partition, train)
    progress(f"run folder: {run_dir}")
    for note in partition.notes:
        progress(f"partition: {note}")
    init, model_spec = initial_weights(cfg, train)
    n_proc = cfg["devices"]["processes"]
    n_proc = min(os.cpu_count() or 1 if n_proc is None else n_proc, partition.n_clients)
    # the server's own tensor work is light; leave the cores to the device processes
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - n_proc * cfg["devices"]["threads"]))
    d = cfg["devices"]
    transport = Transport(
        d["bind"],
        gate_for(d["bind"], d["security"], d["keys"], d["external"]),
        max_inbound=init.numel() * init.element_size(),
    )  # devices upload one model at most
    fleet = make_fleet(d, transport.endpoint, run_dir / "logs", enroll=transport.gate.enroll)
    transport.alive = fleet.alive
    summary = (
        report.finished_methods(run_dir, cfg)
        if resume
        else {"scenario": cfg["name"], "methods": {}, "partition_notes": partition.notes}
    )
    try:
        fleet.start(n_proc)
        devices = fleet.wait(transport, cfg["devices"]["start_timeout_s"])
        devices += wait_external(
            transport, devices, cfg["devices"]["external"], cfg["devices"]["start_timeout_s"], progress
        )
        meta = assign_meta(cfg, model_spec)
        late = np.concatenate(list(schedule.arrivals.values())) if schedule.arrivals else np.zeros(0, np.int64)
        first = np.setdiff1d(np.arange(partition.n_clients), late)
        assign_clients(transport, partition, devices, meta, cfg["devices"]["start_timeout_s"], first)
        progress(
            f"{len(devices)} device processes host {len(first)} clients"
            + (f"; {len(late)} newcomers arrive later" if len(late) else "")
        )
        ctx = Context(
            init=init,
            n_clients=partition.n_clients,
            n_train=np.array([len(t) for t in partition.train]),
            device=aggregation_device(),
            seed=cfg["seed"],
            truth=partition.cluster.copy(),
            train=cfg["train"],
            public_images=image_source(cfg["data"], public),
        )
        fed = Federation(
            transport,
            cfg["train"],
            cfg["seed"],
            cfg["devices"]["round_timeout_s"],
            ctx.device,
            shard_sizes=lambda c: (len(partition.train[c]), len(partition.test[c])),
            model_size=init.numel(),
        )
        dynamics = Dynamics(transport, fleet, partition, meta, ctx, cfg, progress)
        for i, spec in enumerate(cfg["methods"]):
            if spec["label"] in summary["methods"]:
                progress(f"== {spec['label']} == finished before the interruption: kept")
                continue
            dynamics.method = i  # newcomer process names, as in an uninterrupted run
            population = make_population(cfg, ctx, schedule, profiles, dynamics)
            again = resume and (run_dir / spec["label"] / CHECKPOINT).exists()
            if resume and not again and i > 0:  # starts afresh after a method finished before
                fed.carry_over(checkpoint.load(run_dir / cfg["methods"][i - 1]["label"] / CHECKPOINT)["federation"])
            try:
                run_one(spec, ctx, fed, transport, population, cfg, run_dir, progress, summary, again)
            finally:
                dynamics.undo()
            report.write_summary(run_dir, summary)
        report.plot_convergence(run_dir, summary)
        progress(report.table(summary))
    finally:
        transport.close()
        fleet.stop()
        # what differs from one execution to the next, apart from the results
        summary["timing"] = {"run_dir": str(run_dir), "device_exit_codes": fleet.exit_codes()}
        summary["rejected"] = transport.rejections.summary()  # the whole run's, start-up included
        summary["security"] = transport.gate.report()
        report.write_summary(run_dir, summary)
    return run_dir


def make_population(cfg: dict, ctx: Context, schedule, profiles, dynamics: Dynamics) -> Population:
    pop = cfg["population"]
    return Population(
        ctx.n_clients,
        cfg["train"]["participation"],
        cfg["seed"],
        profiles=profiles,
        schedule=schedule,
        sampling=pop["sampling"],
        deadline_s=pop["deadline_s"],
        overcommit=pop["overcommit"],
        batch_size=cfg["train"]["batch_size"],
        arrive=dynamics.arrive,
        drift=dynamics.drift,
        realtime=pop["realtime"],
        n_train=ctx.n_train,
        epochs=cfg["train"]["local_epochs"],
    )


def run_one(
    spec: dict,
    ctx: Context,
    fed: Federation,
    transport: Transport,
    population: Population,
    cfg: dict,
    run_dir: Path,
    progress,
    summary: dict,
    resume: bool = False,
) -> None:
    """One method; its entry in `summary`, and summary.json, are rewritten after every round."""
    # one reset per device process: housekeeping, not the method's traffic (and billing it
    # would make the bytes depend on how many processes there are)
    transport.broadcast(Message("reset", tensors={"init": ctx.init.numpy()}))
    transport.ledger.reset()
    method_dir = run_dir / spec["label"]
    method_dir.mkdir(parents=True, exist_ok=True)
    strategy = STRATEGIES[spec["name"]](ctx, **spec["params"])
    progress(f"== {spec['label']} ==" + (" (resumed)" if resume else ""))

    def record(history: list[dict]) -> None:
        summary["methods"][spec["label"]] = report.method_summary(
            spec, history, strategy, transport, ctx.init.numel() * 4, cfg
        )
        report.write_summary(run_dir, summary)

    run_method(
        strategy,
        fed,
        population,
        cfg["train"]["rounds"],
        cfg["train"]["eval_every"],
        method_dir,
        progress,
        on_round=record,
        resume=resume,
    )


def _abs(root: str | None) -> str | None:
    return str(Path(root).expanduser().resolve()) if root else None
