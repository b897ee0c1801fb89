"""`flt relate SCENARIO.yaml`: FCR alone, no training rounds.

It does what a run does up to round 0: partitions, starts the server socket and the
device processes, pretrains or loads the encoder, sends it to every client over
ZeroMQ, collects the clients' centroids, then clusters them. It writes the FCR
artifacts (relate.json, fcr.npz, adjacency.png, dendrogram.png, centroids.png, umap.png) and
prints the clusters found, their sizes, ARI/NMI against the planted clusters, bytes and
seconds: what a user runs to see whether their clients are related.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from flt.common.interrupts import deferred_interrupt
from flt.common.schema import ConfigError
from flt.emulator.run import (
    build_partition,
    hold_out_public,
    initial_weights,
    load_data,
    make_run_dir,
    record_shift,
)
from flt.emulator.session import Session, check_device_ops, check_local_accelerator
from flt.reports import summary as report
from flt.reports.fcr_text import describe_clustering
from flt.reports.figures import scatter
from flt.reports.terminal import Progress
from flt.reports.writer import write_artifacts
from flt.server import fcr
from flt.server.strategies import STRATEGIES
from flt.server.strategies.base import Context
from flt.server.strategies.flt import EMBED_RETRIES, FLT
from flt.server.transport import Transport


def pick_method(cfg: dict, label: str | None) -> dict:
    """The scenario's method entry to relate with: the one labelled `label`, else the first
    that runs FCR (FLT or PCA+kM+HC), else FLT with its defaults."""
    fcr_methods = [m for m in cfg["methods"] if issubclass(STRATEGIES[m["name"]], FLT)]
    if label is None:
        if fcr_methods:
            return fcr_methods[0]
        return {"name": "flt", "label": "flt", "params": _defaults(FLT)}
    for m in fcr_methods:
        if label in (m["label"], m["name"]):
            return m
    known = ", ".join(m["label"] for m in fcr_methods) or "none"
    raise ConfigError(f"--method: {label!r} is not an FCR method of this scenario (its FCR methods: {known})")


def _defaults(cls) -> dict:
    from flt.common.schema import validate

    return validate({}, cls.PARAMS, cls.name)


def relate_scenario(
    cfg: dict, out: str | None = None, method: str | None = None, progress: Progress = print, umap: bool = True
) -> tuple[Path, dict]:
    """Run FCR once over every client of the scenario; returns the run folder and the report."""
    spec = pick_method(cfg, method)
    check_local_accelerator(cfg["devices"])
    with ExitStack() as hold:  # the folder stays locked until its report is written
        return _relate(cfg, spec, make_run_dir(cfg, out, hold), progress, umap)


def _relate(cfg: dict, spec: dict, run_dir: Path, progress: Progress, umap: bool) -> tuple[Path, dict]:
    progress(f"run folder: {run_dir}")
    train, test = load_data(cfg)
    public = hold_out_public(cfg, len(train.y))
    partition = build_partition(cfg, train, test, public)
    partition.save(run_dir / "partition.npz")
    record_shift(run_dir, cfg, partition, train)
    init, model_spec = initial_weights(cfg, train)
    m = partition.n_clients
    check_device_ops({**cfg, "methods": [spec]})
    # the run's own set-up (emulator/session.py), with this machine's devices only
    session = Session(cfg, run_dir, init, model_spec, m, external=False, crash=False)
    transport = session.transport
    tic = time.perf_counter()
    try:
        devices = session.start(partition, model_spec, np.arange(m), progress)
        ctx, fed = session.federation(partition, init, public)
        method_dir = run_dir / spec["label"]
        strategy = STRATEGIES[spec["name"]](ctx, **spec["params"])
        assert isinstance(strategy, FLT)  # pick_method() picks FLT or a subclass
        fed.declare(strategy.name, strategy.DEVICE_OPS)
        fed.present = np.arange(m)
        progress(f"{len(devices)} device processes host {m} clients; relating them with {spec['label']}")
        transport.ledger.reset()
        strategy.setup(fed, retries=EMBED_RETRIES - 1)  # no later round to ask a late client again in
        write_artifacts(method_dir, strategy.take_artifacts())
        result = strategy.fcr_reports[0] | {
            "method": spec["label"],
            "wall_s": time.perf_counter() - tic,
            "bytes": _fcr_traffic(transport),
            "planted_clusters": int(len(np.unique(partition.cluster[partition.cluster >= 0]))),
            "lost": transport.lost_clients().tolist(),  # their device ended: not related
        }
    finally:
        with deferred_interrupt():  # a second Ctrl-C must not cut the devices' shutdown short (emulator/run.py)
            session.close()
    if umap and strategy.how.space != "umap":  # the pipeline did not need UMAP; draw it anyway
        plot_umap(strategy, ctx, method_dir)
    (run_dir / "relate.json").write_text(json.dumps(result, indent=2, default=report._jsonable))
    progress(describe(result))
    return run_dir, result


def plot_umap(strategy: FLT, ctx: Context, out_dir: Path) -> None:
    """umap.png: the clients' centroids after seeded UMAP, coloured by found and by true
    cluster (a picture for the person who asked whether their clients are related)."""
    clients = sorted(strategy.centroids)
    points = fcr.umap_project([strategy.centroids[c] for c in clients], seed=ctx.seed)
    scatter(out_dir / "umap.png", points, strategy.labels[clients], ctx.truth[clients], "UMAP")


def _fcr_traffic(transport: Transport) -> dict:
    t = transport.ledger.totals()
    return {d: {k: t[d][k]["payload"] + t[d][k]["overhead"] for k in ("encoder", "embedding")} for d in t}


def describe(r: dict) -> str:
    first, *rest = describe_clustering(r)
    mb = sum(sum(v.values()) for v in r["bytes"].values()) / 1e6
    missing, lost = r.get("unassigned") or [], r.get("lost") or []
    unheard = f"no centroids came from clients {missing} in {EMBED_RETRIES} requests: they are in no cluster"
    gone = f"clients {lost} were not related: their device was lost (the log says why)"
    return "\n".join(
        [
            f"FCR ({r['method']}): {first}",
            *(f"  {line}" for line in rest),
            *([f"  {unheard}"] if missing else []),
            *([f"  {gone}"] if lost else []),
            f"  {r['n_clients']} clients, {mb:.2f} MB on the wire (encoder + centroids), "
            f"{r['wall_s']:.1f} s in all, {r['server_seconds']:.2f} s of it clustering on the server",
        ]
    )
