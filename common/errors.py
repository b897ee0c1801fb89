"""The project's user-facing errors: one base class the CLI catches.

Anything that derives from :class:`FltError` is a mistake in the user's input or a
problem in their environment; the CLI prints it as one line (`error: ...`) and exits
with its `exit_code`. Every other exception is a bug and keeps its traceback (exit 1).
Lives in `scenarios/` because the emulator, the server and the devices all import it.
"""

from __future__ import annotations

# Longest slice of a user's value that an error message repeats: a YAML alias bomb
# expands to gigabytes, and its repr must never be built in full.
ECHO_CHARS = 80


class FltError(Exception):
    """A mistake in the input (scenario, data, `--set`): exit code 2."""

    exit_code = 2


class DeviceError(FltError):
    """The environment failed the run: devices that did not connect, could not load their
    data, or were all lost mid-run; the server out of memory. Exit code 3, so scripts can
    tell it from a mistake in the input."""

    exit_code = 3


def short(value: object, limit: int = ECHO_CHARS) -> str:
    """repr(value), cut to `limit` characters without building the whole repr of a huge
    container (an alias bomb's repr would take gigabytes)."""
    text = _bounded_repr(value, limit + 1)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_repr(value: object, budget: int) -> str:
    """A repr of at most about `budget` characters: containers are walked item by item
    and the walk stops as soon as the budget is spent."""
    if isinstance(value, (list, tuple, dict, set)):
        brackets = {list: "[]", tuple: "()", dict: "{}", set: "{}"}.get(type(value), "[]")
        opener, closer = brackets[0], brackets[1]
        items = value.items() if isinstance(value, dict) else value
        out, used = [opener], 1
        for item in items:
            if used >= budget:
                out.append("...")
                break
            if isinstance(value, dict):
                k, v = item
                part = _bounded_repr(k, budget - used) + ": " + _bounded_repr(v, budget - used)
            else:
                part = _bounded_repr(item, budget - used)
            out.append(part if len(out) == 1 else ", " + part)
            used += len(out[-1])
        out.append(closer)
        return "".join(out)
    if isinstance(value, (str, bytes)) and len(value) > budget:
        value = value[:budget]
    return repr(value)
