"""One exchange between the server and a set of clients, as a strategy sees it.

`Federation.exchange` (server/federation.py) is the one path every exchange takes; what
it hands back is an `Exchange`. This module holds only the types, so strategies can name
them without importing the round loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from flt.common.wire import Message

R = TypeVar("R")
T = TypeVar("T")
# (message sent, reply) -> (samples the client ran forward, samples it trained on)
Work = Callable[[Message, Message], tuple[float, float]]


class ExchangeClock(Protocol):
    """What prices an exchange: the emulator's population (device profiles, deadline,
    stragglers). Returns the clients whose replies count and the clock's report."""

    def price(
        self,
        kind: str,
        clients: np.ndarray,
        bytes_down: np.ndarray,
        bytes_up: np.ndarray,
        forward_samples: np.ndarray,
        trained_samples: np.ndarray,
    ) -> tuple[np.ndarray, dict]: ...


@dataclass
class Call:
    """What one client's device is asked to run: tensors down and settings (a device op's
    task, server/ops.py builds the message)."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class Reply:
    """What one client's device answered, checked by its op's check before a strategy sees it."""

    tensors: dict[str, np.ndarray]
    meta: dict


@dataclass
class Exchange(Generic[R]):
    """One exchange: every reply that arrived, decoded (`results`); the clients whose
    replies count once the clock has dropped stragglers and dropouts (`kept`, in finishing
    order); its report (kind, round, clients asked, replies, bytes by direction and kind,
    and with device profiles `duration_s` and the clock after it, `emulated_s`)."""

    results: dict[int, R]
    kept: list[int]
    report: dict

    def counted(self) -> dict[int, R]:
        return {c: self.results[c] for c in self.kept}

    @property
    def bytes(self) -> int:
        """Bytes on the wire, payload and overhead, both directions."""
        return sum(b for kinds in self.report["bytes"].values() for b in kinds.values())

    def decoded(self, decode: Callable[[R], T]) -> Exchange[T]:
        """The same exchange with every reply turned into what the caller wants. Each raw
        reply leaves this exchange as it is decoded, so that the raw and the decoded form
        of a large exchange (FedGroup's 100 pre-trained CNNs: 2.6 GB each way) are never
        both held whole; this exchange is empty afterwards."""
        raw, self.results = self.results, {}
        return Exchange({c: decode(raw.pop(c)) for c in list(raw)}, self.kept, self.report)
