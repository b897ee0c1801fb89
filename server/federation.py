"""The server's round loop and the calls a strategy may make on the population.

`Federation` turns strategy-level requests (train these clients from these models,
evaluate these models, embed with this encoder) into wire messages through the
transport, and turns replies back into tensors on the aggregation device.
`run_method` drives one method for T rounds and streams one JSON line per round. After
setup, after the last round and, paced (CheckpointPacer), after rounds in between, it
checkpoints everything the next round depends on (the
strategy's attributes, the population's state and clock, the byte ledger and what
devices hold per client), so a killed run resumes with exactly the records an
uninterrupted one writes. Wall-clock figures live in each record's `timing` object: the
rest of a record is the same, bytes included, on every rerun.

Every exchange a strategy starts (a round's training, FLT's FCR, a re-clustering) goes
through `Federation.exchange`: it sends, gathers, prices the exchange on the emulated
clock (the population's device profiles), counts its bytes by kind and reports it; the
reports of one-off exchanges become events in the round's record (set-up's in round 1's).

The emulator plugs its behaviour in through a `population` object (participation
sampling, device clock, arrivals, drift); the server never imports the emulator.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from flt.common.errors import FltError, short
from flt.common.files import append_line
from flt.common.interrupts import deferred_interrupt
from flt.common.wire import Message
from flt.reports.summary import read_metrics, split_timing
from flt.reports.terminal import Progress, step
from flt.reports.writer import write_artifacts
from flt.server import checkpoint
from flt.server.checkpoint import restore_vars
from flt.server.exchange import Call, Exchange, ExchangeClock, Reply
from flt.server.ops import EMBED, EVALUATE, SNAPSHOT, DeviceOp
from flt.server.replies import ShardSizes, state_check
from flt.server.strategies.base import Result, Strategy, Task
from flt.server.transport import Transport

log = logging.getLogger("flt.server")


class PopulationView(ExchangeClock, Protocol):
    """What the round loop asks of the population it runs on (emulator/population.py
    implements it): who is there, who is selected, what changed, how late devices answer."""

    def candidates(self, rnd: int) -> np.ndarray: ...

    def newcomers(self) -> np.ndarray: ...

    def drift_after(self, rnd: int) -> bool: ...

    def before_round(self, rnd: int) -> list[dict]: ...

    def select(self, rnd: int, candidates: np.ndarray) -> np.ndarray: ...

    def delays(self, rnd: int, tasks: dict) -> dict[int, float] | None: ...

    def timeout(self, default_s: float) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, upto: int) -> None: ...


class Federation:
    def __init__(
        self,
        transport: Transport,
        train_cfg: dict,
        seed: int,
        timeout_s: float,
        device: torch.device,
        shard_sizes: ShardSizes | None = None,
        model_size: int | None = None,
    ):
        self.transport, self.cfg, self.seed = transport, train_cfg, seed
        self.shard_sizes = shard_sizes  # replies' sample counts and totals are checked against it
        self.model_size = model_size  # a device-held model in a checkpoint snapshot must have it
        self.timeout_s, self.device = timeout_s, device
        self.method = ""
        self._present = np.zeros(0, dtype=np.int64)  # clients in the population now (`present`)
        self.clock: ExchangeClock | None = None  # the running method's population
        self.events: list[dict] = []  # one-off exchanges' reports, for the next record
        self.ops: dict[str, DeviceOp] = {}  # the running method's declared device ops (empty: any)

    @property
    def present(self) -> np.ndarray:
        """Clients in the population now, less those of devices lost since it was set (a
        device lost mid-round: its clients are asked nothing more, e.g. by `flt relate`'s
        retries or a re-clustering at the round's end)."""
        if not self.transport.lost_devices:
            return self._present
        return np.setdiff1d(self._present, self.transport.lost_clients())

    @present.setter
    def present(self, clients: np.ndarray) -> None:
        self._present = np.asarray(clients, dtype=np.int64)

    def _seed(self, rnd: int, salt: int = 0) -> int:
        return (self.seed * 7919 + rnd * 104_729 + salt) % (2**31)

    def declare(self, method: str, ops: tuple[DeviceOp, ...]) -> None:
        """The running method and the device ops it declared (its DEVICE_OPS): `run`
        refuses any other, naming the method and the op."""
        self.method, self.ops = method, {op.name: op for op in ops}

    def run(
        self,
        op: DeviceOp,
        rnd: int,
        calls: dict[int, Call],
        purpose: str | None = None,
        *,
        timeout_s: float | None = None,
        again: Collection[int] = (),
    ) -> Exchange[Reply]:
        """Run one device op for these clients (a method's own, e.g. FLT's `choose`),
        reported as an event named `purpose` (the op's name by default); the tasks of those
        in `again`, asked once more, are not billed."""
        msgs = {c: op.message(rnd, c, call.tensors, call.meta) for c, call in calls.items()}
        ex = self._exchange(purpose or op.name, rnd, msgs, [op], timeout_s=timeout_s, again=again)
        return ex.decoded(lambda m: Reply(m.tensors, m.meta))

    def _exchange(
        self,
        kind: str,
        rnd: int,
        msgs: dict[int, Message],
        ops: list[DeviceOp],
        *,
        timeout_s: float | None = None,
        clocked: bool = True,
        event: bool = True,
        strict: bool = False,
        again: Collection[int] = (),
    ) -> Exchange[Message]:
        """The one path of every exchange: send `msgs` (each the task of one of `ops`),
        gather each client's reply, check it (the op's check), price what each answering
        client did (its payload down and up, and the op's `work`) on the emulated clock,
        and report the bytes by kind that crossed the socket meanwhile. `event` queues
        the report for the round's record; `clocked` False is for the emulator's own
        measurements (evaluation), which are no part of the method. `again`: clients asked
        once more what they left unanswered; their tasks are not billed (a broken device
        must not cost the method traffic), their replies are."""
        undeclared = [op.name for op in ops if self.ops and self.ops.get(op.name) != op]
        if undeclared:
            raise ValueError(
                f"method {self.method!r} asks for device op {undeclared[0]!r}, which its DEVICE_OPS do not "
                f"declare ({', '.join(self.ops)})"
            )
        by_name = {op.name: op for op in ops}
        op_of = {c: by_name[_op_name(m, ops)] for c, m in msgs.items()}
        checks = {
            op.name: op.reply_check({c: m for c, m in msgs.items() if op_of[c] is op}, self.shard_sizes) for op in ops
        }

        def check(client: int, reply: Message) -> tuple[str, str] | None:
            op_check = checks[op_of[client].name]
            return op_check(client, reply) if op_check else None

        before = self.transport.ledger.totals()
        sizes = self.shard_sizes
        replies = self.transport.gather(
            msgs,
            {c: op.reply_kind for c, op in op_of.items()},
            timeout_s or self.timeout_s,
            check=check,
            movable=[c for c, op in op_of.items() if op.movable and not msgs[c].meta.get("resident")],
            cost=None if sizes is None else lambda c: float(sizes(c)[0]),
            strict=strict,
            again=again,
        )
        ids = np.array(sorted(replies), dtype=np.int64)
        down = np.array([_payload(msgs[c]) for c in ids.tolist()], dtype=np.float64)
        up = np.array([_payload(replies[c]) for c in ids.tolist()], dtype=np.float64)
        done = np.array([_work(op_of[c], msgs[c], replies[c]) for c in ids.tolist()], dtype=np.float64).reshape(-1, 2)
        kept, clock = (
            self.clock.price(kind, ids, down, up, done[:, 0], done[:, 1])
            if clocked and self.clock is not None
            else (ids, {})
        )
        report = {
            "kind": "exchange",
            "exchange": kind,
            "round": rnd,
            "clients": sorted(msgs),
            "replies": len(replies),
            "bytes": _bytes_between(before, self.transport.ledger.totals()),
            **clock,
        }
        if event:
            self.events.append(report)
        return Exchange(replies, [int(c) for c in kept], report)

    def take_events(self) -> list[dict]:
        """The reports queued since the last call (they go into this round's record)."""
        events, self.events = self.events, []
        return events

    def train(
        self,
        rnd: int,
        tasks: dict[int, Task],
        delays: dict[int, float] | None = None,
        timeout_s: float | None = None,
        purpose: str | None = None,
    ) -> Exchange[Result]:
        """Train the selected clients, each with its task's op (one round may mix ops);
        `delays` (real-time mode) makes each device wait that long before answering, and
        replies later than `timeout_s` are dropped. The round is the exchange's report;
        `kept` are the replies that beat the clock. `purpose`: training outside the round
        (FedGroup's pre-training), reported as an event of that name."""
        base = {
            "epochs": self.cfg["local_epochs"],
            "batch_size": self.cfg["batch_size"],
            "lr": self.cfg["lr"],
            "vectorize": self.cfg["vectorize"],
            "seed": self._seed(rnd),
        }
        if self.cfg.get("momentum"):  # absent at 0: plain SGD's task headers (and bytes) stay as they were
            base["momentum"] = self.cfg["momentum"]
        msgs = {}
        for c, t in tasks.items():
            tensors = {} if t.models is None else {"model": t.models.detach().cpu().numpy()}
            delay = {"delay_s": delays[c]} if delays else {}
            msgs[c] = t.op.message(rnd, c, tensors, {**base, **t.meta, **delay})
        ops = list({t.op.name: t.op for t in tasks.values()}.values())
        # real-time mode's deadline cuts stragglers whatever their devices are doing
        ex = self._exchange(
            purpose or "train", rnd, msgs, ops, timeout_s=timeout_s, event=purpose is not None, strict=bool(delays)
        )
        return ex.decoded(lambda r: Result(self._tensor(r, "model"), int(r.meta["n"]), r.meta))

    def _tensor(self, msg: Message, name: str) -> torch.Tensor | None:
        if name not in msg.tensors:
            return None
        return torch.from_numpy(msg.tensors[name]).to(self.device)  # its own writable copy (wire.receive)

    def evaluate(self, rnd: int, clients: np.ndarray, models: torch.Tensor | None, rows: np.ndarray) -> dict[int, dict]:
        """Evaluate client c with models[rows[i]] on its own test shard (on its device).
        The emulator's measurement, not the method's: its bytes count, its time does not."""
        host = None if models is None else models.detach().cpu().numpy()
        msgs = {}
        for c, r in zip(clients.tolist(), rows.tolist(), strict=True):
            tensors = {} if host is None else {"model": host[r : r + 1]}
            msgs[c] = EVALUATE.message(rnd, c, tensors, {"resident": host is None})
        ex = self._exchange("evaluate", rnd, msgs, [EVALUATE], clocked=False, event=False)
        return {c: m.meta for c, m in ex.results.items()}

    def embed(
        self,
        rnd: int,
        clients: np.ndarray,
        tensors: dict[str, np.ndarray],
        meta: dict,
        purpose: str = "fcr",
        again: Collection[int] = (),
    ) -> Exchange[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray] | None]]:
        """Send an encoder to each client (once per client, counted as 'encoder' bytes, but
        to those in `again`, asked once more) and collect its k x e centroids, their k
        shares of its samples and the same summary of each half of its data (None for a
        client with fewer than two samples); the exchange is priced and reported as
        `purpose`."""
        msgs = {
            int(c): EMBED.message(rnd, int(c), tensors, {**meta, "seed": self._seed(rnd, 1)})
            for c in np.asarray(clients).tolist()
        }
        ex = self._exchange(purpose, rnd, msgs, [EMBED], timeout_s=self.timeout_s * 4, again=again)
        return ex.decoded(lambda m: (m.tensors["centroids"].copy(), m.tensors["shares"].astype(np.float64), _halves(m)))

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self, rnd: int, references: bool = False) -> dict:
        """The transport's side of a checkpoint: bytes so far, the next batch id (it is in
        every header, so its digits count), lost devices, and what devices hold per client
        (with `references`, what their change tests compare with: data changes later)."""
        t = self.transport
        clients = self._device_state(rnd, references)
        batch = t.next_batch()
        return {
            "ledger": t.ledger,
            "batch": batch,
            "lost_devices": sorted(t.lost_devices),
            "clients": clients,
            "events": list(self.events),
        }

    def load_state_dict(self, state: dict, watch_encoder: Call | None = None) -> list[int]:
        """Put the transport's side back; returns the clients whose device state the
        checkpoint lacks (they resume with none: no device-held model, no change flag).
        `watch_encoder`: the encoder the devices' change tests embed with (FLT's)."""
        self.transport.lost_devices.update(state["lost_devices"])
        self._restore_device_state(state["clients"], watch_encoder)
        restore_vars(self.transport, {"ledger": state["ledger"]})
        self.events = list(state.get("events", []))  # set-up's, when killed before round 1
        self.transport.batches = itertools.count(state["batch"])
        return [int(c) for c in state["clients"].get("missing", [])]

    def carry_over(self, state: dict) -> None:
        """A method that starts afresh on resume knows the devices lost before it (`state`:
        the last checkpoint of the method before it)."""
        self.transport.lost_devices.update(state["lost_devices"])

    def _hosted(self) -> list[int]:
        lost = set(self.transport.lost_clients().tolist())
        return sorted(c for c in self.transport.client_device if c not in lost)

    def _device_state(self, rnd: int, references: bool = False) -> dict:
        """Ask every hosted client's device what it keeps for it (Local's model, the change
        flag). Checkpoint traffic is the emulator's, not the method's: it is not billed.
        A client whose device does not answer, answers late or answers wrong is checked
        like any reply and listed as `missing`: the checkpoint is written without its
        state (a broken or hostile device must not stop the run), and resume says so."""
        t, clients = self.transport, self._hosted()
        with t.unbilled():
            ask = {"references": 1} if references else {}  # an embedding per client: only when it can matter
            msgs = {c: SNAPSHOT.message(rnd, c, {}, ask) for c in clients}
            replies = t.gather(msgs, "state", self.timeout_s, check=state_check(self.model_size), own=True)
        missing = sorted(set(clients) - set(replies) - set(t.lost_clients().tolist()))
        if missing:
            log.error(
                "checkpoint after round %d: no valid device state from clients %s on %s; written without it",
                rnd,
                missing[:20],
                sorted({t.client_device[c] for c in missing}),
            )
        return {
            "models": {c: r.tensors["model"].copy() for c, r in replies.items() if "model" in r.tensors},
            "references": {c: r.tensors["reference"].copy() for c, r in replies.items() if "reference" in r.tensors},
            "flags": sorted(c for c, r in replies.items() if r.meta.get("flag")),
            "watched": sorted(c for c, r in replies.items() if r.meta.get("watched")),
            "missing": missing,
        }

    def _restore_device_state(self, state: dict, watch_encoder: Call | None = None) -> None:
        """Every hosted client gets its checkpointed state back (a flag that replayed drift
        raised but a later re-embedding cleared is cleared again); not billed either. A
        device whose clients' changes are tested gets the encoder once, with the first."""
        t, flags, watched = self.transport, set(state["flags"]), set(state.get("watched", ()))
        references = state.get("references", {})  # none in a checkpoint from before they were kept
        encoder_sent: set[str] = set()
        with t.unbilled():
            for c in self._hosted():
                device, model, reference = t.client_device[c], state["models"].get(c), references.get(c)
                meta, tensors = {"flag": int(c in flags), "watched": int(c in watched)}, {}
                if model is not None:
                    tensors["model"] = model
                if reference is not None and watch_encoder is not None:
                    tensors["reference"] = reference
                    if device not in encoder_sent:
                        encoder_sent.add(device)
                        meta["encoder"] = watch_encoder.meta["format"]
                        tensors |= watch_encoder.tensors
                t.deliver(device, Message("state", client=c, meta=meta, tensors=tensors))


