"""FLT: FCR through the real CLI and device processes, its byte counts, and the
server-side pieces (Case I aggregation, vectorized adjacency, Ward clustering) by hand."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.spatial.distance import cdist
from sklearn.metrics import adjusted_rand_score

from emulator.config import parse_methods
from server import fcr
from server.strategies.base import Context, Result, weighted_average
from server.strategies.fedavg import FedAvg
from server.strategies.flt import FLT

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
CLIENTS = 20


def flt(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "emulator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


# -- FCR end to end: the quickstart's fedavg + flt over two device processes --------------

@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("flt-quickstart")
    res = flt("run", str(QUICKSTART), "--set", "train.rounds=3", "--set", "devices.processes=2",
              "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    return out, json.loads((out / "summary.json").read_text())


def test_fcr_recovers_the_planted_clusters_on_digits(quickstart_run):
    _, s = quickstart_run
    f = s["methods"]["flt"]["fcr"]
    assert f["ari"] == 1.0, f
    assert f["nmi"] == 1.0, f
    assert f["clusters"] == 5
    assert f["cluster_sizes"] == [4, 4, 4, 4, 4]


def test_flt_beats_fedavg_on_clustered_clients(quickstart_run):
    _, s = quickstart_run
    m = s["methods"]
    assert m["flt"]["rounds"] == m["fedavg"]["rounds"] == 3
    assert m["flt"]["final_accuracy"] > m["fedavg"]["final_accuracy"], (
        m["flt"]["final_accuracy"], m["fedavg"]["final_accuracy"])


def test_flt_run_folder_holds_fcr_figures_and_arrays(quickstart_run):
    out, _ = quickstart_run
    for name in ("adjacency.png", "dendrogram.png", "umap.png", "fcr.npz", "metrics.jsonl"):
        assert (out / "flt" / name).is_file(), name
    with np.load(out / "flt" / "fcr.npz") as z:
        assert z["adjacency"].shape == (CLIENTS, CLIENTS)
        assert z["labels"].shape == (CLIENTS,)
        np.testing.assert_array_equal(np.diag(z["adjacency"]), 0.0)  # a client's points vs themselves
        np.testing.assert_allclose(z["adjacency"], z["adjacency"].T)


def test_onnx_encoder_bytes_are_counted_once_per_client(quickstart_run):
    _, s = quickstart_run
    m = s["methods"]["flt"]
    f = m["fcr"]
    pay = m["bytes_payload"]
    assert f["encoder_bytes"] > 0
    assert pay["down"]["encoder"] == CLIENTS * f["encoder_bytes"]
    assert pay["up"]["encoder"] == 0
    assert f["latent"] == 128
    assert pay["up"]["embedding"] == f["centroids_sent"] * 128 * 4
    assert CLIENTS <= f["centroids_sent"]  # at least one centroid per client (k: auto)
    # M*W_enc + k*M*e + 2*rho*M*W_local*T, with rho*M*T the selections made
    assert m["selections"] == 0.5 * CLIENTS * 3
    expected = (CLIENTS * f["encoder_bytes"] + f["centroids_sent"] * 128 * 4
                + 2 * m["selections"] * m["model_bytes"])
    assert m["expected"]["bytes"] == expected
    assert pay["up"]["model"] + pay["down"]["model"] == 2 * m["selections"] * m["model_bytes"]
    assert m["bytes_vs_formula"] == 1.0


# -- Case I aggregation, server side only ----------------------------------------------

M, P = 10, 50
SELECTED = [1, 3, 4, 7, 8]


def make_ctx(tmp_path) -> Context:
    g = torch.Generator().manual_seed(0)
    return Context(init=torch.randn(P, generator=g), n_clients=M,
                   n_train=np.random.default_rng(0).integers(20, 200, M), device=torch.device("cpu"),
                   seed=0, run_dir=tmp_path, truth=-np.ones(M, dtype=np.int64),
                   train={"rounds": 1, "participation": 0.5}, scenario={"name": "hand"})


def case1(ctx: Context, graph: np.ndarray) -> FLT:
    params = parse_methods([{"name": "flt", "aggregation": "case1"}])[0].params
    s = FLT(ctx, **params)
    s.graph = graph.astype(np.float32)
    s.models = s.on(ctx.init.clone())[None].expand(M, -1).clone()
    return s


def results_for(clients, seed=1) -> dict[int, Result]:
    g = torch.Generator().manual_seed(seed)
    n = np.random.default_rng(seed).integers(5, 100, len(clients))
    return {c: Result(torch.randn(P, generator=g), int(k), {}) for c, k in zip(clients, n)}


def test_case1_with_all_ones_graph_is_fedavg(tmp_path):
    ctx = make_ctx(tmp_path)
    s = case1(ctx, np.ones((M, M)))
    results = results_for(SELECTED)
    s.aggregate(1, results)
    avg = weighted_average(torch.stack([results[c].model for c in SELECTED]),
                           torch.tensor([float(results[c].n) for c in SELECTED]))
    fedavg = FedAvg(ctx)
    fedavg.aggregate(1, results)
    assert s.models.shape == (M, P)
    for m in range(M):  # selected or not: every client gets the global model
        torch.testing.assert_close(s.models[m], avg, atol=1e-6, rtol=0)
        torch.testing.assert_close(s.models[m], fedavg.global_model, atol=1e-6, rtol=0)
    models, rows = s.eval_models(np.arange(M))
    np.testing.assert_array_equal(rows, np.arange(M))


def test_case1_with_identity_graph_is_local(tmp_path):
    ctx = make_ctx(tmp_path)
    s = case1(ctx, np.eye(M))
    before = s.models.clone()
    results = results_for(SELECTED)
    s.aggregate(1, results)
    for m in range(M):
        if m in results:
            torch.testing.assert_close(s.models[m], results[m].model, atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(s.models[m], before[m], atol=0, rtol=0)
    # a second round builds on each client's own model, never on another's
    results2 = results_for([0, 1], seed=2)
    s.aggregate(2, results2)
    torch.testing.assert_close(s.models[1], results2[1].model, atol=1e-6, rtol=0)
    torch.testing.assert_close(s.models[3], results[3].model, atol=1e-6, rtol=0)
    torch.testing.assert_close(s.models[2], before[2], atol=0, rtol=0)


def test_case1_with_soft_weights_matches_a_hand_computation(tmp_path):
    ctx = make_ctx(tmp_path)
    rng = np.random.default_rng(3)
    pts = rng.normal(size=(M, 2))
    graph = fcr.soft_weights(cdist(pts, pts), gamma=1.0).astype(np.float64)
    isolated = 9  # no selected neighbour at all: keeps its model
    graph[:, isolated] = graph[isolated, :] = 0.0
    graph[isolated, isolated] = 1.0
    s = case1(ctx, graph)
    before = s.models.clone().double()
    results = results_for(SELECTED)
    s.aggregate(1, results)

    w = {c: results[c].model.double() for c in SELECTED}
    n = {c: float(results[c].n) for c in SELECTED}
    g = graph.astype(np.float32).astype(np.float64)
    for m in range(M):
        mass = sum(g[j, m] * n[j] for j in SELECTED)
        if mass == 0:
            want = before[m]
        else:
            want = sum(g[j, m] * n[j] * w[j] for j in SELECTED) / mass
        torch.testing.assert_close(s.models[m].double(), want, atol=1e-5, rtol=0)
    assert isolated not in SELECTED
    torch.testing.assert_close(s.models[isolated].double(), before[isolated], atol=0, rtol=0)


# -- vectorized adjacency against a slow reference ----------------------------------------

def slow_adjacency(points):
    m = len(points)
    out = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            out[i, j] = cdist(points[i], points[j]).min()
    return out


@pytest.mark.parametrize("chunk", [256, 5, 1])
def test_min_distance_adjacency_equals_a_double_loop(chunk):
    rng = np.random.default_rng(7)
    points = [rng.normal(size=(int(k), 2)) * 3 for k in rng.integers(2, 6, size=12)]
    assert len({len(p) for p in points}) > 1  # varying k: padding is exercised
    got = fcr.min_distance_adjacency(points, chunk=chunk)
    want = slow_adjacency(points)
    assert got.shape == (12, 12)
    assert np.isfinite(got).all()  # padding never leaks out as inf
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_min_distance_adjacency_with_a_single_centroid_per_client():
    rng = np.random.default_rng(8)
    points = [rng.normal(size=(1, 3)) for _ in range(7)]
    np.testing.assert_allclose(fcr.min_distance_adjacency(points, chunk=3), slow_adjacency(points),
                               rtol=1e-10, atol=1e-10)


# -- Ward clustering of A~ --------------------------------------------------------------------

def planted_blocks(sizes, seed=0):
    truth = np.repeat(np.arange(len(sizes)), sizes)
    perm = np.random.default_rng(seed).permutation(len(truth))
    truth = truth[perm]  # clients of a block are not contiguous
    graph = (truth[:, None] == truth[None, :]).astype(np.float32)
    return graph, truth


def test_ward_auto_finds_the_planted_blocks():
    graph, truth = planted_blocks([4, 5, 3])
    labels, z, c = fcr.ward_clusters(graph, "auto", max_clusters=10)
    assert c == 3
    assert len(np.unique(labels)) == 3
    assert adjusted_rand_score(truth, labels) == 1.0
    assert z.shape == (len(truth) - 1, 4)
    assert labels[0] == 0  # canonical: labelled in order of first appearance
    _, first = np.unique(labels, return_index=True)
    assert list(np.argsort(first)) == sorted(np.unique(labels))


def test_ward_respects_a_given_number_of_clusters():
    graph, truth = planted_blocks([4, 5, 3])
    labels, _, c = fcr.ward_clusters(graph, 3)
    assert c == 3 and adjusted_rand_score(truth, labels) == 1.0
    labels, _, c = fcr.ward_clusters(graph, 2)
    assert c == 2 and len(np.unique(labels)) == 2
    for block in range(3):  # coarser cut: each planted block stays whole
        assert len(np.unique(labels[truth == block])) == 1
    # identical rows cannot be split, so a finer cut needs rows that differ: soft block weights
    noise = np.random.default_rng(1).uniform(0, 0.1, graph.shape)
    soft = (graph * 0.8 + (noise + noise.T) / 2).astype(np.float32)
    labels, _, c = fcr.ward_clusters(soft, "auto")
    assert c == 3 and adjusted_rand_score(truth, labels) == 1.0
    labels, _, c = fcr.ward_clusters(soft, 5)
    assert c == 5 and len(np.unique(labels)) == 5
    for found in range(5):  # finer cut: no found cluster mixes planted blocks
        assert len(np.unique(truth[labels == found])) == 1
