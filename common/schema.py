"""A small declarative schema for scenario files.

Every field has a type, a default, optional bounds or choices and a help text; nested
sections are dicts of fields. `validate` fills defaults and raises `ConfigError` that
names the file and the dotted field path on the first unknown key, wrong type or
out-of-range value, so a bad scenario stops before anything starts.

Lives in `models/`, the package the emulator, the server and the devices all share, so a
strategy declaring its parameters does not import the scenario package.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flt.common.errors import FltError, short

REQUIRED = object()


class ConfigError(FltError, ValueError):
    """A scenario file, `--set` or `--methods` that cannot be run; names the file and field."""


INT_MAX = 2**31 - 1  # a C int: the bound of an int field without a max of its own


@dataclass
class Field:
    types: tuple | type
    default: Any = REQUIRED
    help: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    schema: dict | None = None  # a nested section
    open_min: bool = False  # min is exclusive
    rule: Callable[[Any], str | None] | None = None  # extra check: returns what was expected, or None

    def check(self, value: Any, where: str) -> Any:
        """`value` checked against this field (ints widened to float where a float is
        expected, a nested section validated); a ConfigError naming `where` if it fails."""
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{where}: must be set (got null)")
        if self.schema is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
            return validate(value, self.schema, where)
        types = self.types if isinstance(self.types, tuple) else (self.types,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            if self.choices and types == (str,):
                names = f"{names}: one of {', '.join(map(str, self.choices))}"
            hint = ""
            if isinstance(value, bool) and str in types:  # YAML 1.1: on/off/yes/no are booleans
                hint = " (YAML reads an unquoted on, off, yes or no as true/false: quote the word)"
            raise ConfigError(f"{where}: expected {names}, got {short(value)}{hint}")
        if self.choices is not None and isinstance(value, str) and value not in self.choices:
            raise ConfigError(f"{where}: {short(value)} is not one of {', '.join(map(str, self.choices))}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.min is not None and (value < self.min or (self.open_min and value == self.min)):
                raise ConfigError(f"{where}: {value} is below the minimum {'>' if self.open_min else '>='} {self.min}")
            if self.max is not None and value > self.max:
                raise ConfigError(f"{where}: {value} is above the maximum {self.max}")
            if isinstance(value, int) and self.max is None and abs(value) > INT_MAX:
                # counts reach C ints in torch, NumPy and SciPy: a larger one was a traceback mid-run
                raise ConfigError(f"{where}: {value} is out of range (at most 2^31 - 1 = {INT_MAX})")
        if self.rule is not None and (expected := self.rule(value)):
            raise ConfigError(f"{where}: expected {expected}, got {short(value)}")
        return value


def validate(data: dict, schema: dict[str, Field], where: str = "") -> dict:
    """Return data with defaults filled; raise ConfigError naming the field."""
    out = {}
    for key in data:
        if key not in schema:
            key = short(key) if not isinstance(key, str) else key[:80]
            hint = difflib.get_close_matches(key, list(schema), n=1)
            path = f"{where}.{key}" if where else key
            raise ConfigError(
                f"{path}: unknown field"
                + (f" (did you mean '{hint[0]}'?)" if hint else "")
                + f"; known fields: {', '.join(schema)}"
            )
    for key, f in schema.items():
        path = f"{where}.{key}" if where else key
        if key in data:
            out[key] = f.check(data[key], path)
        elif f.default is REQUIRED:
            raise ConfigError(f"{path}: required field is missing")
        elif f.schema is not None and not f.nullable:
            out[key] = validate({}, f.schema, path)
        else:
            out[key] = f.default
    return out


def section(schema: dict[str, Field], help: str = "", optional: bool = False) -> Field:
    """A nested mapping; an optional one is null unless the scenario gives it."""
    return Field(dict, default=None, help=help, schema=schema, nullable=optional)


@dataclass
class MethodSpec:
    """A method entry of a scenario after validation: its name and its parameters."""

    name: str
    params: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or self.name
