"""The `flt` command line."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable

from flt.common.errors import DeviceError, FltError, short
from flt.common.heap import limit_heap_retention
from flt.common.interrupts import stopped
from flt.reports.terminal import end_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flt", description="Federated-learning edge emulator for non-IID data (FLT and baselines)."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a scenario file")
    _scenario_args(run, optional=True)
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a killed run from its last checkpoint (its config.yaml and "
        "partition.npz; finished methods are kept)",
    )

    cmp_ = sub.add_parser("compare", help="run several methods on the same partition, weights and draws")
    _scenario_args(cmp_)
    cmp_.add_argument(
        "--methods",
        required=True,
        help="comma-separated method names or entry labels, e.g. fedavg,flt_enc1,ifca "
        "(a name picks every entry of that method)",
    )

    rel = sub.add_parser(
        "relate", help="FCR alone: embed every client over ZeroMQ and cluster them, no training rounds"
    )
    _scenario_args(rel)
    rel.add_argument(
        "--method",
        help="the scenario's FCR entry to use, by label (default: its first "
        "FLT or PCA+kM+HC entry, else FLT's defaults)",
    )
    rel.add_argument(
        "--no-umap",
        action="store_true",
        help="skip the UMAP figure (numba compiles UMAP the first time: seconds to minutes)",
    )

    suite = sub.add_parser(
        "suite",
        help="run many scenarios one after another, one folder each; "
        "run it again to skip the finished ones and resume an interrupted one",
    )
    suite.add_argument(
        "scenarios", nargs="+", metavar="FILE_OR_DIR", help="scenario files, or folders of them (*.yaml, in name order)"
    )
    suite.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field in every scenario, e.g. --set train.rounds=5 (repeatable)",
    )
    suite.add_argument(
        "--out", default="runs/suite", help="where the scenario folders go, OUT/<scenario name> (default runs/suite)"
    )

    rep = sub.add_parser("report", help="one self-contained HTML page (and Markdown and CSV tables) from run folders")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, or folders of them (a suite's --out)")
    rep.add_argument(
        "--out",
        help="folder for report.html, report.md and *.csv (default RUN_DIR/report for one run folder, else ./report)",
    )

    dev = sub.add_parser("device", help="run a device process by hand against a server address")
    dev.add_argument("--connect", required=True, help="server address, e.g. tcp://HOST:5555")
    dev.add_argument("--name", help="device id (default host-pid); unique per server")
    dev.add_argument("--data-root", help="where this host keeps the dataset")
    dev.add_argument("--threads", type=int, default=1)
    dev.add_argument("--key", help="this device's NAME.key_secret from `flt keys` (CURVE; names the device)")
    dev.add_argument("--server-key", help="the server's server.key from `flt keys`")

    keys_ = sub.add_parser("keys", help="make CURVE key pairs: the server's and devices' (devices.keys: DIR)")
    keys_.add_argument("dir", help="folder for the key files (created, mode 0700)")
    keys_.add_argument("--devices", type=int, default=0, help="new device key pairs to add (default 0)")
    keys_.add_argument("--prefix", default="edge", help="device names PREFIX-0, PREFIX-1, ... (default edge)")

    args = parser.parse_args(argv)
    limit_heap_retention()  # the server lives for the whole run too (common/heap.py)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # recorded in each run folder
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # a device: its own
    if args.cmd == "device":
        return stoppable(lambda: _device(args), "the device left its server")
    if args.cmd == "keys":
        return guarded(lambda: _keys(args))
    if args.cmd == "report":
        return stoppable(lambda: guarded(lambda: _report(args)), "the report is unfinished; run the command again")
    from flt.common.interrupts import stop_on_sigterm

    stop_on_sigterm()  # the device zygote puts the default back for itself and its devices
    try:
        # _run and _suite answer a stop once their work begins; before that, what they import
        # takes seconds too, and a stop there has computed nothing
        return stoppable(
            lambda: _start(args) or (_suite(args) if args.cmd == "suite" else _run(args)),
            "nothing was computed (the command was starting)",
        )
    finally:  # done: a SIGTERM while the process exits ends it, not a traceback in an atexit handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start(args) -> int:
    """run, compare, relate, suite: check the scenario, then make this process its devices'
    template. A mistake in the scenario or a --set answers first, before torch,
    scikit-learn and the device zygote are loaded (benchmarks/bench_validation.py: well
    under a second); then devices are forked from a copy of this process made now, before
    any thread exists, so that torch's pages are shared (emulator/zygote.py)."""
    validates = args.cmd in ("run", "compare", "relate") and args.scenario and not getattr(args, "resume", None)
    if validates and (code := guarded(lambda: _validate(args))):
        return code
    from flt.emulator.processes import fork_here

    fork_here()
    return 0


