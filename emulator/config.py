"""The scenario file: its schema, loading, `--set` overrides and validation.

A scenario is validated in full before anything starts; the first problem stops the
run with a message naming the file and the field (e.g. `train.lr`).
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from scenarios.datasets import DATASETS
from scenarios.schema import ConfigError, Field, MethodSpec, section, validate
from server.strategies import STRATEGIES

DATA = {
    "dataset": Field(str, "digits", "dataset name", choices=DATASETS),
    "root": Field(str, None, "data root holding the dataset's files (not needed for digits)", nullable=True),
    "download": Field(bool, False, "let torchvision download missing files (needs internet)"),
}

PARTITION = {
    "kind": Field(str, "clusters", "how clients get data",
                  choices=("clusters", "dirichlet", "structured", "writers")),
    "clients": Field(int, 20, "number of clients M", min=1),
    "clusters": Field(int, 5, "number of planted clusters C", min=1),
    "classes_per_cluster": Field(int, 2, "classes held by each cluster", min=1),
    "shared_classes": Field(int, 0, "classes a cluster shares with its neighbour (S2: 1)", min=0),
    "samples_per_client": Field(int, 600, "training samples per client", min=1),
    "test_per_client": Field(int, 100, "test samples per client, from its own classes", min=1),
    "on_short": Field(str, "take", "when a class has too few images: take what exists, or fail",
                      choices=("take", "fail")),
    "alpha": Field(float, 0.5, "Dirichlet concentration / structured size offset", min=0, open_min=True),
    "delta": Field(float, 0.5, "structured quantity-skew exponent", min=0),
    "public_fraction": Field(float, 0.0, "fraction of the train split held out from clients as a "
                             "public set (encoder / PCA pretraining)", min=0.0, max=0.9),
}

TRAIN = {
    "rounds": Field(int, 100, "communication rounds T", min=1),
    "participation": Field(float, 0.2, "fraction rho of clients selected per round", min=0, max=1, open_min=True),
    "local_epochs": Field(int, 1, "local epochs E", min=1),
    "batch_size": Field(int, 10, "local batch size B", min=1),
    "lr": Field(float, 0.01, "local SGD learning rate", min=0, open_min=True),
    "eval_every": Field(int, 1, "evaluate every n rounds (and at the last)", min=1),
    "target_accuracy": Field(float, None, "accuracy (%) for rounds/bytes-to-target", nullable=True, min=0, max=100),
    "vectorize": Field(bool, True, "train a device's cohort in one vmapped call"),
}

DEVICES = {
    "processes": Field(int, None, "device processes started here (default: CPU cores)", nullable=True, min=0),
    "external": Field(int, 0, "devices started by hand with `flt device --connect` (other hosts) "
                      "that the run waits for", min=0),
    "bind": Field(str, "tcp://127.0.0.1:*", "server address; tcp://0.0.0.0:5555 accepts other hosts"),
    "threads": Field(int, 1, "torch threads per device process", min=1),
    "round_timeout_s": Field(float, 120.0, "a round's replies are awaited this long", min=0, open_min=True),
    "start_timeout_s": Field(float, 120.0, "devices must connect within this", min=0, open_min=True),
    "crash": Field(dict, {}, "fault injection: {device index: round} kills that device process "
                   "when that round's training tasks arrive"),
}

PROFILES = {
    "trace": Field(str, None, "device trace file (CSV/JSON, see emulator/profiles.py)", nullable=True),
    "fedscale_capacity": Field(str, None, "FedScale client_device_capacity file", nullable=True),
    "fedscale_behave": Field(str, None, "FedScale client_behave_trace file (availability)", nullable=True),
    "distribution": Field(dict, None, "seeded distributions: compute, network, latency_ms, availability",
                          nullable=True),
}

POPULATION = {
    "sampling": Field(str, "uniform", "uniform over present clients, or only those online",
                      choices=("uniform", "available")),
    "profiles": section(PROFILES, "device runtimes; none = no emulated clock", optional=True),
    "deadline_s": Field(float, None, "round deadline in emulated seconds (stragglers dropped)",
                        nullable=True, min=0, open_min=True),
    "overcommit": Field(float, 1.0, "draw ceil(k * factor) clients, keep the k fastest", min=1.0),
    "realtime": Field(float, None, "real-time mode: devices really wait their emulated task time x this "
                      "factor before answering, and the server waits deadline_s x this factor",
                      nullable=True, min=0, open_min=True),
    "newcomers": Field(list, [], "[{round: r, cluster: c}] or [{round: r, clients: [ids]}]: "
                       "clients withheld until round r, joining as a new device process"),
    "drift": Field(list, [], "[{round: r, clients: [ids], to_cluster: c}]: each client swaps its data "
                   "with a client of cluster c; or [{round: r, clients: [ids], kind: swap_labels, "
                   "labels: [i, j]}]: their classes i and j trade labels; drifted clients raise their flag"),
}

SCENARIO = {
    "name": Field(str, "scenario", "a label for the run"),
    "seed": Field(int, 0, "seeds partition, sampling, initial weights, k-means, UMAP", min=0),
    "data": section(DATA, "the dataset"),
    "partition": section(PARTITION, "how the data is split into clients"),
    "model": Field(str, "mlp", "client model", choices=("mlp", "leaf_cnn", "cifar_cnn")),
    "train": section(TRAIN, "local training and rounds"),
    "devices": section(DEVICES, "device processes"),
    "population": section(POPULATION, "participation, device runtimes, arrivals and drift"),
    "methods": Field(list, ["fedavg"], "methods to run, names or {name: ..., params}"),
    "output": Field(str, "runs", "folder under which run folders are made"),
}


def load(path: str | Path, overrides: list[str] = (), methods: list[str] | None = None) -> dict:
    """Read, override and validate a scenario; raise ConfigError naming the file.

    `methods` (flt compare) keeps the scenario's entries of those names, with their
    parameters and labels, and adds a default entry for a name the scenario lacks."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: scenario file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    try:
        for item in overrides:
            apply_override(raw, item)
        if methods is not None:
            raw["methods"] = select_methods(raw.get("methods") or [], methods)
        return resolve(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def apply_override(raw: dict, item: str) -> None:
    """`--set train.lr=0.05`: the value is parsed as YAML (numbers, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, value = item.split("=", 1)
    node, parts = raw, key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def resolve(raw: dict) -> dict:
    cfg = validate(copy.deepcopy(raw), SCENARIO)
    cfg["methods"] = [m.__dict__ for m in parse_methods(cfg["methods"])]
    _check_events(cfg["population"], cfg["train"]["rounds"])
    if cfg["devices"]["processes"] == 0 and cfg["devices"]["external"] == 0:
        raise ConfigError("devices.processes: 0 local processes and no external devices: nobody would train")
    for dev, rnd in cfg["devices"]["crash"].items():
        if not (isinstance(dev, int) and isinstance(rnd, int) and rnd >= 1):
            raise ConfigError(f"devices.crash: expected {{device index: round}}, got {dev!r}: {rnd!r}")
    p = cfg["partition"]
    if p["kind"] in ("clusters", "structured") and p["classes_per_cluster"] <= p["shared_classes"]:
        raise ConfigError("partition.shared_classes: must be smaller than partition.classes_per_cluster")
    if cfg["data"]["dataset"] != "digits" and not cfg["data"]["root"] and not cfg["data"]["download"]:
        raise ConfigError(f"data.root: dataset {cfg['data']['dataset']!r} needs a data root "
                          "(or data.download: true on a machine with internet)")
    return cfg


def _check_events(pop: dict, rounds: int) -> None:
    for kind, need in (("newcomers", ("round",)), ("drift", ("round", "clients"))):
        for i, ev in enumerate(pop[kind]):
            where = f"population.{kind}[{i}]"
            if not isinstance(ev, dict):
                raise ConfigError(f"{where}: expected a mapping")
            if kind == "drift":
                need = need + (("labels",) if ev.get("kind") == "swap_labels" else ("to_cluster",))
                if ev.get("kind", "move") not in ("move", "swap_labels"):
                    raise ConfigError(f"{where}.kind: 'move' or 'swap_labels', got {ev.get('kind')!r}")
            optional = {"cluster", "clients"} if kind == "newcomers" else {"kind"}
            extra = set(ev) - set(need) - optional
            if extra:
                raise ConfigError(f"{where}: unknown field(s) {sorted(extra)}")
            for key in need:
                if key not in ev:
                    raise ConfigError(f"{where}.{key}: required field is missing")
            if not isinstance(ev["round"], int) or not 2 <= ev["round"] <= rounds:
                raise ConfigError(f"{where}.round: expected a round in 2..{rounds}, got {ev['round']!r}")
            if kind == "newcomers" and ("cluster" in ev) == ("clients" in ev):
                raise ConfigError(f"{where}: give either 'cluster' or 'clients'")


def select_methods(entries: list, names: list[str]) -> list:
    if not names:
        raise ConfigError("--methods: name at least one method")
    named = [(e if isinstance(e, str) else e.get("name") if isinstance(e, dict) else None, e) for e in entries]
    chosen = []
    for name in names:
        if name not in STRATEGIES:
            raise ConfigError(f"--methods: unknown method {name!r}; known: {', '.join(STRATEGIES)}")
        chosen += [e for n, e in named if n == name] or [name]
    return chosen


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
        if name not in STRATEGIES:
            raise ConfigError(f"{where}.name: unknown method {name!r}; known: {', '.join(STRATEGIES)}")
        params = validate(entry, STRATEGIES[name].PARAMS, f"{where}({name})")
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
