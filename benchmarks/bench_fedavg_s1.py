"""FedAvg on the S1-MNIST layout: the emulator against a one-process reference.

Measures, in one run (against reference figures measured on a 2-core machine):

  (a) the emulator: scenarios/s1_mnist.yaml, method fedavg, through the real
      `emulator.run.run_scenario` (server socket + device processes), evaluation only at
      the last round (so training and evaluation costs are separate); seconds per round
      are read back from the run's fedavg/metrics.jsonl ("train_s", median over rounds
      2..T that did no evaluation), plus start-up seconds (call to round 1's start).
      Optional extra runs: --with-eval (evaluate all 100 clients every round) and
      --with-loop (devices use the per-client loop, train.vectorize=false).
  (b) a single-process reference with no federation: the same partition (the run's
      partition.npz), the same initial weights and the same participation draws; each
      selected client is trained one after another with a plain torch loop
      (torch.optim.SGD, batch 10, one epoch), then the models are averaged with sample
      weights. Run with 1 torch thread and with torch's default thread count.
      Only the random streams differ from the emulator's (torch's global generator here,
      each client's own generator on the devices: batch order and dropout masks).
      Until the fix the loop was not FedAvg: it loaded the global model with torch's
      vector_to_parameters, which makes the parameters views of the vector, so training
      wrote into the global model and each client started from the one trained before it
      (a chain of 20 clients per round, then the chain's models averaged). That learned
      far faster early on: 79.5 % against the emulator's 67.5 % at T = 10, 80.3 against
      73.9 at T = 20 (S1, seed 0). Loaded by copy (load_flat), the loop and the emulator
      agree round by round within about 1 point (tests/test_fedavg_reference.py checks
      both against FedAvg by hand).
  (c) the device trainer alone: devices.trainer.CohortTrainer.train on one cohort of
      20 clients x 600 MNIST samples with the MLP (the cohort path, _StackSGD on a CPU;
      vmap(grad) forced; the per-client loop, all with the same batches), and the CIFAR
      CNN on 20 clients x 450 images (vmap(grad) and the loop; auto takes the loop there).

Run from anywhere (paths are resolved against the repository root):

    .venv/bin/python benchmarks/bench_fedavg_s1.py                      # 20 rounds
    .venv/bin/python benchmarks/bench_fedavg_s1.py --rounds 2 --trainer-reps 1   # smoke test

Writes a JSON file (default benchmarks/results/fedavg_s1.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# torch's own choice, captured before anything below changes it
from machine import TORCH_DEFAULT_THREADS, machine_info  # noqa: E402

from flt.models.flat import flatten, load_flat  # noqa: E402

# reference figures, S1-MNIST FedAvg, seconds per round, 2-core machine
REFERENCE_FIGURES = {
    "plain per-client loop (1 process)": 1.31,
    "two worker processes": 0.98,
    "Flower 1.42 simulation": 1.86,
    "authors' code": 63.0,
}


# ----------------------------------------------------------------------------- helpers
def median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else float(a / b)


def fmt(x, unit="s", width=9) -> str:
    if x is None:
        return "-".rjust(width)
    return f"{x:{width}.3f}" if unit == "s" else f"{x:{width}.2f}"


def resolve_data_root(arg: str | None) -> Path:
    from flt.scenarios.datasets import load_dataset

    root = Path(arg).expanduser() if arg else REPO.parent / "shared" / "data"
    root = root.resolve()
    try:
        load_dataset("mnist", root, train=False)
    except Exception as exc:  # DataError, FileNotFoundError, ...
        sys.exit(
            f"error: MNIST not found under {root} ({exc}).\n"
            "Put MNIST's four IDX files there (../shared/data relative to the repository root) "
            "or pass --data-root DIR."
        )
    return root


# ----------------------------------------------------------------------------- (a) emulator
def run_emulator(args, data_root: Path, work: Path, label: str, eval_every: int, extra: list[str] = ()) -> dict:
    """One emulator run of fedavg; returns its per-round timings."""
    from flt.emulator import config, processes
    from flt.emulator.run import run_scenario

    overrides = [
        f"train.rounds={args.rounds}",
        f"devices.processes={args.processes}",
        f"train.eval_every={eval_every}",
        f"data.root={data_root}",
        f"seed={args.seed}",
        *extra,
    ]
    cfg = config.load(args.scenario, overrides, methods=["fedavg"])
    run_dir = work / label
    marks: dict[str, float] = {}

    def progress(line: str) -> None:
        now = time.perf_counter()
        if "device processes host" in line:
            marks.setdefault("devices_ready", now)
        elif re.search(r"\] round\s+1/", line):
            marks.setdefault("round1_end", now)
        if args.verbose:
            print(f"    [{label}] {line}")

    torch.set_num_threads(args.server_threads)
    t0 = time.perf_counter()
    # as `flt run` does first thing: devices fork from a copy of this process (emulator/zygote.py),
    # made before the run's first thread; without it the run spawns a fresh interpreter that
    # imports torch again. Counted in the start-up, as in the command's.
    processes.fork_here()
    run_scenario(cfg, str(run_dir), progress=progress)
    total = time.perf_counter() - t0

    records = [json.loads(x) for x in (run_dir / "fedavg" / "metrics.jsonl").read_text().splitlines() if x]
    # a record's wall-clock figures are in its "timing" object:
    # train_s: selection + training + aggregation; eval_s: that round's evaluation, if any
    times = [{"round": r["round"], **r["timing"]} for r in records]
    per_round = [t["train_s"] + t.get("eval_s", 0.0) for t in times]
    train_only = [t["train_s"] for t in times if t["round"] > 1]
    with_eval = [t["train_s"] + t["eval_s"] for t in times if t["round"] > 1 and "eval_s" in t]
    note = None
    r1 = times[0]
    round1_start = marks.get("round1_end", t0 + total) - r1["train_s"]
    last = next((r for r in reversed(records) if "acc_mean" in r), {})
    return {
        "label": label,
        "overrides": overrides,
        "run_dir": str(run_dir),
        "rounds": len(records),
        "eval_every": eval_every,
        "median_round_s": median(train_only),  # rounds 2..T without evaluation
        "median_round_with_eval_s": median(with_eval),  # rounds 2..T that evaluated
        "round1_s": r1["train_s"],
        "startup_s": round1_start - t0,  # call -> round 1 starts
        "devices_ready_s": (marks["devices_ready"] - t0) if "devices_ready" in marks else None,
        "total_s": total,
        "per_round_s": per_round,
        "final_acc_mean": last.get("acc_mean"),
        "bytes_last_round": records[-1].get("bytes"),
        "note": note,
    }


# ----------------------------------------------------------------------------- (b) reference
def load_shards(args, data_root: Path, run_dir: Path | None):
    """Train/test tensors per client, the seeded initial weights and the model spec, from the
    emulator run's partition.npz (or a freshly built one when the emulator was skipped)."""
    from flt.emulator import config
    from flt.emulator.run import build_partition, hold_out_public, initial_weights
    from flt.scenarios.datasets import load_dataset
    from flt.scenarios.partition import Partition

    cfg = config.load(args.scenario, [f"data.root={data_root}", f"seed={args.seed}"], methods=["fedavg"])
    train = load_dataset("mnist", data_root, train=True)
    test = load_dataset("mnist", data_root, train=False)
    if run_dir is not None and (run_dir / "partition.npz").is_file():
        partition, source = Partition.load(run_dir / "partition.npz"), str(run_dir / "partition.npz")
    else:
        public = hold_out_public(cfg, len(train.y))
        partition, source = build_partition(cfg, train, test, public), "built (emulator skipped)"
    init, spec = initial_weights(cfg, train)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    xt, yt = torch.from_numpy(test.x), torch.from_numpy(test.y)
    shards = []
    for tr, te in zip(partition.train, partition.test, strict=True):  # as devices/device.py::_shard does
        tr, te = torch.from_numpy(tr), torch.from_numpy(te)
        shards.append((x[tr].float().div_(255), y[tr].long(), xt[te].float().div_(255), yt[te].long()))
    return cfg, shards, init, spec, source