def accuracy_stats(metrics: dict[int, dict], newcomers: Collection[int] = ()) -> dict:
    """Mean per-client test accuracy (%), its standard error, variance across clients.

    A client with no test sample has no accuracy: it is left out of the mean and counted
    (`clients_without_test`), never scored 0 %. With newcomers in the population, the
    incumbents' and the newcomers' means are also given apart, so a change can be
    judged over the same clients before and after it."""
    tested = sorted(c for c, m in metrics.items() if m["total"] > 0)
    out: dict[str, float] = {"clients_without_test": len(metrics) - len(tested)}
    if not tested:
        return {"acc_mean": float("nan"), "acc_se": float("nan"), "acc_var": float("nan"), "n_eval": 0, **out}
    acc = 100.0 * np.array([metrics[c]["correct"] / metrics[c]["total"] for c in tested])
    se = acc.std(ddof=1) / np.sqrt(len(acc)) if len(acc) > 1 else 0.0
    out |= {
        "acc_mean": float(acc.mean()),
        "acc_se": float(se),
        "acc_var": float(acc.var()),
        "acc_min": float(acc.min()),
        "n_eval": int(len(acc)),
    }
    new = np.isin(tested, np.asarray(newcomers, dtype=np.int64))
    if new.any() and not new.all():
        out |= {"acc_incumbents": float(acc[~new].mean()), "acc_newcomers": float(acc[new].mean())}
    return out


