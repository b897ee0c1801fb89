"""Peak server memory while a hostile peer fuzzes a run, against the same run left alone.

Each run is the quickstart (digits, 2 device processes) with FedAvg only, run in a
fresh child process through `emulator.run.run_scenario`, so the child's peak resident
memory (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) is the server's: the device
processes are its children and not counted. In the fuzzed run, tests/fuzz_peer.py
waits for round 1, then sends random and mutated frames, the crafted cases of issue 9,
200 messages under a running device's name, 1,000 updates for clients no device hosts,
three 50 MB hellos and two 2 MB frames.

    .venv/bin/python benchmarks/bench_fuzz.py                 # 10 rounds
    .venv/bin/python benchmarks/bench_fuzz.py --rounds 4      # quicker

Reports frames sent against frames the server counted (by reason), each run's peak
server memory, and whether accuracy and bytes equal the clean run's. Writes
benchmarks/results/fuzz.json (change it with --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(mode: str, out: Path, rounds: int) -> dict:
    """Child process: one run in-process (the server), fuzzed or not; its figures."""
    from flt.emulator import config
    from flt.emulator.run import run_scenario

    logging.basicConfig(level=logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config.load(
        str(REPO / "scenarios" / "quickstart.yaml"),
        [f"train.rounds={rounds}", f"devices.bind=tcp://127.0.0.1:{port}"],
        ["fedavg"],
    )
    peer = None
    if mode == "fuzz":
        peer = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "fuzz_peer.py"),
                f"tcp://127.0.0.1:{port}",
                str(out / "fuzz_report.json"),
                "--after",
                str(out / "run" / "fedavg" / "metrics.jsonl"),
            ]
        )
    run_scenario(cfg, str(out / "run"), progress=lambda line: None)
    if peer is not None and peer.wait(timeout=120) != 0:
        raise SystemExit("fuzz peer failed")
    summary = json.loads((out / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "run" / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    return {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rejected": summary["rejected"],
        "final_accuracy": summary["methods"]["fedavg"]["final_accuracy"],
        "bytes_up": summary["methods"]["fedavg"]["bytes_up"],
        "bytes_down": summary["methods"]["fedavg"]["bytes_down"],
        "rounds": [{k: r[k] for k in ("acc_mean", "bytes")} for r in rows],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fuzz.json")
    p.add_argument("--one", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one_run(a.one[0], Path(a.one[1]), a.rounds)))
        return 0
    from benchmarks.machine import machine_info

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("clean", "fuzz"):
            folder = Path(tmp) / mode
            folder.mkdir()
            res = subprocess.run(
                [sys.executable, __file__, "--rounds", str(a.rounds), "--one", mode, str(folder)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        sent = json.loads((Path(tmp) / "fuzz" / "fuzz_report.json").read_text())
    counted = runs["fuzz"]["rejected"]
    result = {
        "machine": machine_info(),
        "rounds": a.rounds,
        "messages_sent": sent["sent"],
        "frames_sent": sent["frames"],
        "messages_expected_counted": sum(sent["expected"].values()) + sent["collision"],
        "messages_over_inbound_limit": sent["not_counted"],
        "messages_counted": counted["rejected_messages"],
        "counted_by_reason": counted["rejected_reasons"],
        "rejected_bytes": counted["rejected_bytes"],
        "peak_server_rss_mb": {m: runs[m]["peak_rss_mb"] for m in runs},
        "results_equal_clean_run": all(
            runs["fuzz"][k] == runs["clean"][k] for k in ("final_accuracy", "bytes_up", "bytes_down", "rounds")
        ),
        "final_accuracy": runs["clean"]["final_accuracy"],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(
        f"messages sent {result['messages_sent']} ({result['frames_sent']} frames): "
        f"{result['messages_expected_counted']} must be counted, {result['messages_over_inbound_limit']} "
        f"are over the inbound limit; counted {result['messages_counted']}"
    )
    for reason, v in counted["rejected_reasons"].items():
        print(f"  {reason:<20} {v['messages']:>6} messages {v['bytes'] / 1e6:>9.2f} MB")
    print(
        f"peak server memory: clean {runs['clean']['peak_rss_mb']:.0f} MB, fuzzed {runs['fuzz']['peak_rss_mb']:.0f} MB"
    )
    print(f"accuracy and bytes equal the clean run's: {result['results_equal_clean_run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
