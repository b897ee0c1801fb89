"""`flt run`: one scenario, end to end.

Builds the partition once (saved in the run folder), starts the server socket and the
device processes, runs every method on the same partition, initial weights and
participation draws, and writes the results as they come: config.yaml, partition.npz,
<method>/metrics.jsonl, summary.json, convergence.png, and the server's warnings in
run.log.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from flt.common.files import LOCK_NAME, folder_lock, make_folder, require_run_folder
from flt.common.interrupts import deferred_interrupt
from flt.common.schema import ConfigError
from flt.common.wire import Message, encode, frame_bytes
from flt.emulator import processes
from flt.emulator.config import dump, load_encoder_sources
from flt.emulator.population import Population, Schedule, assign_profiles, schedule_from
from flt.emulator.profiles import Profiles
from flt.emulator.run_log import run_log
from flt.emulator.session import Session, assign_clients, check_device_ops, check_local_accelerator, data_root
from flt.models.flat import flatten
from flt.models.nets import build_model
from flt.reports import summary as report
from flt.reports.terminal import Progress
from flt.scenarios import partition as part
from flt.scenarios import shift
from flt.scenarios.datasets import Dataset, load_shared
from flt.server import checkpoint
from flt.server.federation import CHECKPOINT, Federation, run_method
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context
from flt.server.transport import Transport

RUN_LOG = "run.log"  # emulator/run_log.py


def make_run_dir(cfg: dict, out: str | None, hold: ExitStack) -> Path:
    """The run folder, with the resolved config and the command in it, locked until `hold`
    closes. A folder that holds another run's results, or that a live run is writing, is
    refused: writing over its config and summary would lose them and mix its method
    folders with this run's."""
    if out:
        run_dir = Path(out)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg["output"]) / f"{cfg['name']}-{stamp}"
        taken = 1
        while run_dir.exists():  # two runs started in the same second
            taken += 1
            run_dir = Path(cfg["output"]) / f"{cfg['name']}-{stamp}-{taken}"
    make_folder(run_dir, "--out" if out else "output")
    # a live run's folder is refused first (it may hold a summary.json already), then a finished one's
    hold.enter_context(folder_lock(run_dir, "--out" if out else "output", check=lambda: refuse_finished(run_dir)))
    (run_dir / "config.yaml").write_text(dump(cfg))
    (run_dir / "command.txt").write_text(report.command_line() + "\n")  # for `flt report`
    return run_dir


def refuse_finished(run_dir: Path) -> None:
    if (run_dir / "summary.json").is_file():
        raise ConfigError(
            f"--out: {run_dir} already holds a run's results (summary.json); choose another folder, continue "
            f"that run with `flt run --resume {run_dir}`, or delete it"
        )


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


def load_public(path: Path) -> np.ndarray:
    """A run folder's public indices (public_indices.npy); a damaged file names itself."""
    try:
        public = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        raise ConfigError(f"{path}: not a readable index file (damaged, or not written by flt)") from None
    if public.ndim != 1 or public.dtype.kind not in "iu":
        raise ConfigError(f"{path}: expected a 1-D array of indices, got {public.dtype} {public.shape}")
    return public


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
    if p["max_per_class"] is not None and p["kind"] != "writers":  # with writers: refused when the scenario resolves
        cap_rng = np.random.default_rng([cfg["seed"], 0xCA9])
        public = np.union1d(public, part.over_class_cap(train.y, p["max_per_class"], cap_rng, exclude=public))
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


def cap_batch(train: dict, partition: part.Partition) -> str | None:
    """A batch larger than every client's shard is that shard: cut `batch_size` to the
    largest shard (the same SGD: each client's one batch an epoch holds all its samples).
    Devices pad every client's batches to the batch size, so batches of 100,000 on shards
    of 50 cost 2,000 times the work, and emulated time billed as many samples. The same cut
    for every client keeps a client's result independent of its cohort. Returns a note."""
    largest = max(len(t) for t in partition.train)
    if train["batch_size"] <= largest:
        return None
    asked, train["batch_size"] = train["batch_size"], largest
    return f"train.batch_size {asked} is larger than every client's shard: batches of {largest}, the largest shard"


def reset_message(ctx: Context) -> Message:
    """What a device process is told when a method starts (or when it joins one): forget
    per-client state, and the run's initial weights, where a device-held model begins."""
    return Message("reset", tensors={"init": ctx.init.numpy()})