def run_reference(cfg: dict, shards, init: torch.Tensor, spec: dict, rounds: int, threads: int, seed: int) -> dict:
    from flt.emulator.population import Population
    from flt.models.nets import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t = cfg["train"]
    lr, bs, epochs = t["lr"], t["batch_size"], t["local_epochs"]
    model = build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"])
    population = Population(len(shards), t["participation"], cfg["seed"])
    everyone = np.arange(len(shards))
    global_vec = init.clone()
    times = []
    for rnd in range(1, rounds + 1):
        tic = time.perf_counter()
        selected = population.select(rnd, everyone)
        global_vec = reference_round(model, global_vec, [shards[c] for c in selected.tolist()], lr, bs, epochs)
        times.append(time.perf_counter() - tic)
    # untimed sanity check: mean per-client test accuracy of the final global model
    load_flat(model, global_vec)
    return {
        "threads": threads,
        "per_round_s": times,
        "median_round_s": median(times[1:] if len(times) > 1 else times),
        "round1_s": times[0],
        "final_acc_mean": mean_client_accuracy(model, shards),
    }


def reference_round(
    model: torch.nn.Module, global_vec: torch.Tensor, shards, lr: float, bs: int, epochs: int
) -> torch.Tensor:
    """One FedAvg round: each shard's client trains from `global_vec` (left unchanged),
    then the models are averaged with sample weights. The model is loaded by copy
    (load_flat): torch's vector_to_parameters makes the parameters views of the vector,
    so training would write into global_vec and every client would start from the one
    before it (what this loop did until the fix; see the module docstring)."""
    acc, n_total = torch.zeros_like(global_vec), 0
    for x, y, *_ in shards:
        load_flat(model, global_vec)
        train_client(model, x, y, lr, bs, epochs)
        acc += len(y) * flatten(model)
        n_total += len(y)
    return acc / n_total