def _device(args) -> int:
    from flt.common.keys import Credentials
    from flt.common.wire import endpoint_problem

    creds: list = []

    def check() -> None:  # before the socket: a bad address was a ZeroMQ traceback
        if problem := endpoint_problem(args.connect, listen=False):
            raise FltError(f"--connect: expected {problem}, got {short(args.connect)}")
        if not 1 <= args.threads <= 1024:  # as devices.threads: 10^20 was torch's overflow traceback
            raise FltError(f"--threads: 1 to 1,024, got {args.threads}")
        creds.append(Credentials.load(args.key, args.server_key))

    if code := guarded(check):
        return code
    from flt.devices.device import Device, prepare_process  # torch: after the answer to a typo

    prepare_process()  # as `python -m flt.devices` does: without it, a device by hand printed nothing
    return Device(args.connect, args.name, args.data_root, args.threads, credentials=creds[0]).run()


def _keys(args) -> None:
    """Make the key files; print where they are, never a secret key."""
    from pathlib import Path

    from flt.common.keys import make_keys

    folder = Path(args.dir)
    names = make_keys(folder, args.devices, args.prefix)
    print(f"{folder}: server.key_secret stays on the server (devices.keys: {folder})")
    for name in names:
        print(
            f"  {name}: give {folder / (name + '.key_secret')} and {folder / 'server.key'} to that host, "
            f"then: flt device --connect tcp://SERVER:PORT --key {name}.key_secret --server-key server.key"
        )
    print("to revoke a device, delete its NAME.key from the folder (the server reads it at start)")


def _report(args) -> None:
    from pathlib import Path

    from flt.reports.html import build

    dirs = [Path(d) for d in args.run_dirs]
    out = Path(args.out) if args.out else dirs[0] / "report" if len(dirs) == 1 else Path("report")
    page = build(dirs, out)
    print(f"{page} (tables: {out / 'report.md'}, {out}/*.csv)")


def _suite(args) -> int:
    """`flt suite`: the exit code of the first scenario that failed, 130 on Ctrl-C."""
    from pathlib import Path

    from flt.emulator import suite
    from flt.reports import summary as report

    report.COMMAND = args.argv
    codes: list[int] = []
    again = f"run the same command again to resume ({args.out})"
    code = stoppable(
        lambda: guarded(
            lambda: codes.append(suite.run_suite([Path(p) for p in args.scenarios], args.set, Path(args.out))),
            again,
        ),
        again,
    )
    return code or (codes[0] if codes else 0)


def _scenario_args(p, optional: bool = False):
    p.add_argument("scenario", nargs="?" if optional else None, help="scenario YAML file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set train.rounds=5 (repeatable)",
    )
    p.add_argument("--out", help="run folder (default: <output>/<name>-<time>)")


def _validate(args) -> None:
    """The scenario file with its --set overrides (and compare's --methods), validated."""
    from flt.emulator import config

    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.cmd == "compare" else None
    args.cfg = config.load(args.scenario, args.set, methods)


def _run(args) -> int:
    from flt.emulator.run import run_scenario
    from flt.reports import summary as report
    from flt.reports.terminal import Display

    report.COMMAND = args.argv
    terminal = Display().install()  # bars for rounds and pretraining on a terminal
    action: Callable[[], object]  # a run folder's Path, or None
    if args.cmd == "relate":
        from flt.emulator.relate import relate_scenario

        action = lambda: relate_scenario(args.cfg, args.out, args.method, umap=not args.no_umap)  # noqa: E731
    elif args.cmd == "run" and args.resume:
        action = lambda: _resume(args)  # noqa: E731
    elif args.scenario is None:
        print("error: a scenario file, or --resume RUN_DIR, is needed", file=sys.stderr)
        return 2
    else:
        action = lambda: run_scenario(args.cfg, args.out, progress=terminal)  # noqa: E731
    try:
        return guarded(action)
    except KeyboardInterrupt as stop:
        said = f"{stopped(stop)}: `flt relate` has nothing to resume; run it again" if args.cmd == "relate" else None
        print(end_line() + (said or stop_line(stop)), file=sys.stderr)
        return exit_code(stop)


