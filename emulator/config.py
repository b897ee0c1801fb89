"""The scenario file: its schema, loading, `--set` overrides and validation.

A scenario is validated in full before anything starts; the first problem stops the
run with a message naming the file and the field (e.g. `train.lr`).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import yaml

from flt.common.errors import short
from flt.common.schema import ConfigError, Field, MethodSpec, section, validate
from flt.common.wire import endpoint_problem
from flt.emulator.profiles import ProfileError, profiles_from_distribution
from flt.scenarios.datasets import DATASETS, DataError, dataset_key, load_dataset
from flt.scenarios.shift import KINDS, level_problem
from flt.server.auth import SECURITY, security_problem
from flt.server.strategies.params import METHODS  # torch-free: a typo answers before anything heavy loads


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats (YAML 1.1 reads `1e-3`, `1e9` and
    `1.5e3` as text, so `lr: 1e-3` failed as "expected float") and no duplicate keys (the
    last of two `train:` sections silently replaced the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {short(key)} appears twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> object:
    """A scenario's YAML (a file, a --set value, a saved config.yaml)."""
    return yaml.load(text, Loader=YamlLoader)


DATA = {
    "dataset": Field(
        str,
        "digits",
        "dataset name",
        rule=lambda v: None if dataset_key(v) else f"one of {', '.join(DATASETS)} (emnist:<split> for an EMNIST split)",
    ),
    "root": Field(str, None, "data root holding the dataset's files (not needed for digits)", nullable=True),
    "download": Field(bool, False, "let torchvision download missing files (needs internet)"),
}

SHIFT = {
    "kind": Field(
        str,
        "rotate",
        "what differs between the clusters: rotate, invert, noise, blur (feature shift) or labels (concept shift)",
        choices=KINDS,
    ),
    "levels": Field(
        list,
        None,
        "one per cluster: degrees (rotate), 0/1 (invert), noise std or blur sigma in pixels; "
        "default evenly spread (rotate 0, 90, 180, 270 for 4 clusters); not used with labels",
        nullable=True,
    ),
}

PARTITION = {
    "kind": Field(
        str,
        "clusters",
        "how clients get data",
        choices=("clusters", "dirichlet", "structured", "writers", "iid"),
    ),
    "clients": Field(int, 20, "number of clients M", min=1),
    "clusters": Field(int, 5, "number of planted clusters C", min=1),
    "classes_per_cluster": Field(int, 2, "classes held by each cluster", min=1),
    "shared_classes": Field(int, 0, "classes a cluster shares with its neighbour (S2: 1)", min=0),
    "samples_per_client": Field(int, 600, "training samples per client", min=1),
    "test_per_client": Field(int, 100, "test samples per client, from its own classes", min=1),
    "on_short": Field(
        str,
        "take",
        "kind clusters, when a class has too few images for its holders: take (split what exists), fail, or "
        "share (each cluster holding it splits all of it: clients in different clusters share images, as "
        "the FLT authors' sampler does)",
        choices=("take", "fail", "share"),
    ),
    "alpha": Field(float, 0.5, "Dirichlet concentration / structured size offset", min=0, open_min=True),
    "delta": Field(float, 0.5, "structured quantity-skew exponent", min=0),
    "max_per_class": Field(
        int,
        None,
        "keep at most this many training images of each class (a seeded draw, made after the public set is "
        "held out), for a class-balanced set like EMNIST-balanced from a skewed one; null keeps them all",
        nullable=True,
        min=1,
    ),
    "public_fraction": Field(
        float,
        0.0,
        "fraction of the train split held out from clients as a public set (encoder / PCA pretraining)",
        min=0.0,
        max=0.9,
    ),
    "shift": section(
        SHIFT,
        "feature or concept shift between the partition.clusters groups of clients (contiguous id blocks)",
        optional=True,
    ),
}

