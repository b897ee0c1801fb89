"""`flt` commands forked from a warm interpreter: the tests' many short runs without
paying the interpreter's start each time.

A fresh `python -m flt.emulator.cli run ...` spends about 7 s of a 2-core machine importing
torch, torch._dynamo, onnxruntime and scikit-learn: the modules the command preloads
before its first device process so that every device shares their pages
(emulator/zygote.py). The tests run the command dozens of times. This server
imports those same modules once, then forks one child per command. Each child is its own
OS process, with its own pid, working folder, environment, stdin (/dev/null), stdout and
stderr (files the caller reads), that runs the command's `main()` and exits as
`python -m flt.emulator.cli` would: its atexit handlers run, an uncaught exception prints
its traceback and exits 1. It skips only the C libraries' static destructors
(os._exit): onnxruntime's wait for its thread pool, which a forked child does not have,
and would hang. What the child runs is what the command runs after its own preload.

Tests that signal or kill the command, or read it while it runs, start
`python -m flt.emulator.cli` fresh (flt_command.flt_popen); tests/test_install.py imports
the command in a fresh interpreter outside the repository.

Protocol over a Unix socket, one JSON object per line, one connection per command:
  test -> server   {"argv": [...], "cwd": "...", "env": {...}, "stdout": path, "stderr": path}
  server -> test   {"pid": pid}, then {"code": exit code} (negative: killed by that signal)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import sys


def serve(path: str) -> dict:
    """Accept commands until the parent (pytest) has gone. Returns only in a forked
    child: the request that child is to run."""
    from flt.emulator.zygote import preload

    preload()
    import flt.emulator.cli  # noqa: F401  (the command's own module, loaded as `-m` would)

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("rb").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for sock in (listener, conn, *children.values()):
                    sock.close()
                return request
            reply(conn, {"pid": pid})
            children[pid] = conn
        for pid, conn in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply(conn, {"code": os.waitstatus_to_exitcode(status)})
                conn.close()
                del children[pid]
    sys.exit(0)


def reply(conn: socket.socket, message: dict) -> None:
    """A line to the test; gone (a test that timed out and killed its command) is fine."""
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def finish(request: dict) -> None:
    """In the forked child: the command, then the interpreter's exit without the C
    libraries' destructors."""
    code = 1
    try:
        code = command(request) or 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def command(request: dict) -> int:
    """The caller's folder, environment and output files, then the command itself."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    redirect = [(0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY), (2, request["stderr"], os.O_WRONLY)]
    for fd, path, mode in redirect:
        opened = os.open(path, mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    from flt.emulator import cli

    sys.argv = [cli.__file__, *request["argv"]]
    return cli.main(request["argv"])


if __name__ == "__main__":
    finish(serve(sys.argv[1]))
