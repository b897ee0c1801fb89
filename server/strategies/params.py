"""Every method's parameters, and where its strategy lives: the schema a scenario's
`methods` entries are checked against.

This module imports no torch, scikit-learn or UMAP, so `flt run` can reject a mistake in a
scenario file before it loads any of them (a typo answers in well under a second); a
strategy's own module is imported only when a run builds it (`STRATEGIES`). Each
strategy class takes its schema from here (`PARAMS = IFCA_PARAMS`), and FLT's relatedness
presets live here too, since they are what its parameters select.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from flt.common.schema import Field, section

# -- FCR's relatedness pipelines (server/fcr.py runs them) ------------------------------
SPACES = ("whitened", "embedding", "umap")
DISTANCES = ("chamfer", "energy", "hausdorff", "matched", "min")
MAX_MATCHED = 8  # 'matched' tries all k! matchings of two clients' centroids: 8! = 40,320
LINKAGES = ("average", "complete", "single", "ward", "ward_graph")  # ward: on A, as if Euclidean
CHOOSERS = ("halves", "splits", "silhouette", "gap")


@dataclass(frozen=True)
class Relatedness:
    """One FCR pipeline. gamma None: no threshold (the graph comes from the clusters)."""

    space: str = "whitened"
    distance: str = "energy"
    linkage: str = "ward"
    choose: str = "halves"
    gamma: float | None = None
    # halves: the split rule, or a finer cut whose every merge separates the clients'
    # held-out halves by this many standard deviations of a permutation null
    # (server/fcr.py heldout_z), where sampling noise hides the clients' differences.
    # Splits of one homogeneous group score about 0 (IID CIFAR-10 clients: at most 1.4 at
    # M = 100 and 500); planted groups 17 and more wherever the embedding carries them,
    # the weakest real merge seen 4.4 (CIFAR-10 S2, M = 100, which the split rule finds).
    min_heldout: float = 5.0
    # halves, where clients differ by more than sampling noise: each split the split rule
    # keeps must also separate the clients' held-out halves by this many standard
    # deviations, on each half. The split score judges a split against the spread inside
    # the final clusters, so pieces of one group that vary along one direction pass it on
    # their own thinness (MNIST S1: 10 clusters for 5). Measured on the FCR quality suite
    # (benchmarks/README.md): such pieces score at most 2.5, real splits from about 5.5
    # (digits: 4 clients a side); 2 to 5 gave the same clusters in every case, 6 and above
    # merge the digits groups.
    min_heldout_keep: float = 3.0
    # splits: every split of the chosen cut scores at least this (server/fcr.py
    # split_score). Measured on the FCR quality suite (benchmarks/README.md): the best cut
    # of clients with no planted groups at most 1.8; the weakest planted split from 1.9
    # (CIFAR-10 S2) and 2.4 (CIFAR-10 S1's animal pairs); pieces of one planted group
    # mostly below 2.2, at worst 3.0. 2.25 gave the best worst case and mean ARI.
    min_split: float = 2.25
    # Measured on the FCR quality suite (benchmarks/README.md): IID clients of four
    # datasets 0.07-0.13; every planted grouping the embedding separates 0.20-0.57.
    min_separation: float = 0.16
    # ward: after the cut, Lloyd's iterations on Ward's objective (server/fcr.py
    # refine_ward). Measured on every saved FCR of the quality suite: never lower, CIFAR-10
    # S2 at M = 500 from 0.59-0.67 to 0.72-0.94.
    refine: bool = True
    min_silhouette: float = 0.0
    silhouette_slack: float = 0.02

    def __post_init__(self):
        for name, value, allowed in (
            ("space", self.space, SPACES),
            ("distance", self.distance, DISTANCES),
            ("linkage", self.linkage, LINKAGES),
            ("choose", self.choose, CHOOSERS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


PRESETS = {
    "set": Relatedness(),
    # the default until Dec 2026: unweighted Chamfer in the raw embedding, average linkage,
    # C by silhouette with the separation floor (fails on nested groups: CIFAR-10 S1)
    "chamfer": Relatedness(space="embedding", distance="chamfer", linkage="average", choose="silhouette"),
    "paper": Relatedness(space="umap", distance="min", linkage="ward_graph", choose="gap", gamma=1.0),
}


# -- FLT --------------------------------------------------------------------------------
def positive_or_auto(value: object) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return "a positive integer or 'auto'"


ENCODER = {
    "dataset": Field(
        str,
        "public",
        "pretraining set: 'public' (held-out slice of the train split) "
        "or another dataset's name (Enc2, e.g. fashion_mnist for mnist)",
    ),
    "root": Field(str, None, "data root of that dataset (default: the scenario's)", nullable=True),
    "epochs": Field(int, 10, "pretraining epochs", min=1),
    "lr": Field(float, 1e-3, "Adam learning rate", min=0, open_min=True),
    "batch_size": Field(int, 64, "pretraining batch", min=1),
    "latent": Field(int, 128, "embedding size e", min=1),
    "channels": Field(
        (int, str),
        "auto",
        "ConvAE bottleneck channels: 'auto' (the paper's 4 for grey images, 32 for colour ones) or a positive integer",
        rule=positive_or_auto,
    ),
    "finetune_epochs": Field(
        int, 0, "J: clients fine-tune the autoencoder this many epochs (0 = frozen encoder sent as ONNX)", min=0
    ),
    "finetune_lr": Field(float, 1e-3, "clients' Adam learning rate for fine-tuning", min=0, open_min=True),
    "finetune_batch": Field(int, 32, "clients' fine-tuning batch", min=1),
}
# umap-learn's named metrics that take no keyword (minkowski's p, mahalanobis's V, ...:
# the schema has no place for one) and are defined on any real vector (hellinger needs
# non-negative ones, haversine two columns, the rest are for binary or categorical data)
UMAP_METRICS = (
    "euclidean", "l2", "manhattan", "l1", "taxicab", "chebyshev", "linf", "linfinity", "linfty",
    "cosine", "correlation", "canberra", "braycurtis",
)  # fmt: skip
UMAP = {
    "n_components": Field(int, 2, "u, the UMAP dimension", min=1),
    "n_neighbors": Field(int, 15, "UMAP n_neighbors", min=2),
    "min_dist": Field(float, 0.1, "UMAP min_dist (at most its spread, 1)", min=0, max=1),
    "metric": Field(
        str,
        "euclidean",
        "UMAP metric: one of umap-learn's that needs no parameter and suits a real-valued embedding",
        choices=UMAP_METRICS,
    ),
}


def centroid_count(value: object) -> str | None:
    return None if value == "labels" else positive_or_auto(value) and "a positive integer, 'auto' or 'labels'"


RELATEDNESS = {
    "relatedness": Field(
        str,
        "set",
        "FCR pipeline: 'set' (energy distance between the clients' share-weighted centroid "
        "sets in the whitened embedding, Ward linkage, C the finest cut whose every split "
        "is real: no threshold, no per-dataset knob), 'chamfer' (the default before: "
        "Chamfer distance, average linkage, C by silhouette) or 'paper' (UMAP, "
        "closest-pair distance, A~ = [A <= gamma], Ward on A~, C at the largest dendrogram gap)",
        choices=tuple(PRESETS),
    ),
    "space": Field(
        str,
        None,
        "override the pipeline's space: 'whitened' (the e-dim centroids, whitened with "
        "their own pooled covariance), 'embedding' (as they come) or 'umap'",
        nullable=True,
        choices=SPACES,
    ),
    "distance": Field(
        str,
        None,
        "override A_ij between two clients' centroid sets: energy, chamfer, hausdorff, matched (the root mean "
        "squared distance of the best one-to-one matching, as the FLT authors' code) or min (the single closest pair)",
        nullable=True,
        choices=DISTANCES,
    ),
    "linkage": Field(
        str,
        None,
        "override the clustering: average, complete, single or ward linkage on A, or "
        "ward_graph (Ward on the rows of A~; needs gamma)",
        nullable=True,
        choices=LINKAGES,
    ),
    "choose_clusters": Field(
        str,
        None,
        "override how clusters: auto picks C: halves (splits, or where sampling noise hides "
        "the clients' differences a finer cut drawn on one half of every client's data whose "
        "every split separates the other halves), splits (the finest cut whose every split "
        "is real on the whole data), silhouette of A or the largest dendrogram gap",
        nullable=True,
        choices=CHOOSERS,
    ),
    "gamma": Field(
        float,
        None,
        "threshold A~ = [A <= gamma], in the units of A (null: the pipeline's: "
        "none for 'set', whose graph is 'same cluster'; 1.0 for 'paper')",
        nullable=True,
        min=0,
        open_min=True,
    ),
    "min_heldout": Field(
        float,
        5.0,
        "with choose_clusters halves: each split of the chosen cut must separate the clients' "
        "held-out halves by this many standard deviations of a permutation null (one "
        "homogeneous group scores about 0)",
        min=0.0,
    ),
    "min_heldout_keep": Field(
        float,
        3.0,
        "with choose_clusters halves, where clients differ by more than sampling noise: each "
        "split the split rule keeps must also separate the clients' held-out halves by this "
        "many standard deviations of a permutation null",
        min=0.0,
    ),
    "min_split": Field(
        float,
        2.25,
        "with choose_clusters splits: each split of the chosen cut must score this much "
        "(the squared distance between the two sides' means over what cutting one "
        "homogeneous group gives; noise scores about 1)",
        min=0.0,
    ),
    "refine_clusters": Field(
        bool,
        True,
        "with linkage ward: after the cut, move each client to the cluster whose mean is "
        "nearest until none moves (Lloyd's iterations on Ward's own objective; C stays); "
        "false: the dendrogram's cut as it is",
    ),
    "min_separation": Field(
        float,
        0.16,
        "with choose_clusters silhouette: the best cut's clusters must be this far apart "
        "(mean distance between clusters minus within, over the median distance between two "
        "centroids), else the clients form one cluster (no structure)",
        min=0.0,
    ),
    "min_silhouette": Field(
        float,
        0.0,
        "with choose_clusters silhouette: below this best score the clients form one cluster",
        min=-1.0,
        max=1.0,
    ),
    "silhouette_slack": Field(
        float,
        0.02,
        "with choose_clusters silhouette: the finest cut whose score "
        "is within this of the best wins (merging two clusters costs more than "
        "splitting one)",
        min=0.0,
        max=1.0,
    ),
}

FLT = {
    "encoder": section(ENCODER, "the ConvAE encoder"),
    "k": Field(
        (int, str),
        5,
        "k-means centroids per client, 'auto' (silhouette, per client), or 'labels': one mean embedding per "
        "class the client holds, compared class by class (sees concept shift; tells the server each "
        "client's class set)",
        rule=centroid_count,
    ),
    "umap": section(UMAP, "UMAP projection of the centroids (when the space is 'umap')"),
    **RELATEDNESS,
    "adjacency": Field(
        str,
        "hard",
        "Case I neighbours: the 0/1 graph A~, or soft weights exp(-(A/gamma)^2) (gamma null: the median of A)",
        choices=("hard", "soft"),
    ),
    "aggregation": Field(
        str, "case2", "case1: personalized graph; case2: FedAvg per cluster", choices=("case1", "case2")
    ),
    "clusters": Field((int, str), "auto", "C, or 'auto' (see choose_clusters)", rule=positive_or_auto),
    "max_clusters": Field(int, 20, "upper bound when clusters is 'auto'", min=1),
    "newcomers": Field(
        str,
        "auto",
        "auto: keep the clusters or take FCR's re-run over everyone, whichever has the higher silhouette "
        "(a group of newcomers unlike every cluster opens its own); nearest: join the cluster with the "
        "nearest mean embedding; recluster: always the re-run",
        choices=("auto", "nearest", "recluster"),
    ),
    "recluster_flags": Field(
        int,
        0,
        "lambda: re-place flagged clients when more than this many have an outstanding data-change flag "
        "(0: any flag, the round it arrives; null: never). A device raises its flag when a test says its "
        "data moved (devices/watch.py)",
        nullable=True,
        min=0,
    ),
    "flag_patience": Field(
        int,
        2,
        "with lambda set: a flag outstanding this many rounds re-runs FCR "
        "even below lambda, so no drifted client is stranded",
        min=1,
    ),
    "recluster_every": Field(
        int, None, "tau: re-run FCR every tau rounds, everyone re-embedding (null: never)", nullable=True, min=1
    ),
    "monitor_cosine": Field(
        float,
        None,
        "server-side monitor (case2): flag a client whose update's "
        "cosine similarity to its cluster's mean update is below this "
        "(null: off)",
        nullable=True,
        min=-1.0,
        max=1.0,
    ),
}


def flt_pipeline(params: dict) -> Relatedness:
    """The preset with the scenario's overrides applied."""
    base = PRESETS[params["relatedness"]]
    over = {
        "space": params["space"],
        "distance": params["distance"],
        "linkage": params["linkage"],
        "choose": params["choose_clusters"],
        "gamma": params["gamma"],
    }
    return replace(
        base,
        min_separation=params["min_separation"],
        min_split=params["min_split"],
        min_heldout=params["min_heldout"],
        min_heldout_keep=params["min_heldout_keep"],
        refine=params["refine_clusters"],
        min_silhouette=params["min_silhouette"],
        silhouette_slack=params["silhouette_slack"],
        **{k: v for k, v in over.items() if v is not None},
    )