TRAIN = {
    "rounds": Field(int, 100, "communication rounds T", min=1),
    "participation": Field(float, 0.2, "fraction rho of clients selected per round", min=0, max=1, open_min=True),
    "local_epochs": Field(int, 1, "local epochs E", min=1),
    "batch_size": Field(int, 10, "local batch size B", min=1),
    "lr": Field(float, 0.01, "local SGD learning rate", min=0, open_min=True),
    "momentum": Field(
        float,
        0.0,
        "SGD momentum of the local steps (0: plain SGD, as the FLT paper's text states; its authors' "
        "code uses 0.5). The buffer starts at zero with every task, as a fresh optimizer does",
        min=0,
        max=1,
    ),
    "inputs": Field(
        str,
        "unit",
        "how images reach the model: unit (x / 255, in [0, 1]; the paper's text names no scaling) or "
        "signed ((x / 255 - 0.5) / 0.5, in [-1, 1]: its authors' CIFAR-10 code, torchvision's Normalize(0.5, 0.5))",
        choices=("unit", "signed"),
    ),
    "eval_every": Field(int, 1, "evaluate every n rounds (and at the last)", min=1),
    "target_accuracy": Field(float, None, "accuracy (%) for rounds/bytes-to-target", nullable=True, min=0, max=100),
    "vectorize": Field(
        (bool, str),
        "auto",
        "train a device's cohort in one vmapped call (true), one client "
        "at a time (false), or auto: vmap on a GPU and for the MLP, the loop for CNNs on a CPU "
        "(evaluation always follows auto)",
        choices=("auto",),
    ),
}


DEVICES = {
    "processes": Field(int, None, "device processes started here (default: CPU cores)", nullable=True, min=0),
    "external": Field(
        int, 0, "devices started by hand with `flt device --connect` (other hosts) that the run waits for", min=0
    ),
    "bind": Field(
        str,
        "tcp://127.0.0.1:*",
        "server address; tcp://0.0.0.0:5555 accepts other hosts",
        rule=partial(endpoint_problem, listen=True),
    ),
    # 2^31 - 1 threads kept every device from loading for 120 s; 1,024 is more cores than a host has
    "threads": Field(int, 1, "torch threads per device process", min=1, max=1024),
    "accelerator": Field(
        str,
        "auto",
        "where device processes train and evaluate their cohorts: cpu, "
        "cuda (fail where a device host has no GPU), or auto (its GPU when it has one)",
        choices=("cpu", "cuda", "auto"),
    ),
    "round_timeout_s": Field(
        float,
        120.0,
        "a round's replies are awaited this long (from a local device still computing: up to 30 times as long)",
        min=0,
        open_min=True,
    ),
    "start_timeout_s": Field(float, 120.0, "devices must connect within this", min=0, open_min=True),
    "crash": Field(
        dict,
        {},
        "fault injection: {device index: round} kills that device process when that round's training tasks arrive",
    ),
    "security": Field(
        str,
        "auto",
        "CURVE encryption and device keys; auto: on unless bind is loopback and devices.external is 0",
        choices=SECURITY,
    ),
    "keys": Field(
        str,
        None,
        "folder made by `flt keys DIR`: the server's key pair and the public keys "
        "of the devices started by hand that may join",
        nullable=True,
    ),
    "launcher": Field(
        str,
        "local",
        "who starts the device processes: local (processes on this machine) "
        "or ray (Ray actors on a cluster's nodes; pip install 'flt-emulator[ray]')",
        choices=("local", "ray"),
    ),
    "start": Field(
        str,
        "forkserver",
        "how local device processes start: forkserver (forked from one copy of the emulator "
        "made before the run, which has imported torch: those pages are shared, about 350 MB "
        "less per device) or exec (a fresh `python -m flt.devices` each)",
        choices=("forkserver", "exec"),
    ),
    "ray_address": Field(
        str,
        None,
        "launcher ray: the cluster for ray.init (auto, HOST:6379); default: a "
        "running cluster if there is one, else a local Ray instance",
        nullable=True,
    ),
}

