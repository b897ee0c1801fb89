"""benchmarks/fcr_cuts.py's exact permutation rank, which benchmarks/README.md quotes for
the quality suite's misses: the share of all relabellings of two groups of clients whose
between-means distance reaches the observed split's."""

import sys
from pathlib import Path

import numpy as np
from scipy.spatial.distance import cdist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import fcr_cuts  # noqa: E402


def squared_distances(n_left: int, n_right: int, gap: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_left + n_right, 8))
    x[n_left:, 0] += gap  # the right group shifted along one axis
    return cdist(x, x, "sqeuclidean")


def test_a_separated_split_is_the_most_extreme_of_all_relabellings():
    sq = squared_distances(4, 4, gap=20.0)
    share, count = fcr_cuts.exact_rank(sq, np.arange(4), np.arange(4, 8))
    assert count == 70  # C(8, 4): the split and its mirror both count
    assert share == 2 / 70
    share, count = fcr_cuts.exact_rank(squared_distances(3, 5, gap=20.0), np.arange(3), np.arange(3, 8))
    assert (share, count) == (1 / 56, 56)


def test_a_wrong_split_of_separated_groups_is_not_extreme():
    sq = squared_distances(4, 4, gap=20.0)
    share, _ = fcr_cuts.exact_rank(sq, np.array([0, 1, 2, 4]), np.array([3, 5, 6, 7]))  # one client swapped
    assert share > 2 / 70
