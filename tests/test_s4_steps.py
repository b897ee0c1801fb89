"""benchmarks/s4_steps.py: the SGD steps a FedAvg round makes on Scenario 4's layouts.
Its paper rows are only worth quoting if they are the sizes the FLT authors' sampler draws,
and its count is the n-weighted mean that FedAvg's average follows."""

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import fsolve

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts are not a package
import s4_steps  # noqa: E402


def authors_sizes(pool: int, per: int) -> np.ndarray:
    """The FLT authors' `emnist_noniid_cluster` rule, written out as they wrote it: F =
    floor(K / 2n), floor(F + exp(x j^2)) with x from fsolve, the remainder to client 1."""
    floor_f = np.floor(pool / 2 / per)
    j = np.arange(1, per + 1)
    x = fsolve(lambda v: np.sum(floor_f + np.exp(v * j**2)) - pool, x0=0.0)[0]
    sizes = np.floor(floor_f + np.exp(x * j**2)).astype(int)
    sizes[0] += pool - sizes.sum()
    return sizes


@pytest.mark.filterwarnings("ignore:The iteration is not making good progress")  # theirs warns too
@pytest.mark.parametrize("clients", [20, 600, 2400])
def test_paper_layouts_follow_the_authors_sampler(clients):
    got = s4_steps.paper_sizes(clients)
    assert len(got) == clients and got.sum() == 112_800  # all of EMNIST-balanced's training set
    per = clients // 10
    want = np.concatenate([authors_sizes(p, per) for p in s4_steps.EMNIST_POOLS])
    # the same sizes up to rounding (the authors give the floors' remainder to client 1, we
    # spread it): under 1 % of the images sit elsewhere, and the count quoted moves < 2 %
    assert np.abs(np.sort(got) - np.sort(want)).sum() < 0.01 * 112_800
    for epochs in (1, 5):
        assert s4_steps.weighted_steps(got, epochs, 10) == pytest.approx(
            s4_steps.weighted_steps(want, epochs, 10), rel=0.02
        )


def test_weighted_steps_follow_the_large_clients():
    equal = np.full(10, 40)
    assert s4_steps.weighted_steps(equal, 5, 10) == 20  # E x ceil(n / B) for every client
    skewed = np.array([10] * 9 + [910])  # the same 1,000 images, one client holding most
    assert s4_steps.weighted_steps(skewed, 1, 10) == pytest.approx((90 * 1 + 910 * 91) / 1000)
    assert s4_steps.weighted_steps(skewed, 1, 10) > 10 * np.median(np.ceil(skewed / 10))