def stop_line(stop: KeyboardInterrupt) -> str:
    """Where a stopped run's results are, and how to continue it; or that it stopped before
    its folder could be resumed (the data was loading, nothing was computed)."""
    run_dir = getattr(stop, "run_dir", None)
    if run_dir is None:
        return f"{stopped(stop)} before the run folder was ready: nothing to resume; run the command again"
    return f"{stopped(stop)}: results so far are in {run_dir}; `flt run --resume {run_dir}` continues the run"


def _resume(args) -> None:
    """`flt run --resume RUN_DIR`: the folder's own config.yaml and partition, nothing else
    (a scenario or --set would make it another run)."""
    from pathlib import Path

    from flt.common.schema import ConfigError
    from flt.emulator import config
    from flt.emulator.run import run_scenario
    from flt.reports.terminal import active

    run_dir = Path(args.resume)
    if args.scenario or args.set or args.out:
        raise ConfigError("--resume continues a run with its own config.yaml: give no scenario, --set or --out")
    for name in ("config.yaml", "partition.npz", "public_indices.npy"):
        if not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir}: no {name}; not a run folder that can be resumed")
    saved = config.load(str(run_dir / "config.yaml"), [], saved=True)
    run_scenario(saved, str(run_dir), resume=True, progress=active())


def stoppable(command: Callable[[], int], said: str) -> int:
    """The command's exit code; on Ctrl-C or SIGTERM, one line (`said`) instead of a
    traceback, and the shell's code for the signal."""
    try:
        return command()
    except KeyboardInterrupt as stop:
        print(f"{end_line()}{stopped(stop)}: {said}", file=sys.stderr)
        return exit_code(stop)


def exit_code(stop: KeyboardInterrupt) -> int:
    """The shell's code for a process ended by the signal: 128 + SIGTERM or SIGINT."""
    return 143 if stopped(stop) == "terminated" else 130


def guarded(action: Callable[[], object], again: str | None = None) -> int:
    """Run a command. The project's own errors (input mistakes, devices that failed) and
    running out of memory or disk (the machine's fault, not a bug) print one line and exit
    with their code; anything else is a bug and keeps its traceback. `again`: how to go on
    after the machine's fault, where it is not `flt run --resume` of the run's folder."""
    try:
        action()
    except FltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if gone := removed_run_dir(exc):  # a write that found it gone before the round's check did
            from flt.common.files import folder_removed

            print(f"error: {folder_removed(gone)}", file=sys.stderr)
            return DeviceError.exit_code
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"error: the disk is full (writing {exc.filename or 'a file'}); {then_resume(exc, 'free space', again)}",
            file=sys.stderr,
        )
        return DeviceError.exit_code
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fix = "free memory (on a shared GPU, run fewer jobs at once)"
        print(
            f"error: the server ran out of memory ({short(what, 240)}); {then_resume(exc, fix, again)}", file=sys.stderr
        )
        return DeviceError.exit_code
    return 0


def removed_run_dir(exc: OSError) -> str | None:
    """The run folder `exc` names (emulator/run.py), where the error is that it is gone:
    deleted by hand mid-run, with every result and checkpoint in it."""
    run_dir = getattr(exc, "run_dir", None)
    missing = exc.errno == errno.ENOENT and run_dir is not None and not os.path.isdir(run_dir)
    return str(run_dir) if missing else None


def then_resume(exc: BaseException, fix: str, again: str | None = None) -> str:
    """What a run stopped by the machine (`exc`: no disk or memory left) leaves, and how to
    go on: `again`, or the folder it names (emulator/run.py), or, before that existed, the
    command again."""
    run_dir = getattr(exc, "run_dir", None)
    if again:
        return f"{fix}, then {again}"
    if run_dir is None:
        return f"{fix}, then run the command again (no run folder was ready to resume)"
    return f"the rounds so far are in {run_dir}: {fix}, then `flt run --resume {run_dir}`"


def out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's (CUDA) OutOfMemoryError where torch is loaded."""
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError))


if __name__ == "__main__":
    sys.exit(main())
