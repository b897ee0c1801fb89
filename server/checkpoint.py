"""Checkpoints without pickle: nested plain values as JSON, arrays and tensors as members
of one .npz, written atomically (a kill leaves the previous checkpoint or the new one).

`pack` turns a value into JSON plus arrays: None, bool, int, float, str, lists, tuples,
sets and dicts (any hashable keys) of those, numpy arrays and scalars, torch tensors,
numpy and torch random generators (their exact state), paths, and objects of this
project's own classes (by their attributes). Anything else is refused with its path, so
a strategy that grows an attribute of a foreign type fails loudly at its first
checkpoint instead of resuming wrong. Loading imports only this project's classes and
never unpickles.
"""

from __future__ import annotations

import importlib
import json
import numbers
import zipfile
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from flt.common.errors import FltError, short
from flt.common.files import save_npz_atomic

PROJECT = "flt"  # checkpoints name only classes of this package
# what `pack` makes and `unpack` reads: a JSON document (tagged objects are dicts)
Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]
_STATE = "__state__"


class CheckpointError(TypeError):
    """A value that cannot be stored without pickle; the text names where it is."""


def save(path: Path, state: dict) -> None:
    arrays: dict[str, np.ndarray] = {}
    doc = json.dumps(pack(state, arrays, "state")).encode()
    save_npz_atomic(Path(path), **arrays, **{_STATE: np.frombuffer(doc, dtype=np.uint8)})