def per_client_scores(metrics: dict[int, dict]) -> dict[str, list[int]]:
    """Each evaluated client's correct and total test predictions, in client order: the
    record keeps them so fairness can be read per client or per planted group later
    (`flt report` writes groups.csv), not only as the mean and variance."""
    clients = sorted(metrics)
    return {
        "client": clients,
        "correct": [int(metrics[c]["correct"]) for c in clients],
        "total": [int(metrics[c]["total"]) for c in clients],
    }


def run_method(
    strategy: Strategy,
    fed: Federation,
    population: PopulationView,
    rounds: int,
    eval_every: int,
    out_dir: Path,
    progress: Progress = print,
    on_round: Callable[[list[dict]], None] | None = None,
    resume: bool = False,
    before_writes: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Setup, then T rounds of select / train / aggregate / evaluate. Each round's record
    is appended to out_dir/metrics.jsonl as soon as it exists, the state is checkpointed
    (out_dir/CHECKPOINT, after setup as round 0, then as CheckpointPacer allows, and after
    the last round) and `on_round(history)` is called. `resume` continues after the
    checkpoint's round instead of starting over. `before_writes` runs before each round
    writes anything (the run's check that its folder is still there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    transport = fed.transport
    fed.declare(strategy.name, strategy.DEVICE_OPS)
    fed.clock = population  # the population prices every exchange
    tic, pacer = time.perf_counter(), CheckpointPacer()
    if resume:
        done, history, setup_s = resume_method(out_dir, strategy, fed, population, progress)
        # the wall clock goes on from the checkpoint's round: the rounds redone and the time
        # between the kill and the resume are not counted, the resume's own set-up is
        tic -= history[-1].get("timing", {}).get("wall_s", 0.0) if history else setup_s
    else:
        # devices lost at start-up (they could not load their clients) take no part
        fed.present, fed.events = np.setdiff1d(population.candidates(0), transport.lost_clients()), []
        strategy.setup(fed)
        write_artifacts(out_dir, strategy.take_artifacts())
        _print_notes(progress, strategy)
        done, history, setup_s = 0, [], time.perf_counter() - tic
        (out_dir / "metrics.jsonl").write_text("")
        pacer.save(save_checkpoint, out_dir, 0, setup_s, strategy, fed, population)
    metrics = out_dir / "metrics.jsonl"  # a record a round, appended (opened each time: see append_line)
    # records on_round has seen: a kill can fall between the two. 0 on a resume too: the
    # resumed summary keeps only the methods that finished (reports/summary.py)
    summarized = 0
    try:
        for rnd in range(done + 1, rounds + 1):
            transport.require_hosts(rnd - 1)
            r_tic = time.perf_counter()
            events = population.before_round(rnd)  # drift applied, newcomers connected
            candidates = np.setdiff1d(population.candidates(rnd), transport.lost_clients())
            fed.present = candidates  # only the server loop sets who is present
            for event in events:
                if event["kind"] == "arrival":  # the strategy places its newcomers (FLT: embed, join)
                    event |= strategy.on_arrival(rnd, np.asarray(event["clients"], dtype=np.int64), fed) or {}
                elif event.get("noticed"):  # devices that found their data moved said so at once
                    strategy.on_notice(rnd, np.asarray(event["noticed"], dtype=np.int64))
            selected = population.select(rnd, candidates)
            tasks = strategy.train_tasks(rnd, selected)
            trained = fed.train(rnd, tasks, population.delays(rnd, tasks), population.timeout(fed.timeout_s))
            strategy.observe(rnd, trained.results)  # late replies too: what they say still counts
            results = trained.counted()
            strategy.aggregate(rnd, results)
            events += strategy.maintain(rnd, fed)
            events += fed.take_events()  # set-up's (round 1), an arrival's, a re-clustering's
            before_writes()
            write_artifacts(out_dir, strategy.take_artifacts())  # a re-clustering's adjacency, ...
            record = {
                "method": strategy.name,
                "round": rnd,
                "selected": int(len(selected)),
                "returned": int(len(results)),
                "events": events,
                **_round_clock(trained.report, events),
            }
            timing = {"train_s": time.perf_counter() - r_tic}  # selection, training, aggregation
            if rnd % eval_every == 0 or rnd == rounds:
                e_tic = time.perf_counter()
                present = np.setdiff1d(population.candidates(rnd), transport.lost_clients())
                models, rows = strategy.eval_models(present)
                newcomers = population.newcomers()
                scores = fed.evaluate(rnd, present, models, rows)
                record.update(accuracy_stats(scores, newcomers), per_client=per_client_scores(scores))
                timing["eval_s"] = time.perf_counter() - e_tic
            timing.update(wall_s=time.perf_counter() - tic, setup_s=setup_s)
            record["bytes"] = _bytes_so_far(transport)
            record, extra = split_timing(record)  # e.g. a re-clustering event's seconds
            record["timing"] = {**timing, **(extra or {})}
            with deferred_interrupt():  # on disk and in the history, or neither
                append_line(metrics, json.dumps(record))
                history.append(record)
            if pacer.due(final=rnd == rounds):
                pacer.save(save_checkpoint, out_dir, rnd, setup_s, strategy, fed, population)
            if on_round:
                on_round(history)
                summarized = len(history)
            # a bar on a terminal, a line every few rounds elsewhere; arrivals, drift and
            # re-clustering always get their line
            step(progress, rnd, rounds, _line(record, rounds), "round", force=bool(events))
            _print_notes(progress, strategy)  # a re-clustering's clusters
        if on_round and summarized < len(history):  # killed after the last round's checkpoint, before on_round
            on_round(history)
    except KeyboardInterrupt:
        # the last record is on disk; let the summary say so too (not after the last
        # round: there the summary's count marks the method finished, and its last
        # checkpoint may not be written)
        if on_round and summarized < len(history) < rounds:
            with deferred_interrupt():
                on_round(history)
        raise
    return history


CHECKPOINT = "checkpoint.npz"  # in each method's folder: the state after its last checkpointed round


class CheckpointPacer:
    """When to checkpoint. A checkpoint costs in proportion to the state: Local keeps a
    model per client, 2.8 GB for the LEAF CNN on 105 writers, which took longer to gather
    and write than a round took to train. So a round is checkpointed only once the time
    since the last checkpoint is `1 / share` times what that one cost (every round while
    checkpoints are cheap), and always after the last round. Checkpoints then take about
    `share` of the run, and a kill loses at most that much work: resume drops the records
    after the checkpoint and runs those rounds again, to the same results."""

    def __init__(self, share: float = 0.1, clock=time.perf_counter):
        self.share, self.clock = share, clock
        self.cost, self.since = 0.0, clock()

    def due(self, final: bool = False) -> bool:
        return final or (self.clock() - self.since) * self.share >= self.cost

    def save(self, write: Callable[..., None], *args: object) -> None:
        tic = self.clock()
        write(*args)
        self.since = self.clock()
        self.cost = self.since - tic


def save_checkpoint(
    out_dir: Path, rnd: int, setup_s: float, strategy: Strategy, fed: Federation, population: PopulationView
) -> None:
    checkpoint.save(
        out_dir / CHECKPOINT,
        {
            "round": rnd,
            "setup_s": setup_s,
            "strategy": strategy.state_dict(),
            "population": population.state_dict(),
            "federation": fed.state_dict(rnd, references=population.drift_after(rnd)),
        },
    )


def resume_method(
    out_dir: Path, strategy: Strategy, fed: Federation, population: PopulationView, progress: Progress = print
) -> tuple[int, list, float]:
    """Put everything back as it was after the checkpoint's round: arrivals and drift
    replayed on the processes, device-held state, the ledger, the strategy. A record
    written after the checkpoint (killed in between) is dropped: that round runs again."""
    path = out_dir / CHECKPOINT
    state = checkpoint.load(path, fed.device)
    try:  # the file parsed, but its values come from disk: one that does not fit names the file
        done = state["round"]
        if not isinstance(done, int) or isinstance(done, bool) or done < 0:
            raise ValueError(f"round: expected a round number, found {short(done, 40)}")
        population.load_state_dict(state["population"], upto=done)
        strategy.load_state_dict(state["strategy"])
        lacking = fed.load_state_dict(state["federation"], strategy.watch_encoder())
    except FltError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise checkpoint.DamagedCheckpoint(path, (str(exc) or type(exc).__name__)[:200]) from None
    if lost := state["federation"]["lost_devices"]:
        gone = fed.transport.lost_clients().tolist()
        progress(
            f"resume: device(s) {lost} were lost by the checkpoint after round {done}; {len(gone)} clients stay out"
        )
    if lacking:
        progress(
            f"resume: the checkpoint after round {done} lacks the device state of {len(lacking)} client(s) "
            f"{lacking[:20]} (their device did not report it); they resume with none: no device-held "
            "model (Local starts them again from the initial weights), no change flag"
        )
    metrics = out_dir / "metrics.jsonl"
    records = first_records(out_dir, done)
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))  # as written: json.dumps of each
    tmp.replace(metrics)
    log.info("resuming %s after round %d", strategy.name, done)
    return done, records, state["setup_s"]


