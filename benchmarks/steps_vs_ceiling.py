"""A federation's accuracy beside centralised SGD after as many sequential steps.

However many clients a round averages, it moves a cluster's model along one averaged
trajectory of E x ceil(n / B) SGD steps, n being a client's training images. So a run with
small clients makes few steps a round whatever its participation. This sets each
recorded round t of finished runs beside the centralised ceiling (`ceiling_clusters.py`'s
JSON, on the same data) after the same number of steps, counted in the ceiling's passes:

    passes(t) = t * E * ceil(n / B) / ceil(N / B)

with n the median client's images and N the ceiling's images a cluster (their mean). The
ceiling is interpolated linearly between its evaluations; before its first one and after
its last one the column is left empty.

    python benchmarks/steps_vs_ceiling.py CEILING.json RUN/METHOD [RUN/METHOD ...] [--out F.json]

With --out, a PNG beside the JSON draws the ceiling's curve and every run against passes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from eval_cluster_classes import load_run


def steps_per_round(cfg: dict, sizes: np.ndarray) -> int:
    """SGD steps a round makes along a cluster model's trajectory: the median client's."""
    t = cfg["train"]
    return int(t["local_epochs"]) * math.ceil(float(np.median(sizes)) / int(t["batch_size"]))


def at(curve: list[dict], passes: float) -> float | None:
    """The ceiling's accuracy (our protocol) after `passes`, None outside its curve."""
    x = np.array([r["epoch"] for r in curve], dtype=float)
    if not x[0] - 1e-9 <= passes <= x[-1] + 1e-9:
        return None
    return float(np.interp(passes, x, [r["ours"] for r in curve]))


def matched(ceiling: dict, method_dir: Path) -> dict:
    """Each recorded round of one run, with its steps, passes and the ceiling there."""
    cfg, part = load_run(method_dir.parent)
    sizes = np.array([len(a) for a in part.train])
    per_round = steps_per_round(cfg, sizes)
    pass_steps = math.ceil(float(np.mean(ceiling["cluster_images"])) / int(cfg["train"]["batch_size"]))
    rows = []
    for line in (method_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("acc_mean") is None:
            continue
        passes = rec["round"] * per_round / pass_steps
        rows.append(
            {"round": rec["round"], "passes": passes, "run": rec["acc_mean"], "ceiling": at(ceiling["curve"], passes)}
        )
    return {
        "run": str(method_dir),
        "client_images": float(np.median(sizes)),
        "steps_per_round": per_round,
        "rows": rows,
    }


def show(got: dict) -> None:
    print(f"{got['run']}: {got['client_images']:g} images a client, {got['steps_per_round']} steps a round")
    print("  round  passes     run  ceiling  run - ceiling")
    for r in got["rows"]:
        c = r["ceiling"]
        tail = "       -         -" if c is None else f"  {c:7.2f}  {r['run'] - c:+8.2f}"
        print(f"  {r['round']:5d}  {r['passes']:6.2f}  {r['run']:6.2f}{tail}")


def plot(ceiling: dict, every: list[dict], path: Path) -> None:
    """The ceiling and each run against SGD steps, in the ceiling's passes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    curve = ceiling["curve"]
    ax.plot([r["epoch"] for r in curve], [r["ours"] for r in curve], "k-", lw=2, label="centralised ceiling")
    for got in every:
        label = "/".join(Path(got["run"]).parts[-2:])
        ax.plot([r["passes"] for r in got["rows"]], [r["run"] for r in got["rows"]], "-o", ms=3, lw=1, label=label)
    ax.set_xscale("log")
    ax.set(xlabel="SGD steps, in passes over a cluster's pooled data (log)", ylabel="test accuracy (%)")
    ax.set_title("each round's accuracy after as many SGD steps as the ceiling's", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ceiling", type=Path, help="a ceiling_clusters.py JSON")
    ap.add_argument("runs", type=Path, nargs="+", help="method folders inside finished runs (RUN/METHOD)")
    ap.add_argument("--out", type=Path, help="write every table here (JSON)")
    args = ap.parse_args()
    ceiling = json.loads(args.ceiling.read_text())
    every = []
    for method_dir in args.runs:
        if not (method_dir / "metrics.jsonl").is_file():
            raise SystemExit(f"{method_dir / 'metrics.jsonl'}: missing (give a method's folder inside a run)")
        every.append(matched(ceiling, method_dir))
        show(every[-1])
    if args.out:
        args.out.write_text(json.dumps({"ceiling": str(args.ceiling), "runs": every}, indent=1))
        plot(ceiling, every, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