def check_flt(params: dict) -> str | None:
    """Cross-field rules the schema cannot say; returns the problem, or None."""
    how = flt_pipeline(params)
    if how.linkage == "ward_graph" and how.gamma is None:
        return "linkage 'ward_graph' clusters the thresholded graph A~: set gamma"
    return check_matched(params)


def check_matched(params: dict) -> str | None:
    """'matched' tries all k! matchings a pair of clients: k must be a number, at most
    MAX_MATCHED ('auto' may pick up to 10; 'labels' is one per class)."""
    distance = params["distance"] or PRESETS[params["relatedness"]].distance
    if distance == "matched" and not (isinstance(params["k"], int) and params["k"] <= MAX_MATCHED):
        return (
            "distance 'matched' tries every one-to-one matching of two clients' centroids: "
            f"set k to at most {MAX_MATCHED}"
        )
    return None


# -- PCA+kM+HC --------------------------------------------------------------------------
LINEAR = {
    "dataset": ENCODER["dataset"],
    "root": ENCODER["root"],
}
PCA_KM_HC = {
    **{k: v for k, v in FLT.items() if k not in ("umap", "space")},
    "encoder": section(LINEAR, "where the PCA basis is fitted (the same public images as FLT's encoder)"),
    "components": Field(
        int, 128, "e, the number of principal components (capped by the public set size and the pixel count)", min=1
    ),
    "basis": Field(
        str,
        "public",
        "public: one PCA basis fitted by the server on the public images, so every client's "
        "centroids share its axes; client: each client fits PCA on its own images and sends "
        "centroids in its own axes (the FLT authors' code)",
        choices=("public", "client"),
    ),
    "gamma": Field(
        float,
        None,
        "threshold A~ = [A <= gamma] in PCA space; null: none for the "
        "'set' pipeline, the gamma_quantile quantile of A for one that needs it",
        min=0,
        open_min=True,
        nullable=True,
    ),
    "gamma_quantile": Field(
        float,
        0.2,
        "quantile of A used as gamma when gamma is null "
        "(about the fraction of clients each client links to; 1/C for C "
        "balanced clusters)",
        min=0,
        max=1,
    ),
}