PROFILES = {
    "trace": Field(str, None, "device trace file (CSV/JSON, see emulator/profiles/trace.py)", nullable=True),
    "fedscale_capacity": Field(str, None, "FedScale client_device_capacity file", nullable=True),
    "fedscale_behave": Field(str, None, "FedScale client_behave_trace file (availability)", nullable=True),
    "distribution": Field(
        dict, None, "seeded distributions: compute, network, latency_ms, availability", nullable=True
    ),
}

POPULATION = {
    "sampling": Field(
        str, "uniform", "uniform over present clients, or only those online", choices=("uniform", "available")
    ),
    "profiles": section(PROFILES, "device runtimes; none = no emulated clock", optional=True),
    "deadline_s": Field(
        float, None, "round deadline in emulated seconds (stragglers dropped)", nullable=True, min=0, open_min=True
    ),
    "overcommit": Field(float, 1.0, "draw ceil(k * factor) clients, keep the k fastest", min=1.0),
    "realtime": Field(
        float,
        None,
        "real-time mode: devices really wait their emulated task time x this "
        "factor before answering, and the server waits deadline_s x this factor",
        nullable=True,
        min=0,
        open_min=True,
    ),
    "newcomers": Field(
        list,
        [],
        "[{round: r, cluster: c}] or [{round: r, clients: [ids]}]: "
        "clients withheld until round r, joining as a new device process",
    ),
    "drift": Field(
        list,
        [],
        "[{round: r, clients: [ids], to_cluster: c}]: each client swaps its data "
        "with a client of cluster c; or [{round: r, clients: [ids], kind: resample}]: "
        "the same swap inside each client's own cluster (new images, same distribution); "
        "or [{round: r, clients: [ids], kind: swap_labels, "
        "labels: [i, j]}]: their classes i and j trade labels (a label swap changes no image: "
        "a device's embedding test does not see it, the monitor or k: labels may)",
    ),
}

SCENARIO = {
    "name": Field(str, "scenario", "a label for the run"),
    # scikit-learn's and UMAP's random_state take the seed as it is, and they accept < 2**32
    "seed": Field(int, 0, "seeds partition, sampling, initial weights, k-means, UMAP", min=0, max=2**32 - 1),
    "data": section(DATA, "the dataset"),
    "partition": section(PARTITION, "how the data is split into clients"),
    "model": Field(str, "mlp", "client model", choices=("mlp", "leaf_cnn", "cifar_cnn")),
    "train": section(TRAIN, "local training and rounds"),
    "devices": section(DEVICES, "device processes"),
    "population": section(POPULATION, "participation, device runtimes, arrivals and drift"),
    "methods": Field(list, ["fedavg"], "methods to run, names or {name: ..., params}"),
    "output": Field(str, "runs", "folder under which run folders are made"),
}


