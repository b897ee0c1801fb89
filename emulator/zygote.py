"""The zygote: the process that local device processes are forked from.

Importing torch (a CUDA build) fills about 350 MB of anonymous memory per process:
dispatcher tables and the CUDA libraries' static data. Every device forked from one
zygote shares those pages copy-on-write instead of filling its own.

Two ways to make one:
- `Zygote.fork_here()`: the `flt` command forks itself before a run starts, after its
  imports and before any thread that could hold a lock (ZeroMQ's I/O thread, torch's
  OpenMP pool) exists. The server then shares the same pages too: one copy for the
  server, the zygote and every device.
- `Zygote.spawn()`: a fresh interpreter (`python -m flt.emulator.zygote FD`) that
  imports the device program; for callers that may have threads already (a library
  user, a test).

Protocol over a Unix socket pair, one JSON object per line:
  emulator -> zygote   {"argv": [...], "env": {...}, "log": "path"}
  zygote -> emulator   {"started": pid}, and later {"exited": pid, "code": c}
The zygote reaps its children and reports each exit code (negative: killed by that
signal, as with subprocess). It exits when the emulator's end of the socket closes;
devices watch the emulator's pid themselves and end when it has gone.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from flt.common.errors import DeviceError
from flt.common.heap import skip_triton
from flt.common.interrupts import deferred_interrupt

# what a zygote imports before it forks any device (the CLI imports them before fork_here);
# torch._dynamo: torch.func's vmap imports it on first use, 70 MB per process if not shared
PRELOAD = ("torch", "torch._dynamo", "onnxruntime", "sklearn.cluster", "flt.devices.device", "flt.devices.ops")


def preload() -> None:
    skip_triton()
    for name in PRELOAD:
        __import__(name)


class Lines:
    """Newline-delimited JSON over a stream socket, with a timeout per message."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float | None) -> dict | None:
        """The next message; None at timeout; EOFError when the other end has closed."""
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            with deferred_interrupt():  # Ctrl-C between recv and += would lose a report
                chunk = self.sock.recv(65536)
                self.buf += chunk
            if not chunk:
                raise EOFError
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# -- the zygote's side -----------------------------------------------------------------------
def serve(sock: socket.socket, how: str) -> None:
    """Fork a device for each request; report every child's exit; end at EOF. `how` the
    zygote came to be, for its process title (ps would show the emulator's command line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the emulator's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the emulator's stop (common/interrupts.py)
    from flt.devices.device import set_process_title

    set_process_title(f"flt zygote ({how} pid {os.getppid()}, forks its device processes)")
    gc.freeze()  # what exists now is shared with every device: collections must not touch it
    channel = Lines(sock)
    alive: set[int] = set()
    while True:
        try:
            request = channel.recv(0.2)
        except EOFError:
            os._exit(0)
        if request is not None:
            pid = os.fork()
            if pid == 0:
                sock.close()
                _device(request["argv"], request["env"], request["log"])
            alive.add(pid)
            channel.send({"started": pid})
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                channel.send({"exited": pid, "code": _exit_code(status)})


def _device(argv: list[str], env: dict[str, str], log: str) -> None:
    """A forked device's first steps: its own session (Ctrl-C reaches the emulator, which
    shuts devices down in order), its log file as stdout and stderr, its environment."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(env)
        from flt.devices.device import main

        code = main(argv) or 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1  # as Python's own exit
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never the parent's atexit handlers: they belong to the emulator


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the emulator's side ---------------------------------------------------------------------
class Zygote:
    def __init__(self, sock: socket.socket, pid: int, proc: subprocess.Popen | None = None):
        self.sock, self.pid, self.proc = sock, pid, proc
        self.channel = Lines(sock)
        self.codes: dict[int, int] = {}  # device pid -> exit code, once reported
        self.ended = False

    @classmethod
    def fork_here(cls) -> Zygote:
        """Fork this process into a zygote. Call it before any thread starts."""
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            try:
                serve(theirs, "a fork of")
            finally:
                os._exit(1)
        theirs.close()
        return cls(ours, pid)

    @classmethod
    def spawn(cls) -> Zygote:
        """A zygote in a fresh interpreter, for callers that may already have threads."""
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "flt.emulator.zygote", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        return cls(ours, proc.pid, proc)

    def start(self, argv: list[str], env: dict[str, str], log: str, timeout_s: float = 60.0) -> int:
        """Fork one device; its pid."""
        if self.ended:
            raise DeviceError(f"the device zygote (pid {self.pid}) has ended")
        self.channel.send({"argv": argv, "env": env, "log": log})
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._next(max(0.0, deadline - time.monotonic()))
            if msg is None and self.ended:
                raise DeviceError(f"the device zygote (pid {self.pid}) has ended")
            if msg is None:
                raise DeviceError(f"the device zygote (pid {self.pid}) did not fork a device within {timeout_s:g} s")
            if "started" in msg:
                return int(msg["started"])

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """The device's exit code, waiting up to `timeout` seconds (None: for ever); None
        while it runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.codes and not self.ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._next(left) is None:  # nothing more within the time left
                break
        if pid not in self.codes and self.ended and not _exists(pid):
            self.codes[pid] = -signal.SIGKILL  # its reaper was killed too: the code is lost
        return self.codes.get(pid)

    def _next(self, timeout: float | None) -> dict | None:
        """The next message (exit reports are recorded on the way), or None at timeout."""
        try:
            msg = self.channel.recv(timeout)
        except EOFError:  # killed from outside: devices still watch the emulator themselves
            self.ended = True
            return None
        if msg is not None and "exited" in msg:
            self.codes[int(msg["exited"])] = int(msg["code"])
        return msg

    def close(self, grace_s: float = 5.0) -> int | None:
        """Close the socket (the zygote exits at EOF); kill a zygote that has not exited
        within grace_s. Its exit code, negative when killed; None if already reaped."""
        self.sock.close()
        deadline, status = time.monotonic() + grace_s, None
        with contextlib.suppress(ChildProcessError):
            while (reaped := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    reaped = os.waitpid(self.pid, 0)
                    break
                time.sleep(0.02)
            status = _exit_code(reaped[1])
        if self.proc is not None and self.proc.returncode is None:
            self.proc.returncode = status  # reaped here: Popen must not wait for it again
        return status


if __name__ == "__main__":  # Zygote.spawn(): a fresh interpreter serving on the passed socket
    preload()
    serve(socket.socket(fileno=int(sys.argv[1])), "started by")