# -- FedAvg ------------------------------------------------------------------------------
FEDAVG = {
    "pool": Field(
        str,
        "selected",
        "what the server averages: 'selected', the models returned this round (McMahan et al.'s "
        "Algorithm 1, the FLT paper's text); 'all', every client's latest model, the initial one "
        "until it first trains (the FLT authors' code, all_clients: True)",
        choices=("selected", "all"),
    ),
}


# -- FedProx -----------------------------------------------------------------------------
FEDPROX = {
    **FEDAVG,
    "mu": Field(
        float,
        0.01,
        "proximal coefficient mu of (mu/2)||w - w_t||^2 (the paper tunes mu in {0.001, 0.01, 0.1, 1}; 0 = FedAvg)",
        min=0,
    ),
}


# -- IFCA --------------------------------------------------------------------------------
IFCA = {
    "clusters": Field(int, 5, "C, the number of cluster models", min=1),
    "warmup_rounds": Field(int, 0, "FedAvg rounds (one model) before the C models are spawned", min=0),
    "reinit_empty": Field(
        bool, True, "re-draw a cluster no client belongs to from a perturbed copy of the largest cluster's model"
    ),
    "init_scale": Field(
        float, 0.01, "std of the Gaussian perturbation that makes the C initial (and re-drawn) models differ", min=0
    ),
}