def train_client(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, bs: int, epochs: int) -> None:
    """Plain torch SGD on one client's shard, in place: the loop a Flower user would write
    (also what the Flower clients of flower_app.py run)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for lo in range(0, len(y), bs):
            b = perm[lo : lo + bs]
            opt.zero_grad()
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()


def mean_client_accuracy(model: torch.nn.Module, shards) -> float:
    """Mean over clients of the model's test accuracy (%) on each client's test shard."""
    model.eval()
    with torch.no_grad():
        accs = [100.0 * float((model(s[2]).argmax(1) == s[3]).float().mean()) for s in shards]
    return float(np.mean(accs))


# ----------------------------------------------------------------------------- (c) trainer
# the cohort trainer's modes: "cohort" is what vectorize=True runs (for the MLP on a CPU
# the hand-written _StackSGD; for a CNN vmap(grad)), "vmap" forces vmap(grad), "loop" is the
# per-client reference with the same batches
TRAINER_MODES = {"mlp": ("cohort", "vmap", "loop"), "cifar_cnn": ("vmap", "loop")}


def run_trainer(shards, spec: dict, args, threads: int) -> dict:
    """The MLP row: B clients x N samples of the S1 shards."""
    # one cohort of B clients x N samples: consecutive N-sample slices of the S1 client shards
    # laid end to end (S1 clients hold 564-600 each, so a slice is mostly one client's data)
    pool_x = torch.cat([s[0] for s in shards])
    pool_y = torch.cat([s[1] for s in shards])
    b, n = args.trainer_clients, args.trainer_samples
    if b * n > len(pool_y):
        sys.exit(f"error: --trainer-clients x --trainer-samples = {b * n} exceeds the {len(pool_y)} samples")
    xs = [pool_x[i * n : (i + 1) * n] for i in range(b)]
    ys = [pool_y[i * n : (i + 1) * n] for i in range(b)]
    return time_trainer(spec, xs, ys, args, threads)


def run_cnn_trainer(args, threads: int, clients: int = 20, samples: int = 450) -> dict:
    """The CNN row: the CIFAR CNN on 20 clients x 450 images (random pixels: speed only)."""
    g = torch.Generator().manual_seed(args.seed)
    xs = [torch.rand(samples, 3, 32, 32, generator=g) for _ in range(clients)]
    ys = [torch.randint(0, 10, (samples,), generator=g) for _ in range(clients)]
    spec = {"name": "cifar_cnn", "in_shape": [3, 32, 32], "num_classes": 10}
    return time_trainer(spec, xs, ys, args, threads, reps=max(1, args.trainer_reps // 2))


def time_trainer(spec: dict, xs, ys, args, threads: int, reps: int | None = None) -> dict:
    from flt.devices import trainer as trainer_module
    from flt.devices.trainer import CohortTrainer, TrainConfig
    from flt.models.flat import flatten, param_spec
    from flt.models.nets import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    model = build_model(spec["name"], tuple(spec["in_shape"]), spec["num_classes"])
    trainer = CohortTrainer(model, param_spec(model))
    b, reps = len(xs), reps or args.trainer_reps
    start = flatten(model).expand(b, -1).clone()
    base = TrainConfig(epochs=1, batch_size=10, lr=0.01)
    out = {"model": spec["name"], "threads": threads, "clients": b, "samples": len(xs[0]), "reps": reps}
    for mode in TRAINER_MODES[spec["name"]]:
        cfg = replace(base, vectorize=mode != "loop")
        # vmap: vmap(grad) even where the hand-written backward pass would take over
        forced = mock.patch.object(trainer_module._StackSGD, "fits", return_value=False) if mode == "vmap" else None
        with forced or contextlib.nullcontext():
            trainer.train(start, xs, ys, cfg, torch.Generator().manual_seed(12345))  # warm-up
            times, losses = [], []
            for rep in range(reps):
                gen = torch.Generator().manual_seed(args.seed * 1000 + rep)  # same batches in every mode
                tic = time.perf_counter()
                _, loss = trainer.train(start, xs, ys, cfg, gen)
                times.append(time.perf_counter() - tic)
                losses.append(float(loss.mean()))
        out[mode] = {"per_call_s": times, "median_s": median(times), "mean_loss": float(np.mean(losses))}
    fastest = min(out[m]["median_s"] for m in TRAINER_MODES[spec["name"]] if m != "loop")
    out["loop_over_fastest"] = ratio(out["loop"]["median_s"], fastest)
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="rounds T (default 20)")
    p.add_argument("--processes", type=int, default=2, help="emulator device processes (default 2)")
    p.add_argument("--eval-every", type=int, help="emulator train.eval_every (default: = rounds)")
    p.add_argument("--with-eval", action="store_true", help="also run the emulator evaluating every round")
    p.add_argument(
        "--with-loop",
        action="store_true",
        help="also run the emulator with train.vectorize=false (per-client loop on devices)",
    )
    p.add_argument("--data-root", help="folder holding MNIST (default: ../shared/data from the repo root)")
    p.add_argument("--scenario", default=str(REPO / "scenarios" / "s1_mnist.yaml"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-threads", type=int, default=1, help="torch threads in the emulator's server process")
    p.add_argument(
        "--ref-threads",
        default=f"1,{TORCH_DEFAULT_THREADS}",
        help=f"comma-separated thread counts for (b) and (c) (default 1,{TORCH_DEFAULT_THREADS}: "
        "1 and torch's default)",
    )
    p.add_argument("--trainer-clients", type=int, default=20)
    p.add_argument("--trainer-samples", type=int, default=600)
    p.add_argument("--trainer-reps", type=int, default=5, help="timed calls per mode in (c), after one warm-up")
    p.add_argument("--parts", default="abc", help="which parts to run: any of a, b, c (default abc)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fedavg_s1.json"))
    p.add_argument("--keep-runs", action="store_true", help="keep the emulator run folders (printed)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the emulator's progress lines")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.processes < 1 or args.trainer_reps < 1:
        p.error("--rounds, --processes and --trainer-reps must be >= 1")
    thread_list = sorted({int(t) for t in args.ref_threads.split(",") if t.strip()})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    data_root = resolve_data_root(args.data_root)
    info = machine_info()
    print(
        f"machine: {info['cpu_model'] or '?'}; os.cpu_count={info['os_cpu_count']}, "
        f"affinity={info['sched_affinity']}, torch {info['torch']} (default threads "
        f"{TORCH_DEFAULT_THREADS}), device={info['device']}, loadavg={info['loadavg_start']}"
    )
    print(f"data: {data_root}; scenario: {args.scenario}; rounds={args.rounds}")
    results: dict = {
        "benchmark": "fedavg_s1",
        "machine": info,
        "args": vars(args),
        "reference_s_per_round": REFERENCE_FIGURES,
    }
    work = Path(tempfile.mkdtemp(prefix="flt-bench-s1-"))
    emu: dict = {}
    try:
        # (a) -------------------------------------------------------------------------
        if "a" in args.parts:
            runs = [("no_eval", args.eval_every or args.rounds, [])]
            if args.with_eval:
                runs.append(("eval_every_round", 1, []))
            if args.with_loop:
                runs.append(("no_eval_loop", args.eval_every or args.rounds, ["train.vectorize=false"]))
            for label, every, extra in runs:
                print(f"(a) emulator [{label}] ...", flush=True)
                emu[label] = run_emulator(args, data_root, work, label, every, extra)
                e = emu[label]
                med = e["median_round_with_eval_s"] if every == 1 else e["median_round_s"]
                print(
                    f"    start-up {e['startup_s']:.2f} s, round 1 {e['round1_s']:.2f} s, "
                    f"median {fmt(med).strip()} s/round, final acc {e['final_acc_mean']:.2f}"
                )
            results["emulator"] = emu
            children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            results["emulator_largest_child_rss_mb"] = children

        # (b) -------------------------------------------------------------------------
        run_dir = work / "no_eval" if "no_eval" in emu else None
        need_shards = "b" in args.parts or "c" in args.parts
        if need_shards:
            cfg, shards, init, spec, source = load_shards(args, data_root, run_dir)
            results["partition_source"] = source
        ref: dict = {}
        if "b" in args.parts:
            for th in thread_list:
                print(f"(b) reference loop, {th} thread(s) ...", flush=True)
                ref[f"threads_{th}"] = run_reference(cfg, shards, init, spec, args.rounds, th, args.seed)
                r = ref[f"threads_{th}"]
                print(f"    median {fmt(r['median_round_s']).strip()} s/round, final acc {r['final_acc_mean']:.2f}")
            results["reference"] = ref

        # (c) -------------------------------------------------------------------------
        tr: dict = {}
        if "c" in args.parts:
            for th in thread_list:
                print(
                    f"(c) CohortTrainer {args.trainer_clients} x {args.trainer_samples}, {th} thread(s) ...", flush=True
                )
                tr[f"mlp_threads_{th}"] = run_trainer(shards, spec, args, th)
                print(f"(c) CohortTrainer, CIFAR CNN 20 x 450, {th} thread(s) ...", flush=True)
                tr[f"cifar_cnn_threads_{th}"] = run_cnn_trainer(args, th)
            results["trainer"] = tr
    finally:
        if args.keep_runs:
            print(f"run folders kept under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    # ratios and table ---------------------------------------------------------------
    emu_s = emu.get("no_eval", {}).get("median_round_s")
    ratios: dict = {}
    for k, r in ref.items():
        ratios[f"reference_{k}_over_emulator"] = ratio(r["median_round_s"], emu_s)
    for k, t in tr.items():
        ratios[f"trainer_{k}_loop_over_fastest"] = t["loop_over_fastest"]
    for name, fig in REFERENCE_FIGURES.items():
        ratios[f"design[{name}]_over_emulator"] = ratio(fig, emu_s)
    if "eval_every_round" in emu:
        e = emu["eval_every_round"]["median_round_with_eval_s"]
        ratios["emulator_eval_cost_s_per_round"] = None if e is None or emu_s is None else e - emu_s
    results["ratios"] = ratios
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    print()
    print("S1-MNIST FedAvg, 100 clients, rho 0.2, E 1, batch 10, MLP   (seconds per round, median, round 1 excluded)")
    print(f"  {'what':58s} {'s/round':>9s} {'ratio':>9s}")
    for label, e in emu.items():
        extra = f"  (start-up {e['startup_s']:.1f} s; round 1 {e['round1_s']:.2f} s)"
        what = f"(a) emulator, {args.processes} device procs, {label}"
        s = e["median_round_with_eval_s"] if label == "eval_every_round" else e["median_round_s"]
        print(f"  {what:58s} {fmt(s)} {'':9s}{extra}")
    for r in ref.values():
        what = f"(b) one-process per-client loop, {r['threads']} thread(s)"
        print(
            f"  {what:58s} {fmt(r['median_round_s'])} {fmt(ratio(r['median_round_s'], emu_s), 'x')}x"
            "  (reference / emulator)"
        )
    for t in tr.values():
        for mode in TRAINER_MODES[t["model"]]:
            what = f"(c) {t['model']} {t['clients']}x{t['samples']} {mode}, {t['threads']} thread(s)"
            rat = f"{fmt(ratio(t['loop']['median_s'], t[mode]['median_s']), 'x')}x  (loop / this)"
            print(f"  {what:58s} {fmt(t[mode]['median_s'])} {rat if mode != 'loop' else ''}")
    print("  reference figures (2-core machine), for context:")
    for name, fig in REFERENCE_FIGURES.items():
        print(f"  {'    ' + name:58s} {fmt(fig)} {fmt(ratio(fig, emu_s), 'x')}x  (figure / emulator)")
    for e in emu.values():
        if e["note"]:
            print(f"  note [{e['label']}]: {e['note']}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