class DamagedCheckpoint(FltError):
    """A checkpoint file that is missing, cut short or altered: the run cannot resume from
    it, and the message says what to delete to run that method again."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"{path}: damaged checkpoint ({reason}); delete its folder {path.parent} to run that method "
            "again from round 0 (the other methods' results stay)"
        )


def load(path: Path, device: torch.device | str = "cpu") -> dict:
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return unpack(json.loads(arrays.pop(_STATE).tobytes()), arrays, torch.device(device))
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, CheckpointError) as exc:
        raise DamagedCheckpoint(Path(path), short(str(exc) or type(exc).__name__, 120)) from None


def pack(value: object, arrays: dict[str, np.ndarray], where: str) -> Json:
    """JSON-able form of `value`; arrays and tensors go into `arrays`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [pack(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [pack(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [pack(v, arrays, f"{where}{{}}") for v in value]}
    if isinstance(value, dict):
        return {
            "$dict": [[pack(k, arrays, f"{where} key"), pack(v, arrays, f"{where}[{k!r}]")] for k, v in value.items()]
        }
    if isinstance(value, (np.ndarray, np.generic)):
        return {"$array" if isinstance(value, np.ndarray) else "$scalar": _store(arrays, np.asarray(value))}
    if isinstance(value, torch.Tensor):
        return {"$tensor": _store(arrays, value.detach().cpu().numpy())}
    if isinstance(value, np.random.Generator):
        return {"$np_rng": pack(value.bit_generator.state, arrays, where)}
    if isinstance(value, torch.Generator):
        return {"$torch_rng": _store(arrays, value.get_state().numpy())}
    if isinstance(value, PurePath):
        return {"$path": str(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if type(value).__module__.split(".")[0] == PROJECT and hasattr(value, "__dict__"):
        cls = type(value)
        return {"$object": f"{cls.__module__}:{cls.__qualname__}", "vars": pack(vars(value), arrays, where)}
    raise CheckpointError(
        f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
        f"checkpointed (store it as arrays or plain values)"
    )


def _store(arrays: dict[str, np.ndarray], arr: np.ndarray) -> str:
    if arr.dtype.hasobject:
        raise CheckpointError("object arrays cannot be checkpointed")
    key = f"a{len(arrays)}"
    arrays[key] = arr
    return key


def unpack(node: Json, arrays: dict[str, np.ndarray], device: torch.device) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [unpack(v, arrays, device) for v in node]
    body: Any  # what a tag holds depends on the tag: an array's key, a list, a class name
    (tag, body), *rest = node.items()
    if tag == "$tuple":
        return tuple(unpack(v, arrays, device) for v in body)
    if tag == "$set":
        return {unpack(v, arrays, device) for v in body}
    if tag == "$dict":
        return {unpack(k, arrays, device): unpack(v, arrays, device) for k, v in body}
    if tag == "$array":
        return arrays[body]
    if tag == "$scalar":
        return arrays[body][()]
    if tag == "$tensor":
        return torch.from_numpy(arrays[body].copy()).to(device)
    if tag == "$np_rng":
        state = unpack(body, arrays, device)
        np_gen = np.random.Generator(getattr(np.random, state["bit_generator"])())
        np_gen.bit_generator.state = state
        return np_gen
    if tag == "$torch_rng":
        torch_gen = torch.Generator()
        torch_gen.set_state(torch.from_numpy(arrays[body].copy()))
        return torch_gen
    if tag == "$path":
        return Path(body)
    if tag == "$device":
        return torch.device(body)
    if tag == "$object":
        cls: Any = _project_class(body)  # Any: type's own __new__ overloads would not fit
        obj = cls.__new__(cls)
        obj.__dict__.update(unpack(rest[0][1], arrays, device))
        return obj
    raise CheckpointError(f"unknown checkpoint tag {tag!r}")


def _project_class(name: str) -> type[Any]:
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != PROJECT:
        raise CheckpointError(f"checkpoint names class {name!r} outside this project")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise CheckpointError(f"checkpoint names {name!r}, which is not a class")
    return obj


def restore_vars(obj: object, state: dict[str, Any]) -> None:
    """Put saved attributes back on a live object. A dict attribute is refilled in place,
    so a defaultdict keeps its default factory; so is a nested object of the same class
    (frozen dataclasses included: the saved values are the object's own)."""
    for name, value in state.items():
        current = getattr(obj, name, None)
        if problem := unlike(current, value):
            raise CheckpointError(f"{type(obj).__name__}.{name}: {problem}")
        if (
            type(current) is type(value)
            and type(value).__module__.split(".")[0] == PROJECT
            and hasattr(value, "__dict__")
        ):
            restore_vars(current, vars(value))
        elif isinstance(current, dict) and isinstance(value, dict):
            current.clear()
            current.update(value)
        else:
            object.__setattr__(obj, name, value)


def unlike(current: object, value: object) -> str | None:
    """How a saved value does not fit the freshly built attribute it replaces, or None.
    An altered file can hold any JSON: a model of another size or a round count that is
    text would otherwise fail later, mid-round, or train nothing without a word. A tensor
    keeps its kind, dtype, rank and last dimension (the parameter count, or the clients
    of a mask; the count of cluster models may change); a number stays a number, a text
    text, a container a container of its kind. An empty array (PACFL's adjacency before its
    one exchange) only keeps its dtype and rank."""
    if current is None or value is None:
        return None
    arrays = (np.ndarray, torch.Tensor)
    if isinstance(current, arrays):
        if type(value) is not type(current):
            return f"expected a {type(current).__name__}, found {type(value).__name__}"
        assert isinstance(value, arrays)
        placeholder = current.numel() == 0 if isinstance(current, torch.Tensor) else current.size == 0
        last = placeholder or value.shape[-1:] == current.shape[-1:]  # an empty one is filled in later
        if value.dtype != current.dtype or value.ndim != current.ndim or not last:
            want = f"(..., {current.shape[-1]})" if current.ndim else "()"
            dtype = str(current.dtype).removeprefix("torch."), str(value.dtype).removeprefix("torch.")
            return f"expected {dtype[0]} of shape {want}, found {dtype[1]} {tuple(value.shape)}"
        return None
    if isinstance(current, (bool, np.bool_)):
        return None if isinstance(value, (bool, np.bool_)) else f"expected a bool, found {type(value).__name__}"
    if isinstance(current, numbers.Real):  # a count may be saved as NumPy's, a time as an int
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        return None if ok else f"expected a number, found {type(value).__name__}"
    if isinstance(current, (str, list, tuple, dict, set)):
        kind = next(k for k in (str, list, tuple, dict, set) if isinstance(current, k))
        return None if isinstance(value, kind) else f"expected a {kind.__name__}, found {type(value).__name__}"
    return None
