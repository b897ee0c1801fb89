"""One device's round for a cohort: the vectorized trainer against the per-client loop,
per model, on the CPU or a GPU.

A device trains its whole cohort in one call (devices/trainer.py). With `vectorize` the
cohort's stacked parameters take every SGD step together under torch.func.vmap; without,
each client runs the textbook loop. Which is faster depends on the model and the
hardware (a CNN's convolutions under vmap may lose to the loop), so this measures both,
for each model, on synthetic data of the given shape (timing does not depend on the pixels).

    .venv/bin/python benchmarks/bench_cohort.py                       # CPU, small cohorts
    python benchmarks/bench_cohort.py --device cuda --clients 480 120 120

The loop is timed on at most --loop-clients clients and scaled to the cohort (its cost is
linear in clients: each one runs alone). Prints seconds per round (train one epoch, then
evaluate) and the ratio loop / vmap measured in the same run; writes
benchmarks/results/cohort_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from machine import machine_info  # noqa: E402

from flt.devices.seeds import client_generator  # noqa: E402
from flt.devices.trainer import CohortTrainer, TrainConfig  # noqa: E402
from flt.models.flat import flatten, param_spec  # noqa: E402
from flt.models.nets import build_model  # noqa: E402

SHAPES = {"mlp": ((1, 28, 28), 10), "leaf_cnn": ((1, 28, 28), 62), "cifar_cnn": ((3, 32, 32), 10)}


def cohort(model: str, clients: int, samples: int, device: torch.device):
    shape, classes = SHAPES[model]
    g = torch.Generator().manual_seed(0)
    # unequal shards, as in every non-IID partition: 50 % to 150 % of the mean
    sizes = torch.linspace(0.5 * samples, 1.5 * samples, clients).round().int().tolist()
    xs = [torch.rand((n, *shape), generator=g).to(device) for n in sizes]
    ys = [torch.randint(0, classes, (n,), generator=g).to(device) for n in sizes]
    return xs, ys


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_round(trainer, init, xs, ys, vectorize: bool, device, reps: int) -> float:
    cfg = TrainConfig(epochs=1, batch_size=10, lr=0.01, vectorize=vectorize)
    best = float("inf")
    for _ in range(reps):
        gens = [client_generator(1, c) for c in range(len(xs))]
        sync(device)
        t0 = time.perf_counter()
        trained, _ = trainer.train(init.expand(len(xs), -1), xs, ys, cfg, gens)
        trainer.evaluate(trained, xs, ys)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench(model: str, clients: int, samples: int, loop_clients: int, device, reps: int) -> dict:
    shape, classes = SHAPES[model]
    torch.manual_seed(0)
    net = build_model(model, shape, classes).to(device)
    trainer = CohortTrainer(net, param_spec(net))
    init = flatten(net).to(device)
    xs, ys = cohort(model, clients, samples, device)
    time_round(trainer, init, xs[:4], ys[:4], True, device, 1)  # warm-up: kernels, allocator
    vmap_s = time_round(trainer, init, xs, ys, True, device, reps)
    k = min(loop_clients, clients)
    loop_s = time_round(trainer, init, xs[:k], ys[:k], False, device, 1) * clients / k
    steps = sum(-(-len(x) // 10) for x in xs)
    return {
        "model": model,
        "clients": clients,
        "mean_samples": samples,
        "sgd_steps": steps,
        "vmap_s": vmap_s,
        "loop_s": loop_s,
        "loop_timed_on_clients": k,
        "loop_over_vmap": loop_s / vmap_s,
        "faster": "vmap" if vmap_s < loop_s else "loop",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=["mlp", "leaf_cnn", "cifar_cnn"], choices=list(SHAPES))
    ap.add_argument(
        "--clients",
        nargs="+",
        type=int,
        default=[48, 24, 20],
        help="cohort size per model (the paper's S4 round: 480 MLP, 120 CNN clients)",
    )
    ap.add_argument(
        "--samples",
        nargs="+",
        type=int,
        default=[250, 140, 500],
        help="mean samples per client per model (S4 MLP ~25 steps; FEMNIST writers ~140)",
    )
    ap.add_argument("--loop-clients", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a device process uses 1)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = len(args.models)
    clients = (args.clients * n)[:n] if len(args.clients) == 1 else args.clients
    samples = (args.samples * n)[:n] if len(args.samples) == 1 else args.samples
    rows = []
    print(f"device {device} ({machine_info()['device']}), {args.threads} thread(s); one round = 1 epoch + evaluate")
    print(f"{'model':<10} {'clients':>7} {'steps':>6} {'vmap s':>9} {'loop s':>9} {'loop/vmap':>9}")
    for model, b, s in zip(args.models, clients, samples, strict=True):
        r = bench(model, b, s, args.loop_clients, device, args.reps)
        rows.append(r)
        print(
            f"{model:<10} {b:>7} {r['sgd_steps']:>6} {r['vmap_s']:>9.3f} {r['loop_s']:>9.3f} "
            f"{r['loop_over_vmap']:>9.2f}  (loop timed on {r['loop_timed_on_clients']} clients)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cohort_{device.type}.json"
    path.write_text(json.dumps({"machine": machine_info(), "threads": args.threads, "results": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
