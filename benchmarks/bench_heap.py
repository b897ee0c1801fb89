"""A device process's heap: one CNN client's training with large blocks from mmap (the
limits a device keeps between ops, common/heap.py) against `working_heap` (what an op
computes under).

Between ops a device sends every block over 256 kB to mmap so that freed buffers go back
to the system; each such block is fresh pages, faulted in 4 kB at a time. The LEAF CNN
frees and allocates a 26 MB weight gradient every SGD step. This trains the same clients
both ways, interleaved, in one process and prints seconds, page faults and the ratio.

    .venv/bin/python benchmarks/bench_heap.py               # LEAF CNN, 2 clients, E = 1

Writes benchmarks/results/heap_cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from machine import machine_info  # noqa: E402

from flt.common.heap import limit_heap_retention, working_heap  # noqa: E402
from flt.devices.seeds import client_generator  # noqa: E402
from flt.devices.trainer import CohortTrainer, TrainConfig  # noqa: E402
from flt.models.flat import flatten, param_spec  # noqa: E402
from flt.models.nets import build_model  # noqa: E402

SHAPES = {"leaf_cnn": ((1, 28, 28), 62), "cifar_cnn": ((3, 32, 32), 10), "mlp": ((1, 28, 28), 10)}


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="leaf_cnn", choices=list(SHAPES))
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 150], help="training images per client")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    if not limit_heap_retention():
        sys.exit("the C library is not glibc: a device keeps glibc's defaults, nothing to compare")
    torch.set_num_threads(1)  # as a device process
    shape, classes = SHAPES[args.model]
    torch.manual_seed(0)
    net = build_model(args.model, shape, classes)
    trainer, w0 = CohortTrainer(net, param_spec(net)), flatten(net)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8) for n in args.sizes]
    ys = [torch.randint(0, classes, (n,), generator=g) for n in args.sizes]
    cfg = TrainConfig(epochs=1, batch_size=10, lr=0.01, vectorize=False)

    def once(heap) -> tuple[float, int]:
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        with heap():
            trainer.train(w0.expand(len(xs), -1), xs, ys, cfg, [client_generator(0, c) for c in range(len(xs))])
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    once(working_heap)  # warm-up
    runs: dict[str, list[tuple[float, int]]] = {"mmap": [], "working_heap": []}
    for _ in range(args.reps):
        runs["mmap"].append(once(contextlib.nullcontext))
        runs["working_heap"].append(once(working_heap))
    best = {k: min(v) for k, v in runs.items()}
    ratio = best["mmap"][0] / best["working_heap"][0]
    print(f"{args.model}, clients of {args.sizes} images, E = 1, 1 thread ({machine_info()['device']})")
    for k, (s, faults) in best.items():
        print(f"  {k:<13} {s:7.2f} s   {faults:>8} page faults")
    print(f"  mmap / working_heap: {ratio:.2f}   resident after: {rss_mb():.0f} MB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "heap_cpu.json"
    rows = {k: [{"s": s, "page_faults": f} for s, f in v] for k, v in runs.items()}
    report = {"machine": machine_info(), "model": args.model, "runs": rows, "ratio": ratio}
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
