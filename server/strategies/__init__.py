"""Registry of federated methods: scenario files and summary.json use these names.

Importing it is light: `STRATEGIES[name]` imports a strategy's module (torch, scikit-learn)
the first time a run asks for it, and a scenario is validated against
server/strategies/params.py alone, before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from flt.server.strategies.params import METHODS


class _Strategies(Mapping):
    """name -> strategy class, each imported on first use."""

    def __getitem__(self, name: str) -> type:
        method = METHODS[name]
        return getattr(importlib.import_module(method.module), method.cls)

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)


STRATEGIES = _Strategies()
