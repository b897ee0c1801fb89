"""IFCA's pick and a round's evaluation on one device: the padded vmapped pass against the
client-by-client pass, on clients of unequal size.

IFCA sends every selected client all C cluster models; each client computes its training
loss under each of them and trains the best (devices/methods/train_best.py). The trainer's
vmapped evaluation pads every client of the cohort to the largest one's sample count, so
on S4's FEMNIST writers (22 to 805 training images a client, median 43) most of the work
is padding, C times a round. This times both passes on a cohort with those sizes (every
10th of S4's 100 sorted training-set sizes unless --sizes is given), checks that they pick
the same models, and prints the ratio measured in the same run.

    .venv/bin/python benchmarks/bench_pick.py                 # LEAF CNN, C = 10, 1 thread
    .venv/bin/python benchmarks/bench_pick.py --model mlp

Writes benchmarks/results/pick_<device>_<model>.json.
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

from flt.devices.trainer import CohortTrainer  # noqa: E402
from flt.models.flat import flatten, param_spec  # noqa: E402
from flt.models.nets import build_model  # noqa: E402

SHAPES = {"mlp": ((1, 28, 28), 62), "leaf_cnn": ((1, 28, 28), 62), "cifar_cnn": ((3, 32, 32), 10)}
# every 10th of scenarios/s4_femnist.yaml's 100 training-set sizes, sorted (seed 0)
S4_SIZES = [22, 28, 33, 37, 41, 45, 47, 50, 172, 470]


def shards(sizes: list[int], shape: tuple, classes: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8).to(device) for n in sizes]
    ys = [torch.randint(0, classes, (n,), generator=g).to(device) for n in sizes]
    return xs, ys


def best_of(fn, vectorize: bool, reps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), torch.empty(0)
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(vectorize)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="leaf_cnn", choices=list(SHAPES))
    ap.add_argument("--clusters", type=int, default=10, help="candidate models per client (IFCA's C)")
    ap.add_argument("--sizes", type=int, nargs="+", default=S4_SIZES, help="training images per client")
    ap.add_argument("--test", type=int, default=20, help="test images per client (S4: 20)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a device process uses 1)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape, classes = SHAPES[args.model]
    torch.manual_seed(0)
    net = build_model(args.model, shape, classes).to(device)
    tr = CohortTrainer(net, param_spec(net))
    w0 = flatten(net).to(device)
    cands = w0 + 0.01 * torch.randn(args.clusters, w0.numel(), generator=torch.Generator().manual_seed(1)).to(device)
    xs, ys = shards(args.sizes, shape, classes, device)
    xt, yt = shards([args.test] * len(args.sizes), shape, classes, device)
    models = cands[torch.arange(len(xs)) % args.clusters]

    tr.losses_of(cands[:1], xs[:2], ys[:2], vectorize=True)  # warm-up: kernels, allocator
    padded_samples = max(args.sizes) * len(xs)
    row = {"model": args.model, "clusters": args.clusters, "sizes": args.sizes, "padded_samples": padded_samples}
    print(f"device {device} ({machine_info()['device']}), {args.threads} thread(s), {args.model}, C = {args.clusters}")
    print(f"cohort: {len(xs)} clients, {sum(args.sizes)} training images ({row['padded_samples']} once padded)")
    for what, run in (
        ("pick", lambda v: tr.losses_of(cands, xs, ys, vectorize=v)),
        ("evaluate", lambda v: tr.evaluate(models, xt, yt, vectorize=v)[2]),
    ):
        padded_s, padded = best_of(run, True, args.reps, device)
        loop_s, loop = best_of(run, False, args.reps, device)
        same = what != "pick" or bool(torch.equal(padded.argmin(1), loop.argmin(1)))
        row[what] = {
            "padded_vmap_s": padded_s,
            "client_loop_s": loop_s,
            "padded_over_loop": padded_s / loop_s,
            "max_abs_loss_diff": float((padded - loop).abs().max()),
            "same_choices": same,
        }
        print(
            f"{what:<9} padded vmap {padded_s:8.3f} s   client loop {loop_s:8.3f} s   "
            f"ratio {padded_s / loop_s:5.2f}   max |loss diff| {row[what]['max_abs_loss_diff']:.1e}"
            + ("" if what != "pick" else f"   same choices: {same}")
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pick_{device.type}_{args.model}.json"
    path.write_text(json.dumps({"machine": machine_info(), "threads": args.threads, **row}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
