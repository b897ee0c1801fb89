"""Who takes part in a round: participation sampling over the clients present.

The draw for round t depends only on (seed, t, the clients present), so every method
of a run sees the same participation draws.
"""
from __future__ import annotations

import numpy as np


class Population:
    def __init__(self, n_clients: int, rho: float, seed: int):
        self.n_clients, self.rho, self.seed = n_clients, rho, seed

    def candidates(self, rnd: int) -> np.ndarray:
        return np.arange(self.n_clients)

    def select(self, rnd: int, candidates: np.ndarray) -> np.ndarray:
        if len(candidates) == 0:
            return candidates
        k = max(1, int(round(self.rho * len(candidates))))
        rng = np.random.default_rng([self.seed, rnd, 0xF1])
        return np.sort(rng.choice(candidates, size=k, replace=False))

    def before_round(self, rnd: int, fed, strategy) -> list[dict]:
        return []

    def close_round(self, rnd: int, results: dict, fed) -> tuple[dict, dict]:
        return results, {}