def load(
    path: str | Path, overrides: Sequence[str] = (), methods: list[str] | None = None, saved: bool = False
) -> dict:
    """Read, override and validate a scenario; raise ConfigError naming the file.

    `methods` (flt compare) keeps the scenario's entries of those names, with their
    parameters and labels, and adds a default entry for a name the scenario lacks.
    `saved`: the file is a run folder's own config.yaml (flt run --resume), whose settings
    that did not exist when it was written keep the value the run started with."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a scenario file (`flt suite {path}` runs every scenario in it)")
    if not path.is_file():
        raise ConfigError(f"{path}: scenario file not found")
    try:
        raw = read_yaml(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(exc)}") from None
    if raw is None:
        raise ConfigError(f"{path}: the file is empty (a scenario needs at least one field, e.g. name)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    if saved:
        pin_former_defaults(raw)
    try:
        resolve_paths(raw, path.resolve().parent)  # the file's own paths: against its folder
        for item in overrides:
            apply_override(raw, item)
        resolve_paths(raw, Path.cwd())  # what --set gave: against where the user typed it
        if methods is not None:
            raw["methods"] = select_methods(raw.get("methods") or [], methods)
        return resolve(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def pin_former_defaults(raw: dict) -> None:
    """A saved config lists every setting its run had; one it lacks is newer than the run,
    and the run went with the value from before the setting existed. A default that
    changed since must not change a resumed run (its later re-clustering would embed with
    another encoder than the one its first FCR used)."""
    for method in raw.get("methods") or []:
        encoder = method.get("encoder") if isinstance(method, dict) else None
        if isinstance(encoder, dict) and "channels" in convae_fields(method.get("name")):
            # autoencoder.PAPER_CHANNELS (not imported: this module stays torch-free); every
            # ConvAE had it before 2026-11-28
            encoder.setdefault("channels", 4)


def convae_fields(name: object) -> dict:
    """The `encoder` settings a method has: a ConvAE's for FLT, only where its public images
    come from for PCA+kM+HC (no bottleneck to pin), none for a method without an encoder."""
    method = METHODS.get(name) if isinstance(name, str) else None
    encoder = method.params.get("encoder") if method else None
    return (encoder.schema or {}) if encoder else {}


def apply_override(raw: dict, item: str) -> None:
    """`--set train.lr=0.05`: the value is parsed as YAML (numbers, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"--set {short(item)}: expected key=value")
    key, value = item.split("=", 1)
    node, parts = raw, key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    try:
        node[parts[-1]] = read_yaml(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {short(value)} is not valid YAML: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    """A YAML error's message (its problem and where) on one line; the file is named
    already, so PyYAML's name for the text it was given goes."""
    return " ".join(str(exc).replace(' in "<unicode string>",', " at").split())


# Fields that name files or folders, as paths of keys from the top of the scenario.
PATH_FIELDS = (
    ("data", "root"),
    ("population", "profiles", "trace"),
    ("population", "profiles", "fedscale_capacity"),
    ("population", "profiles", "fedscale_behave"),
    ("devices", "keys"),
)


def resolve_paths(raw: dict, base: Path) -> None:
    """Make relative paths absolute against `base`, in place: data.root, the profile
    files and every method's encoder.root. Absolute paths and `~` stay as they are."""
    holders: list[tuple[dict | None, str]] = []  # (the dict holding a path, its key)
    for keys in PATH_FIELDS:
        node: dict | None = raw
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        holders.append((node, keys[-1]))
    methods = raw.get("methods")
    for entry in methods if isinstance(methods, list) else []:
        holders.append((entry.get("encoder") if isinstance(entry, dict) else None, "root"))
    for node, key in holders:
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
            node[key] = _against(node[key], base)


def _against(value: str, base: Path) -> str:
    if value.startswith("~") or Path(value).is_absolute():
        return value
    return os.path.normpath(base / value)


def resolve(raw: dict) -> dict:
    cfg = validate(copy.deepcopy(raw), SCENARIO)
    given = [entry if isinstance(entry, dict) else {} for entry in cfg["methods"]]
    cfg["methods"] = [m.__dict__ for m in parse_methods(cfg["methods"])]
    _check_events(cfg["population"], cfg["train"]["rounds"], cfg["partition"])
    if cfg["devices"]["processes"] == 0 and cfg["devices"]["external"] == 0:
        raise ConfigError("devices.processes: 0 local processes and no external devices: nobody would train")
    for dev, rnd in cfg["devices"]["crash"].items():
        if not (isinstance(dev, int) and isinstance(rnd, int) and dev >= 0 and rnd >= 1):
            raise ConfigError(f"devices.crash: expected {{device index: round}}, got {short(dev)}: {short(rnd)}")
    check_crash(cfg["devices"]["crash"], cfg["devices"]["processes"] or os.cpu_count() or 1)
    d = cfg["devices"]
    if problem := security_problem(d["bind"], d["security"], d["keys"], d["external"]):
        raise ConfigError(problem)
    _check_launcher(d)
    p = cfg["partition"]
    if p["kind"] in ("clusters", "structured") and p["classes_per_cluster"] <= p["shared_classes"]:
        raise ConfigError("partition.shared_classes: must be smaller than partition.classes_per_cluster")
    if p["kind"] in ("clusters", "structured") and p["clusters"] > p["clients"]:  # before any data is read
        raise ConfigError(
            f"partition.clusters: {p['clusters']} clusters for {p['clients']} clients (partition.clients); "
            "each cluster needs a client"
        )
    if p["kind"] == "writers" and p["max_per_class"] is not None:
        raise ConfigError("partition.max_per_class: a writer keeps all its images (kind writers); remove it")
    _check_shift(p)
    if cfg["data"]["dataset"] != "digits" and not cfg["data"]["root"] and not cfg["data"]["download"]:
        raise ConfigError(
            f"data.root: dataset {cfg['data']['dataset']!r} needs a data root "
            "(or data.download: true on a machine with internet)"
        )
    _check_distribution(cfg["population"]["profiles"])
    _check_clock(cfg["population"])
    for i, spec in enumerate(cfg["methods"]):
        if encoder_source(spec) is not None:
            _check_encoder(spec["params"]["encoder"], cfg, f"methods[{i}]({spec['label']}).encoder")
        if spec["name"] == "fedprox":
            _check_prox(spec["params"]["mu"], cfg["train"], f"methods[{i}]({spec['label']}).mu")
        _check_model_count(spec, given[i], p["clients"], f"methods[{i}]({spec['label']})")
    return cfg


# the parameter that counts the models a method keeps on the server (and IFCA sends to each client)
MODEL_COUNT = {"ifca": "clusters", "fedsem": "centers", "fesem_soft": "centers", "fedgroup": "groups"}


def _check_model_count(spec: dict, given: dict, clients: int, where: str) -> None:
    """A count given above the clients is a mistake (their models cannot all be trained),
    refused before it is allocated. The default (5) is cut to the clients where they are
    fewer, and the resolved config.yaml says so, so a run resumes or reruns from it."""
    key = MODEL_COUNT.get(spec["name"])
    if key and key in given and spec["params"][key] > clients:
        raise ConfigError(
            f"{where}.{key}: {spec['params'][key]} models for {clients} clients (partition.clients); "
            "at most one a client"
        )
    if key:
        spec["params"][key] = min(spec["params"][key], clients)


def _check_prox(mu: float, train: dict, where: str) -> None:
    """FedProx's proximal term alone makes each local step multiply w - w_t by
    (1 - lr mu) (with momentum b, a heavy-ball step on curvature mu): past lr mu =
    2 (1 + b) that factor exceeds 1 in size and every client's update blows up to NaN."""
    lr, b = train["lr"], train["momentum"]
    if lr * mu >= 2 * (1 + b):
        raise ConfigError(
            f"{where}: mu {mu:g} with train.lr {lr:g} (momentum {b:g}) makes the proximal step "
            f"diverge (lr x mu >= {2 * (1 + b):g}); give mu < {2 * (1 + b) / lr:g}"
        )


def _check_shift(p: dict) -> None:
    if not p["shift"]:
        return
    if p["clusters"] > p["clients"]:
        raise ConfigError(
            f"partition.clusters: {p['clusters']} shift groups for {p['clients']} clients (at most one per client)"
        )
    levels = p["shift"]["levels"]
    if levels is not None and (problem := level_problem(p["shift"]["kind"], levels, p["clusters"])):
        raise ConfigError(f"partition.shift.{problem}")


def _check_launcher(devices: dict) -> None:
    if devices["ray_address"] is not None and devices["launcher"] != "ray":
        raise ConfigError("devices.ray_address: only used with devices.launcher: ray")
    if devices["launcher"] == "ray":
        from flt.emulator.ray_launcher import import_ray

        import_ray()  # not installed: stop here, naming the field and the install command


def check_crash(crash: dict, n_proc: int) -> None:
    """devices.crash names device processes the run starts (dev-0 .. dev-{n_proc - 1});
    another index would crash nothing, silently."""
    if missing := sorted(i for i in crash if i >= n_proc):
        raise ConfigError(
            f"devices.crash: no device {missing[0]}: this run starts {n_proc} device processes "
            f"(dev-0..dev-{n_proc - 1}; devices.processes, at most one per client)"
        )


def _check_clock(pop: dict) -> None:
    """A deadline, real-time waits and over-commitment are measured on the emulated clock,
    which only device profiles give: without them no client is ever late, so these
    settings would be ignored without a word."""
    if pop["profiles"] is not None:
        return
    for key, unset in (("deadline_s", None), ("realtime", None), ("overcommit", 1.0)):
        if pop[key] != unset:
            raise ConfigError(
                f"population.{key}: needs population.profiles (device runtimes: the emulated clock it is "
                "measured on); without them every client answers in time"
            )


def _check_distribution(profiles: dict | None) -> None:
    """Device-profile distributions: drawing none checks every key and number."""
    if profiles and profiles["distribution"] is not None:
        try:
            profiles_from_distribution(0, profiles["distribution"], np.random.default_rng(0))
        except ProfileError as exc:
            raise ConfigError(f"population.profiles.distribution: {exc}") from None


def _check_encoder(source: dict, cfg: dict, where: str) -> None:
    """An encoder's pretraining set, checked before anything starts (FCR loads it mid-run)."""
    name, data = source["dataset"], cfg["data"]
    if name == "public":
        if cfg["partition"]["public_fraction"] <= 0:
            raise ConfigError(
                f"{where}.dataset: 'public' needs partition.public_fraction > 0 "
                "(a held-out slice of the train split that no client receives)"
            )
        return
    key = dataset_key(name)
    if key is None:
        raise ConfigError(f"{where}.dataset: {short(name)} is neither 'public' nor a dataset ({', '.join(DATASETS)})")
    if key == dataset_key(data["dataset"]):
        raise ConfigError(
            f"{where}.dataset: {short(name)} is the clients' own dataset; use 'public' "
            "(the held-out slice) so no client training image is seen"
        )
    if key[0] != "digits" and not (source.get("root") or data["root"]):
        raise ConfigError(f"{where}.root: dataset {short(name)} needs a data root (here or in data.root)")


def encoder_source(spec: dict) -> dict | None:
    """The public images a method's encoder is fitted on; None for a method with no encoder
    or whose clients fit their own (PCA+kM+HC `basis: client`)."""
    source = spec["params"].get("encoder")
    return source if isinstance(source, dict) and spec["params"].get("basis") != "client" else None


def load_encoder_sources(cfg: dict) -> None:
    """Load every encoder's pretraining set once before anything starts, so a missing or
    damaged file stops the run here, naming the method, rather than at its FCR."""
    seen = set()
    for i, spec in enumerate(cfg["methods"]):
        source = encoder_source(spec)
        if source is None or source["dataset"] == "public":
            continue
        key = (source["dataset"], source.get("root") or cfg["data"]["root"])
        if key not in seen:
            seen.add(key)
            try:
                load_dataset(*key, train=True)
            except DataError as exc:
                raise DataError(f"methods[{i}]({spec['label']}).encoder: {exc}") from None


# the fields each kind of drift event needs besides round and clients
DRIFT_FIELDS = {"move": ("to_cluster",), "resample": (), "swap_labels": ("labels",)}


def _check_events(pop: dict, rounds: int, partition: dict) -> None:
    common: tuple[str, ...]  # the fields every event of this kind must have
    for kind, common in (("newcomers", ("round",)), ("drift", ("round", "clients"))):
        for i, ev in enumerate(pop[kind]):
            where = f"population.{kind}[{i}]"
            if not isinstance(ev, dict):
                raise ConfigError(f"{where}: expected a mapping")
            need: tuple[str, ...] = common  # this event's own: a move's to_cluster must not carry on
            if kind == "drift":
                if ev.get("kind", "move") not in DRIFT_FIELDS:
                    raise ConfigError(f"{where}.kind: one of {', '.join(DRIFT_FIELDS)}; got {short(ev.get('kind'))}")
                need = common + DRIFT_FIELDS[ev.get("kind", "move")]
            optional = {"cluster", "clients"} if kind == "newcomers" else {"kind"}
            extra = set(ev) - set(need) - optional
            if extra:
                raise ConfigError(f"{where}: unknown field(s) {short(sorted(extra))}")
            for key in need:
                if key not in ev:
                    raise ConfigError(f"{where}.{key}: required field is missing")
            if not isinstance(ev["round"], int) or not 2 <= ev["round"] <= rounds:
                raise ConfigError(f"{where}.round: expected a round in 2..{rounds}, got {short(ev['round'])}")
            if kind == "newcomers" and ("cluster" in ev) == ("clients" in ev):
                raise ConfigError(f"{where}: give either 'cluster' or 'clients'")
            _check_event_values(ev, where, partition)


def _check_event_values(ev: dict, where: str, partition: dict) -> None:
    """Client ids, clusters and labels of one newcomer or drift event, before any allocation."""
    m, c = partition["clients"], partition["clusters"]
    if "clients" in ev:
        ids = ev["clients"]
        if (
            not isinstance(ids, list)
            or not ids
            or len(ids) > m
            or not all(_is_int(i) and 0 <= i < m for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ConfigError(f"{where}.clients: expected distinct client ids in 0..{m - 1}, got {short(ids)}")
    for key in ("cluster", "to_cluster"):
        if key in ev and not (_is_int(ev[key]) and 0 <= ev[key] < c):
            raise ConfigError(f"{where}.{key}: expected a cluster in 0..{c - 1}, got {short(ev[key])}")
    if "labels" in ev:
        pair = ev["labels"]
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(_is_int(i) and i >= 0 for i in pair)
            and pair[0] != pair[1]
        ):
            raise ConfigError(f"{where}.labels: expected two different class labels [i, j], got {short(pair)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def select_methods(entries: list, names: list[str]) -> list:
    if not names:
        raise ConfigError("--methods: name at least one method")
    named = [(_entry_field(e, "name"), _entry_field(e, "label") or _entry_field(e, "name"), e) for e in entries]
    chosen: list = []
    for word in names:
        # a method name picks every entry of that method; any other word, the entry with that label
        picked = [e for n, _, e in named if n == word] or ([word] if word in METHODS else [])
        picked = picked or [e for _, label, e in named if label == word]
        if not picked:
            labels = [label for _, label, _ in named if label]
            raise ConfigError(
                f"--methods: unknown method or label {short(word)}; methods: "
                f"{', '.join(METHODS)}; labels in this scenario: {', '.join(map(str, labels))}"
            )
        chosen += [e for e in picked if not any(e is c for c in chosen)]
    return chosen


def _entry_field(entry, key: str):
    """A method entry's name or label: the string itself, or that key of its mapping."""
    if isinstance(entry, str):
        return entry if key == "name" else None
    return entry.get(key) if isinstance(entry, dict) else None


def parse_methods(entries: list) -> list[MethodSpec]:
    if not entries:
        raise ConfigError("methods: list at least one method")
    specs, labels = [], set()
    for i, entry in enumerate(entries):
        where = f"methods[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"{where}: expected a method name or a mapping with 'name'")
        entry = dict(entry)
        name, label = entry.pop("name"), entry.pop("label", None)
        if not isinstance(name, str) or name not in METHODS:
            raise ConfigError(f"{where}.name: unknown method {short(name)}; known: {', '.join(METHODS)}")
        method = METHODS[name]
        params = validate(entry, method.params, f"{where}({name})")
        if method.check and (problem := method.check(params)):
            raise ConfigError(f"{where}({name}): {problem}")
        spec = MethodSpec(name, params, label or name)
        if spec.label in labels:
            raise ConfigError(f"{where}: method label {spec.label!r} appears twice; give one a 'label'")
        labels.add(spec.label)
        specs.append(spec)
    return specs


def dump(cfg: dict) -> str:
    """The resolved scenario as YAML that `flt run` accepts again."""
    out = dict(cfg, methods=[{"name": m["name"], "label": m["label"], **m["params"]} for m in cfg["methods"]])
    return yaml.safe_dump(out, sort_keys=False)