def first_records(out_dir: Path, done: int) -> list[dict]:
    """The first `done` round records of a method's metrics.jsonl (the ones its checkpoint
    follows; a torn last line is dropped as `flt report` drops it), or an error that says
    what to delete when they are missing or damaged."""
    try:
        records = read_metrics(out_dir.parent, out_dir.name)[:done]
    except (OSError, ValueError, FltError):  # unreadable, not UTF-8, or a damaged line before the last
        records = []
    if len(records) < done or not all(isinstance(r, dict) for r in records):
        raise FltError(
            f"{out_dir / 'metrics.jsonl'}: the records of rounds 1-{done} are cut short or damaged, but the "
            f"checkpoint is after round {done}; delete the folder {out_dir} to run that method again from round 0"
        )
    return records


def _payload(msg: Message) -> int:
    return sum(t.nbytes for t in msg.tensors.values())


def _op_name(msg: Message, ops: list[DeviceOp]) -> str:
    """The op a task message is for: its own kind's (a built-in op), else its meta "op"."""
    return next((op.name for op in ops if op.task_kind == msg.kind != "task"), msg.meta.get("op", ""))


def _work(op: DeviceOp, sent: Message, reply: Message) -> tuple[float, float]:
    """What the clock prices for one client: the op's work, nothing for an error reply."""
    return op.work(sent, reply) if op.work and reply.kind == op.reply_kind else (0.0, 0.0)


