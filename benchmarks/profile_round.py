"""Where one S1 round's time goes, on the server and on the devices.

Runs S1-MNIST FedAvg (scenarios/s1_mnist.yaml, 100 clients, rho 0.2, E 1, MLP) through
the real `run_scenario`, with the server under cProfile and every device process under
its own (FLT_PROFILE=DIR makes `flt device` write DIR/NAME.prof at shutdown). Then it
sums each process's time by what it was doing, per round (set-up and start-up left out
as far as cProfile allows: the per-round figures divide the totals of the round loop's
own functions by T).

    .venv/bin/python benchmarks/profile_round.py --rounds 10
    .venv/bin/python benchmarks/profile_round.py --rounds 10 --raw 25   # also the top functions

A whole round's wall time is measured from the records (`timing.wall_s` of consecutive
rounds: training and aggregation, evaluation, the record, the checkpoint, the summary
rewrite and the progress line), next to `train_s`, the part that bench_fedavg_s1.py and
bench_flower.py report as seconds per round. Writes benchmarks/results/profile_round.json.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_fedavg_s1 import resolve_data_root  # noqa: E402

# what a process was doing: (label, function names whose cumulative time counts). A
# function's cumulative time includes its callees, so the labels are read top down
# and each is reported as measured (they nest: "train exchange" holds "wait for
# devices", "decode" and "reply checks").
SERVER = [
    ("round loop (all)", [("federation.py", "run_method")]),
    ("  select clients", [("population.py", "select")]),
    ("  train exchange", [("federation.py", "train")]),
    ("    encode and send", [("transport.py", "send")]),
    ("    waiting for replies (every exchange)", [("transport.py", "_next")]),
    ("    decode replies", [("wire.py", "decode")]),
    ("    reply checks", [("replies.py", "check")]),
    ("    price on the clock", [("population.py", "price")]),
    ("  aggregate", [("fedavg.py", "aggregate")]),
    ("  evaluate exchange", [("federation.py", "evaluate")]),
    ("  checkpoint", [("federation.py", "save_checkpoint")]),
    ("    device state snapshot", [("federation.py", "_device_state")]),
    ("    write checkpoint.npz", [("checkpoint.py", "save")]),
    ("  summary rewrite", [("run.py", "record")]),
    ("  progress line", [("progress.py", "step")]),
]
DEVICE = [
    ("device loop (all, idle included)", [("device.py", "run")]),
    ("  idle: waiting for the server", [("zmq/sugar/poll.py", "poll")]),
    ("  decode tasks", [("wire.py", "decode")]),
    ("  cohort op", [("device.py", "_process")]),
    ("    training (CohortTrainer.train)", [("trainer.py", "train")]),
    ("      batch order (epoch_batches)", [("trainer.py", "epoch_batches")]),
    ("      dropout noise (_epoch_noise)", [("trainer.py", "_epoch_noise")]),
    ("      SGD steps by hand, or vmap path's update (step)", [("trainer.py", "step")]),
    ("      SGD steps (vmap(grad))", [("_functorch/apis.py", "wrapped")]),
    ("    shard data and start models", [("ops.py", "shard_data"), ("ops.py", "sent_models")]),
    ("    per-client generators", [("ops.py", "generators")]),
    ("    evaluation", [("ops.py", "evaluate")]),
    ("    checkpoint snapshot", [("ops.py", "snapshot")]),
    ("  encode and send replies", [("device.py", "send")]),
]


def cumulative(stats: pstats.Stats, wanted: list[tuple[str, str]]) -> float:
    total = 0.0
    for (file, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if any(file.endswith(f) and name == n for f, n in wanted):
            total += row[3]
    return total


def table(stats: pstats.Stats, rows, rounds: int) -> list[dict]:
    return [{"what": label, "s_per_round": cumulative(stats, wanted) / rounds} for label, wanted in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--data-root")
    p.add_argument("--scenario", default=str(REPO / "scenarios" / "s1_mnist.yaml"))
    p.add_argument("--raw", type=int, default=0, help="also print the top N functions of the server and dev-0")
    p.add_argument("--out", default=str(HERE / "results" / "profile_round.json"))
    args = p.parse_args()

    import torch

    from flt.emulator import config
    from flt.emulator.run import run_scenario

    data_root = resolve_data_root(args.data_root)
    work = Path(tempfile.mkdtemp(prefix="flt-profile-"))
    os.environ["FLT_PROFILE"] = str(work)  # device processes inherit it and profile themselves
    overrides = [
        f"train.rounds={args.rounds}",
        f"devices.processes={args.processes}",
        f"train.eval_every={args.rounds}",  # as bench_fedavg_s1: evaluation once, at the end
        f"data.root={data_root}",
    ]
    cfg = config.load(args.scenario, overrides, methods=["fedavg"])
    torch.set_num_threads(1)
    server = cProfile.Profile()
    tic = time.perf_counter()
    server.runcall(run_scenario, cfg, str(work / "run"), progress=lambda line: None)
    total = time.perf_counter() - tic
    server.dump_stats(work / "server.prof")

    records = [json.loads(x) for x in (work / "run" / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    walls = [r["timing"]["wall_s"] for r in records]
    whole = statistics.median(b - a for a, b in itertools.pairwise(walls[1:]))  # rounds 3..T
    train_s = statistics.median(r["timing"]["train_s"] for r in records[1:])
    out = {
        "rounds": args.rounds,
        "processes": args.processes,
        "run_s": total,
        "whole_round_s_median": whole,
        "train_s_median": train_s,
        "server": table(pstats.Stats(str(work / "server.prof")), SERVER, args.rounds),
        "devices": {},
    }
    for prof in sorted(work.glob("dev-*.prof")):
        out["devices"][prof.stem] = table(pstats.Stats(str(prof)), DEVICE, args.rounds)

    print(f"S1-MNIST FedAvg, {args.rounds} rounds, {args.processes} device processes (cProfile on: it slows calls)")
    print(f"  whole round (wall_s between records, median): {whole:.3f} s;  train_s (median): {train_s:.3f} s")
    print(f"\n  {'server: what':<42}{'s/round':>9}")
    for row in out["server"]:
        print(f"  {row['what']:<42}{row['s_per_round']:9.3f}")
    for name, rows in out["devices"].items():
        print(f"\n  {name + ': what':<42}{'s/round':>9}")
        for row in rows:
            print(f"  {row['what']:<42}{row['s_per_round']:9.3f}")
    if args.raw:
        for name in ("server", "dev-0"):
            print(f"\n--- {name}: top {args.raw} by cumulative time")
            pstats.Stats(str(work / f"{name}.prof")).sort_stats("cumulative").print_stats(args.raw)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out} (profiles in {work})")


if __name__ == "__main__":
    main()