# -- FedGroup ----------------------------------------------------------------------------
FEDGROUP = {
    "groups": Field(int, 5, "m, the number of groups", min=1),
    "pretrain_scale": Field(
        int, 20, "alpha: alpha x m clients (at most M) pre-train before round 1 to form the groups", min=1
    ),
    "inter_group_lr": Field(
        float,
        0.0,
        "eta: after each round every group model moves this far towards the mean of the others' updates "
        "(0: groups never share, FedGroup's default)",
        min=0,
        max=1,
    ),
}


# -- PACFL -------------------------------------------------------------------------------
PACFL = {
    "basis": Field(int, 3, "p: left singular vectors each client sends per class it holds", min=1, max=64),
    "threshold": Field(
        float,
        4.9,
        "hierarchical clustering merges clusters while their distance (degrees) is at most this "
        "(the authors' CIFAR-10 script: 4.9)",
        min=0,
        max=90,
    ),
    "clusters": Field(
        int, None, "C given instead of the threshold: cut the tree into C clusters", nullable=True, min=1
    ),
    "linkage": Field(
        str,
        "average",
        "the distance between merged clusters, as the authors' code updates it: average (of the two "
        "merged rows: WPGMA), maximum (complete) or minimum (single)",
        choices=("average", "maximum", "minimum"),
    ),
}