def _bytes_between(before: dict, after: dict) -> dict:
    """Ledger totals' growth, payload and overhead, by direction and kind (kinds that grew)."""
    out: dict[str, dict[str, int]] = {}
    for d, kinds in after.items():
        for k, v in kinds.items():
            grown = v["payload"] + v["overhead"] - before[d][k]["payload"] - before[d][k]["overhead"]
            if grown:
                out.setdefault(d, {})[k] = grown
    return out


def _round_clock(round_report: dict, events: list[dict]) -> dict:
    """The record's clock: the round's duration and, as `emulated_s`, the clock after the
    round's last priced exchange (a re-clustering after aggregation included)."""
    if "duration_s" not in round_report:
        return {}
    clocks = [e["emulated_s"] for e in events if e.get("kind") == "exchange" and "emulated_s" in e]
    return {
        "round_s": round_report["duration_s"],
        "emulated_s": max([round_report["emulated_s"], *clocks]),
        "stragglers": round_report["stragglers"],
        "dropouts": round_report["dropouts"],
    }


def _bytes_so_far(transport: Transport) -> dict:
    t = transport.ledger.totals()
    return {d: {k: v["payload"] + v["overhead"] for k, v in t[d].items()} for d in t}


def _print_notes(progress: Progress, strategy: Strategy) -> None:
    for line in strategy.take_notes():
        progress(f"[{strategy.name}] {line}")


def _line(r: dict, rounds: int) -> str:
    up = sum(r["bytes"]["up"].values()) / 1e6
    down = sum(r["bytes"]["down"].values()) / 1e6
    acc = f"acc {r['acc_mean']:6.2f} ± {r['acc_se']:4.2f}" if "acc_mean" in r else " " * 18
    return (
        f"[{r['method']}] round {r['round']:>3}/{rounds}  {acc}  "
        f"up {up:8.2f} MB  down {down:8.2f} MB  train {r['timing']['train_s']:.2f} s  "
        f"({r['returned']}/{r['selected']} returned)"
    )


def _halves(reply: Message) -> dict[str, np.ndarray] | None:
    """A centroids reply's two half summaries (checked: server/replies.py), split apart."""
    if "halves" not in reply.tensors:
        return None
    rows, shares, k = reply.tensors["halves"], reply.tensors["half_shares"].astype(np.float64), reply.meta["half_k"]
    return {"a": rows[:k].copy(), "a_shares": shares[:k], "b": rows[k:].copy(), "b_shares": shares[k:]}