def initial_weights(cfg: dict, train: Dataset) -> tuple[torch.Tensor, dict]:
    """Seeded initial model: the same starting point for every method of the run."""
    torch.manual_seed(cfg["seed"])
    spec = {"name": cfg["model"], "in_shape": list(train.x.shape[1:]), "num_classes": train.num_classes}
    if cfg["train"]["inputs"] != "unit":  # absent by default: the assign message stays as it was
        spec["inputs"] = cfg["train"]["inputs"]
    model = build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"], spec.get("inputs", "unit"))
    return flatten(model), spec


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
        with self.transport.expecting("hello"):
            name = self.fleet.start(1, prefix=f"new-m{self.method}-r{rnd}")[0]
            self.fleet.wait(self.transport, self.cfg["devices"]["start_timeout_s"])
        assign_clients(
            self.transport, self.partition, [name], self.meta, self.cfg["devices"]["start_timeout_s"], clients
        )
        # the reset every device got when the method started: its initial weights are where a
        # model kept on the device (Local's) begins; housekeeping, so not the method's bytes
        with self.transport.unbilled():
            self.transport.deliver(name, reset_message(self.ctx))
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
        self._send([m for m in msgs if last[m.client] is not m])
        for m in last.values():
            m.meta["notice"] = 1
        t = self.transport
        with t.unbilled() as billed:
            replies = t.gather(last, "notice", self.cfg["devices"]["round_timeout_s"], own=True)
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
        """To each client's host; a host lost mid-run is skipped (its clients train no more)."""
        for m in msgs:
            self.transport.deliver(self.transport.client_device[m.client], m)

    def undo(self) -> None:
        for change in reversed(self.applied):
            self._send(self._apply(change, live=False))
        self.applied.clear()
        for name in self.newcomer_devices:
            self.transport.deliver(name, Message("shutdown"))
            self.fleet.retire(name)
            self.transport.forget(name)
        self.newcomer_devices.clear()
        self.method += 1


def carry_over(fed: Federation, previous: Path, progress: Progress) -> None:
    """A method that starts afresh on resume knows the devices lost before it, from the
    method before it. Without that method's checkpoint (its folder deleted to run it again,
    or damaged) it starts as in a fresh run, where only those devices differ, so it says so
    and goes on."""
    try:
        fed.carry_over(checkpoint.load(previous)["federation"])
    except checkpoint.DamagedCheckpoint as exc:
        progress(
            f"resume: cannot read {previous} ({exc.reason}); the next method starts without the lost "
            "devices of the one before it"
        )


def run_scenario(cfg: dict, out: str | None = None, progress: Progress = print, resume: bool = False) -> Path:
    """Run `cfg` into a new run folder, or (`resume`) continue the killed run in folder
    `out`: finished methods are kept, the interrupted one continues after its last
    checkpointed round, on the folder's own partition. The folder stays locked until the
    run ends (common/files.py folder_lock)."""
    ready: list[Path] = [Path(out)] if resume and out else []  # a folder `--resume` can continue
    with ExitStack() as hold:
        try:
            return _run_scenario(cfg, out, progress, resume, hold, ready)
        except (KeyboardInterrupt, OSError, MemoryError, RuntimeError) as stop:  # torch's OOM: a RuntimeError
            # a stop, a full disk, no memory left: the command names the folder to resume, or
            # says there is none
            stop.run_dir = ready[0] if ready else None  # type: ignore[union-attr]
            raise