# -- FedSEM ------------------------------------------------------------------------------
FEDSEM = {
    "centers": Field(int, 5, "K, the number of centre models", min=1),
    "reassign_every": Field(
        int,
        1,
        "re-assign returned models to their nearest centre every this many rounds (1: every round, as in the paper)",
        min=1,
    ),
    "init": Field(
        str,
        "random_clients",
        "centre initialisation: k-means++-style seeded pick among the first round's returned models",
        choices=("random_clients",),
    ),
    "pool": Field(
        str,
        "selected",
        "what the E- and M-steps see: 'selected', the models returned this round (the FedSEM paper's "
        "Algorithm 1); 'all', every client's latest model, k-means over all M each round (the FLT authors' "
        "code, multi_center with all_clients: True)",
        choices=("selected", "all"),
    ),
}


# -- FeSEM (soft) ------------------------------------------------------------------------
FESEM_SOFT = {
    **{k: v for k, v in FEDSEM.items() if k != "pool"},  # its soft E-step is the paper's, on the returned models
    "temperature": Field(
        float,
        0.1,
        "T of the soft E-step, in units of the round's mean squared "
        "model-centre distance (-> 0: FedSEM's hard assignment)",
        min=0,
        open_min=True,
    ),
}


# -- CFL ---------------------------------------------------------------------------------
CFL = {
    "eps1": Field(float, 0.4, "split only when the norm of the cluster's mean update is below this", min=0),
    "eps2": Field(
        float, 1.6, "split only when the largest client update norm is above this (and the eps1 test holds)", min=0
    ),
    "warmup_rounds": Field(int, 20, "no split in rounds 1..warmup_rounds", min=0),
    "min_cluster_size": Field(
        int, 2, "split only a cluster with more than this many returned clients (authors' code: len > 2)", min=1
    ),
}


# -- the registry ---------------------------------------------------------------------
class Method(NamedTuple):
    """A method as a scenario names it: its strategy's module and class (imported when a
    run builds it), its parameters, and its cross-field check (None: none)."""

    module: str
    cls: str
    params: dict[str, Field]
    check: Callable[[dict], str | None] | None = None


METHODS = {
    "fedavg": Method("flt.server.strategies.fedavg", "FedAvg", FEDAVG),
    "fedprox": Method("flt.server.strategies.fedprox", "FedProx", FEDPROX),
    "local": Method("flt.server.strategies.local", "Local", {}),
    "flt": Method("flt.server.strategies.flt", "FLT", FLT, check_flt),
    # ward_graph: gamma by quantile, so only the matched distance's k needs checking
    "pca_km_hc": Method("flt.server.strategies.pca_km_hc", "PCAKMHC", PCA_KM_HC, check_matched),
    "ifca": Method("flt.server.strategies.ifca", "IFCA", IFCA),
    "fedsem": Method("flt.server.strategies.fedsem", "FedSEM", FEDSEM),
    "fesem_soft": Method("flt.server.strategies.fesem_soft", "FeSEMSoft", FESEM_SOFT),
    "cfl": Method("flt.server.strategies.cfl", "CFL", CFL),
    "fedgroup": Method("flt.server.strategies.fedgroup", "FedGroup", FEDGROUP),
    "pacfl": Method("flt.server.strategies.pacfl", "PACFL", PACFL),
    "oracle": Method("flt.server.strategies.oracle", "Oracle", FEDAVG),  # told the planted clusters: a reference
}
