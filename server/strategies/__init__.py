"""Registry of federated methods: scenario files and summary.json use these names.

Importing it is light: `STRATEGIES[name]` imports a strategy's module (torch, scikit-learn)
the first time a run asks for it, and a scenario is validated against
server/strategies/params.py alone, before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from flt.server.strategies.params import METHODS

if TYPE_CHECKING:  # a type only: importing base loads torch
    from flt.server.strategies.base import Strategy


class _Strategies(Mapping[str, "type[Strategy]"]):
    """name -> strategy class, each imported on first use."""

    def __getitem__(self, name: str) -> type[Strategy]:
        method = METHODS[name]
        return getattr(importlib.import_module(method.module), method.cls)

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)


STRATEGIES = _Strategies()