def _run_scenario(
    cfg: dict, out: str | None, progress: Progress, resume: bool, hold: ExitStack, ready: list[Path]
) -> Path:
    processes.prepare_zygote(cfg["devices"])  # devices need it soon: start it before the data loads
    if resume:  # after the zygote, which must not inherit the lock; before the data: refused at once
        if out is None:
            raise ValueError("run_scenario: resume=True needs out, the run folder to continue")
        run_dir = Path(out)
        hold.enter_context(folder_lock(run_dir, "--resume"))
        progress = hold.enter_context(run_log(run_dir / RUN_LOG, report.command_line(), progress))
    data = cfg["data"]
    said = f"data: {data['dataset']}" + (f" from {data_root(data['root'])}" if data["root"] else "")
    progress(said)
    train, test = load_data(cfg)
    if resume:
        public = load_public(run_dir / "public_indices.npy")
        partition = attach_shift(cfg, part.Partition.load(run_dir / "partition.npz"), train.num_classes)
    else:
        public = hold_out_public(cfg, len(train.y))
        partition = build_partition(cfg, train, test, public)
    # checked against the partition before any folder or process exists
    schedule = schedule_from(cfg, partition.cluster, train.num_classes)
    profiles = assign_profiles(cfg["population"]["profiles"], partition.n_clients, cfg["seed"])
    load_encoder_sources(cfg)
    check_device_ops(cfg)
    check_local_accelerator(cfg["devices"])
    batch_note = cap_batch(cfg["train"], partition)
    with torch.random.fork_rng(devices=[]):  # a dry build: the model takes these images
        initial_weights(cfg, train)
    if not resume:
        run_dir = make_run_dir(cfg, out, hold)
        progress = hold.enter_context(run_log(run_dir / RUN_LOG, report.command_line(), progress, said))
        partition.save(run_dir / "partition.npz")
        np.save(run_dir / "public_indices.npy", public)
        record_shift(run_dir, cfg, partition, train)
        ready.append(run_dir)
    progress(f"run folder: {run_dir}")
    for note in partition.notes:
        progress(f"partition: {note}")
    if batch_note:
        progress(batch_note)
    init, model_spec = initial_weights(cfg, train)
    session = Session(cfg, run_dir, init, model_spec, partition.n_clients)
    transport, fleet = session.transport, session.fleet
    summary = report.finished_methods(run_dir, cfg) if resume else {"scenario": cfg["name"], "methods": {}}
    # from partition.npz on a resume too: a run stopped before its first summary has none
    summary["partition_notes"] = partition.notes
    try:
        late = np.concatenate(list(schedule.arrivals.values())) if schedule.arrivals else np.zeros(0, np.int64)
        first = np.setdiff1d(np.arange(partition.n_clients), late)
        devices = session.start(partition, model_spec, first, progress)
        progress(
            f"{len(devices)} device processes host {len(first)} clients"
            + (f"; {len(late)} newcomers arrive later" if len(late) else "")
        )
        ctx, fed = session.federation(partition, init, public)
        dynamics = Dynamics(transport, fleet, partition, session.meta, ctx, cfg, progress)
        for i, spec in enumerate(cfg["methods"]):
            if spec["label"] in summary["methods"]:
                progress(f"== {spec['label']} == finished before the interruption: kept")
                continue
            dynamics.method = i  # newcomer process names, as in an uninterrupted run
            population = make_population(cfg, ctx, schedule, profiles, dynamics)
            again = resume and (run_dir / spec["label"] / CHECKPOINT).exists()
            if not again:  # a checkpoint's own ids otherwise (Federation.load_state_dict)
                transport.start_method(i)
            if resume and not again and i > 0:  # starts afresh after a method finished before
                carry_over(fed, run_dir / cfg["methods"][i - 1]["label"] / CHECKPOINT, progress)
            try:
                run_one(spec, ctx, fed, transport, population, cfg, run_dir, progress, summary, again)
            finally:
                dynamics.undo()
            report.write_summary(run_dir, summary)
        report.plot_convergence(run_dir, summary)
        progress(report.table(summary))
    finally:
        # a second Ctrl-C (an impatient user) must not cut short the devices' shutdown and the
        # summary's last write: held back until both are done (seconds at most, bounded by
        # the drain, the context's term and the processes' grace; SIGKILL ends it at once)
        with deferred_interrupt():
            session.close()
            # what differs from one execution to the next, apart from the results
            summary["timing"] = {
                "run_dir": str(run_dir),
                "device_exit_codes": fleet.exit_codes(),
                "tasks_off_host": transport.moved,  # server/routing.py: tasks run where their client is not hosted
                "tasks_resent": transport.resent,  # sent again because their device was late: not billed
            }
            summary["rejected"] = transport.rejections.summary()  # the whole run's, start-up included
            summary["security"] = transport.gate.report()
            if (run_dir / LOCK_NAME).is_file():  # not into a folder deleted mid-run (require_run_folder)
                report.write_summary(run_dir, summary)
    if summary["rejected"]["rejected_messages"]:
        progress(rejected_note(summary["rejected"]))
    return run_dir


def rejected_note(rejected: dict) -> str:
    """One line under the table, so rejected replies (a diverged client's NaN update, a
    hostile peer) are not noticed only in the log above it."""
    reasons = ", ".join(f"{r} {v['messages']}" for r, v in rejected["rejected_reasons"].items())
    return (
        f"rejected {rejected['rejected_messages']} messages ({reasons}): left out of every "
        "result and of the traffic; each reason's first messages are in the log above, "
        "the counts in summary.json 'rejected'"
    )


def make_population(
    cfg: dict, ctx: Context, schedule: Schedule, profiles: Profiles | None, dynamics: Dynamics
) -> Population:
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
    progress: Progress,
    summary: dict,
    resume: bool = False,
) -> None:
    """One method; its entry in `summary`, and summary.json, are rewritten after every round."""
    # one reset per device process: housekeeping, not the method's traffic (and billing it
    # would make the bytes depend on how many processes there are)
    transport.broadcast(reset_message(ctx))
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
        before_writes=lambda: require_run_folder(run_dir),
    )
