"""`flt report`: one self-contained HTML page, Markdown and CSV, opened in a real browser."""

import base64
import csv
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from flt.common.schema import ConfigError
from flt.reports import html as html_report
from flt.reports.summary import table

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# counts the images the browser decoded, once the page has loaded, into the DOM
IMAGE_PROBE = (
    "<script>addEventListener('load', () => { const im = [...document.images]; "
    "document.body.dataset.images = im.length + '/' + "
    "im.filter(i => i.complete && i.naturalWidth > 0).length; });</script>"
)


def _png(path: Path, color: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.imshow([[0, 1], [1, 0]], cmap="gray" if color == "gray" else "viridis")
    fig.savefig(path, dpi=40)
    plt.close(fig)


def _record(method: str, rnd: int, acc: float, events=()) -> dict:
    mb = rnd * 1_000_000
    return {
        "method": method,
        "round": rnd,
        "selected": 4,
        "returned": 4,
        "events": list(events),
        "emulated_s": 10.0 * rnd,
        "acc_mean": acc,
        "acc_se": 1.5,
        "acc_var": 9.0,
        "bytes": {"up": {"model": mb, "control": 10}, "down": {"model": mb, "encoder": 5000}},
        "timing": {"train_s": 0.1, "wall_s": rnd * 0.2, "setup_s": 0.0},
    }


def fake_run(folder: Path, name: str = "toy") -> Path:
    """A run folder as `flt run` leaves it, written by hand: two methods, FLT with one
    re-clustering after an arrival at round 2, its figures."""
    folder.mkdir(parents=True)
    arrival = {"kind": "arrival", "round": 2, "clients": [6, 7], "placement": "recluster", "ari": 1.0}
    recluster = {"kind": "recluster", "round": 2, "cause": "arrival", "clients": [6, 7], "clusters": 3}
    metrics = {
        "fedavg": [_record("fedavg", 1, 40.0), _record("fedavg", 2, 55.0, [arrival]), _record("fedavg", 3, 50.0)],
        "flt": [_record("flt", 1, 70.0), _record("flt", 2, 91.0, [arrival, recluster]), _record("flt", 3, 90.0)],
    }
    fcr = [
        {
            "round": 0,
            "cause": "initial",
            "n_clients": 6,
            "clusters": 2,
            "cluster_sizes": [3, 3],
            "silhouette": 0.61,
            "ari": 1.0,
            "nmi": 1.0,
            "next_cut": {"clusters": 3, "weakest_split_score": 1.5, "heldout_z": [7.5, 6.25], "smallest_cluster": 1},
        },
        {
            "round": 2,
            "cause": "arrival",
            "n_clients": 8,
            "clusters": 3,
            "cluster_sizes": [3, 3, 2],
            "silhouette": 0.55,
            "ari": 0.8,
            "nmi": 0.9,
        },
    ]
    change = {
        "kind": "arrival",
        "clients": 2,
        "round": 2,
        "measured_on": "incumbents",
        "before": 70.0,
        "lowest": 65.0,
        "lowest_round": 2,
        "rounds_to_recover": 1,
        "bytes_to_recover": 2_000_000,
        "emulated_s_to_recover": 10.0,
    }
    methods = {}
    for label, rows in metrics.items():
        (folder / label).mkdir()
        (folder / label / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        methods[label] = {
            "method": label,
            "label": label,
            "final_accuracy": rows[-1]["acc_mean"],
            "final_se": 1.5,
            "final_variance": 9.0,
            "best_accuracy": max(r["acc_mean"] for r in rows),
            "best_round": 2,
            "rounds": 3,
            "rounds_to_target": {"round": 2, "bytes": 4_005_010, "emulated_s": 20.0} if label == "flt" else None,
            "bytes_payload": {"up": {"model": 3_000_000, "control": 10}, "down": {"model": 3_000_000, "encoder": 5000}},
            "bytes_overhead": {"up": 300, "down": 400},
            "bytes_up": 3_000_310,
            "bytes_down": 3_005_400,
            "formula_payload_bytes": 6_005_000,
            "expected": {"formula": "2*rho*M*W_local*T", "bytes": 6_005_000},
            "bytes_vs_formula": 1.0,
            "emulated_s": 30.0,
            "changes": [change],
            "timing": {"wall_s": 0.6, "s_per_round": 0.1, "setup_s": 0.0},
        }
    methods["flt"] |= {"fcr_reports": fcr, "fcr": fcr[0], "found_clusters": [0, 0, 0, 1, 1, 1, 2, 2]}
    (folder / "summary.json").write_text(json.dumps({"scenario": name, "methods": methods}))
    (folder / "config.yaml").write_text(f"name: {name}\ntrain:\n  rounds: 3\n  target_accuracy: 80.0\n")
    (folder / "command.txt").write_text(f"flt run scenarios/{name}.yaml --out {folder}\n")
    _png(folder / "flt" / "adjacency.png", "gray")
    _png(folder / "flt" / "dendrogram.png", "gray")
    _png(folder / "flt" / "adjacency-round2.png", "color")
    _png(folder / "flt" / "centroids-round2.png", "color")
    return folder


def _images(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]*)"', page)


def test_page_is_self_contained_and_covers_every_section(tmp_path):
    page = html_report.build([fake_run(tmp_path / "run")], tmp_path / "out").read_text()
    srcs = _images(page)
    # convergence + FLT's 4 figures, every one a PNG inside the page
    assert len(srcs) == 5 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert all(base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n" for s in srcs)
    assert not re.search(r'(src|href)="(?!data:)', page) and "http" not in page.replace("http-equiv", "")
    for text in (
        "91.00 ± 1.50 (2)",  # best accuracy with its s.e. and round
        "90.00 ± 1.50",  # final
        "up control MB",
        "down encoder MB",
        "2*rho*M*W_local*T",
        "1.0000",
        "2, 4.01, 20.0 s",  # to the 80 % target: round, MB, emulated time
        "not reached",  # FedAvg never got there
        "round 2 (arrival): 3 clusters, ARI 0.80, NMI 0.90",
        "rounds_to_recover",
        "recluster",
        "flt run scenarios/toy.yaml",
        "target_accuracy: 80.0",
    ):
        assert text in page, text


def test_markdown_and_csv_hold_the_same_tables(tmp_path):
    out = tmp_path / "out"
    html_report.build([fake_run(tmp_path / "run")], out)
    md = (out / "report.md").read_text()
    assert "| toy | flt | 3 | 90.00 ± 1.50 | 91.00 ± 1.50 (2) |" in md
    with open(out / "methods.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(rows["flt"]["final_accuracy"]) == 90.0 and rows["flt"]["ari"] == "0.8"
    assert rows["fedavg"]["ari"] == "" and int(rows["flt"]["down_encoder"]) == 5000
    with open(out / "fcr.csv") as f:
        fcr_table = list(csv.DictReader(f))
    assert [r["round"] for r in fcr_table] == ["0", "2"]
    # why not one cluster more, where the run reported it (the later record did not)
    assert [r["next_clusters"] for r in fcr_table] == ["3", ""]
    assert fcr_table[0]["next_weakest_split"] == "1.5" and fcr_table[0]["next_heldout_z"] == "6.25"
    with open(out / "changes.csv") as f:
        assert {r["method"] for r in csv.DictReader(f)} == {"fedavg", "flt"}


@pytest.mark.slow
def test_a_folder_of_runs_is_expanded_and_a_wrong_folder_named(tmp_path):
    fake_run(tmp_path / "suite" / "a", "a")
    fake_run(tmp_path / "suite" / "b", "b")
    assert html_report.run_folders([tmp_path / "suite"]) == [tmp_path / "suite" / "a", tmp_path / "suite" / "b"]
    page = html_report.build([tmp_path / "suite"], tmp_path / "out").read_text()
    assert "All methods" in page and page.count("<h2>") == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: no summary\.json"):
        html_report.run_folders([tmp_path / "empty"])


@pytest.mark.parametrize(
    "damage, words",
    [
        (("summary.json", b"[1, 2]"), r"summary\.json: no 'methods' mapping"),
        (("fedavg/metrics.jsonl", b"\xff\xfe"), r"metrics\.jsonl: not UTF-8 text \(invalid start byte at byte 0\)"),
        (("fedavg/metrics.jsonl", b"1\n{}\n"), r"metrics\.jsonl: line 1 is a JSON int, not one round's record"),
    ],
)
def test_a_damaged_run_folder_is_named_not_a_traceback(tmp_path, damage, words):
    run = fake_run(tmp_path / "run")
    (run / damage[0]).write_bytes(damage[1])
    with pytest.raises(ConfigError, match=words):
        html_report.build([run], tmp_path / "out")


def _set(tree: dict, path: str, value) -> None:
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in parents:
        tree = tree[key]
    tree[last] = value


@pytest.mark.parametrize(
    "file, path, value",
    [  # each was a traceback (KeyError, TypeError, AttributeError, ValueError), found by damaging every field
        ("summary.json", "scenario", {"a": 1}),
        ("summary.json", "methods.fedavg", "x"),
        ("summary.json", "methods.fedavg.final_accuracy", "x"),
        ("summary.json", "methods.flt.bytes_payload.up", "x"),
        ("summary.json", "methods.flt.bytes_up", [1]),
        ("summary.json", "methods.flt.timing.wall_s", "x"),
        ("summary.json", "methods.flt.fcr_reports.0.cluster_sizes", None),
        ("summary.json", "methods.flt.rounds_to_target", "x"),
        ("flt/metrics.jsonl", "acc_mean", "x"),
        ("flt/metrics.jsonl", "bytes.up", None),
    ],
)
def test_a_field_of_the_wrong_type_names_the_run_folder(tmp_path, file, path, value):
    run = fake_run(tmp_path / "run")
    if file == "summary.json":
        summary = json.loads((run / file).read_text())
        _set(summary, path, value)
        (run / file).write_text(json.dumps(summary))
    else:
        records = [json.loads(line) for line in (run / file).read_text().splitlines()]
        _set(records[1], path, value)
        (run / file).write_text("".join(json.dumps(r) + "\n" for r in records))
    try:
        html_report.build([run], tmp_path / "out")  # a value it can show, or a field it does not read
    except ConfigError as exc:
        assert str(exc).startswith(f"{run}: its summary.json, metrics.jsonl or config.yaml is not as flt writes it")


def test_final_table_gives_clusters_ari_and_emulated_time(tmp_path):
    summary = json.loads((fake_run(tmp_path / "run") / "summary.json").read_text())
    lines = table(summary).splitlines()
    assert lines[0].split()[-4:] == ["clusters", "ARI", "emulated", "s/round"]
    flt = next(line for line in lines if line.startswith("flt"))
    assert flt.split()[-5:-1] == ["3", "0.80", "30", "s"]  # FCR's latest clustering
    assert next(line for line in lines if line.startswith("fedavg")).split()[-5:-3] == ["-", "-"]


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[str, Path]:
    """The DOM after load (with the image probe) and a screenshot, from headless Chromium."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium); .ci/run installs it")
    probed = page.with_name("probed.html")
    probed.write_text(page.read_text().replace("</body>", IMAGE_PROBE + "</body>"))
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--virtual-time-budget=5000",
    ]
    dom = subprocess.run(
        [*flags, f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", probed.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = tmp_path / "page.png"
    res = subprocess.run(
        [
            *flags,
            f"--user-data-dir={tmp_path / 'profile-shot'}",
            "--window-size=1400,2000",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    return dom.stdout, shot


@pytest.mark.slow
def test_page_renders_in_a_headless_browser_with_every_image(tmp_path):
    page = html_report.build([fake_run(tmp_path / "run")], tmp_path / "out")
    dom, shot = open_in_chromium(page, tmp_path)
    assert "<h1>flt report: toy</h1>" in dom and "<table>" in dom
    assert re.search(r'data-images="5/5"', dom), dom[-500:]  # all five decoded, none broken
    assert shot.stat().st_size > 10_000


@pytest.mark.slow
def test_report_of_a_real_run_through_the_cli(tmp_path):
    """A tiny real run (digits, 3 rounds, a cluster arriving at round 2), then `flt report`."""
    run = tmp_path / "run"
    flt = [sys.executable, "-m", "flt.emulator.cli"]
    res = subprocess.run(
        [
            *flt,
            "run",
            str(REPO / "scenarios" / "dynamic_digits.yaml"),
            "--out",
            str(run),
            "--set",
            "train.rounds=3",
            "--set",
            "partition.clients=10",
            "--set",
            "population.newcomers=[{round: 2, cluster: 4}]",
            "--set",
            "population.drift=[]",
            "--set",
            "methods=[{name: flt, encoder: {dataset: public, epochs: 3}}, fedavg]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    assert (run / "command.txt").read_text().startswith("flt run ")
    # the terminal says what each clustering found, as it happens
    fcr_runs = json.loads((run / "summary.json").read_text())["methods"]["flt"]["fcr_reports"]
    first, arrival = fcr_runs[0], fcr_runs[1]
    assert f"[flt] FCR at set-up: {first['clusters']} cluster" in res.stdout
    assert "[flt] FCR at round 2 (arrival" in res.stdout and f"ARI {arrival['ari']:.3f}" in res.stdout
    res = subprocess.run([*flt, "report", str(run)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    page = run / "report" / "report.html"
    html = page.read_text()
    assert "round 2 (arrival)" in html and "adjacency-round2.png" in html and "rounds_to_recover" in html
    assert "clusters_timeline.png" in html  # who was in which cluster, round by round
    last = json.loads((run / "fedavg" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(last["per_client"]["client"]) == last["n_eval"] == 10  # every client's score is kept
    with open(run / "report" / "groups.csv") as f:
        groups = list(csv.DictReader(f))
    assert {r["method"] for r in groups} == {"flt", "fedavg"} and sum(int(r["clients"]) for r in groups) == 2 * 10
    dom, _ = open_in_chromium(page, tmp_path)
    count = len(_images(html))
    assert count >= 6 and f'data-images="{count}/{count}"' in dom


def test_a_shifted_run_shows_what_each_group_sees(tmp_path):
    run = fake_run(tmp_path / "run")
    _png(run / "shift_examples.png", "color")
    (run / "shift.json").write_text(json.dumps({"kind": "rotate", "groups": [{"group": 0, "level": 0.0}]}))
    page = html_report.build([run], tmp_path / "out").read_text()
    assert "Shift between clusters: rotate" in page and len(_images(page)) == 6


def test_an_evaluation_no_client_answered_is_never_the_best_round():
    """A round whose evaluation nobody answered records NaN (seen when a shared GPU ran out
    of memory); the best accuracy is the best of the rounds that were measured."""
    from types import SimpleNamespace

    import numpy as np

    from flt.reports.summary import method_summary

    no_rejections = SimpleNamespace(summary=lambda: {})
    ledger = SimpleNamespace(
        rejections=no_rejections,
        totals=lambda since_round=None: {
            d: {k: {"payload": 0, "overhead": 0} for k in ("model", "encoder", "embedding")} for d in ("up", "down")
        },
    )
    transport = SimpleNamespace(ledger=ledger, lost_clients=lambda: np.zeros(0, np.int64))
    strategy = SimpleNamespace(expected_bytes=lambda selections, model_bytes: None, summary=lambda: {})
    timing = {"train_s": 0.1, "setup_s": 1.0, "wall_s": 5.0}
    accs = [(1, None), (2, float("nan")), (3, 40.0), (4, 55.0), (5, 50.0)]
    history = [
        {"round": r, "selected": 2, "timing": timing, **({"acc_mean": acc} if acc is not None else {})}
        for r, acc in accs
    ]
    spec = {"name": "fedavg", "label": "fedavg", "params": {}}
    cfg = {"train": {"target_accuracy": None}}
    m = method_summary(spec, history, strategy, transport, 4, cfg)
    assert (m["best_accuracy"], m["best_round"]) == (55.0, 4)
    assert m["final_accuracy"] == 50.0


def test_accuracy_by_planted_cluster_shows_who_a_method_serves(tmp_path):
    """FedAvg's mean hides that it serves the big cluster and fails the small one;
    groups.csv and the page show it per planted cluster, from the last evaluation."""
    from flt.scenarios.partition import Partition

    run = fake_run(tmp_path / "run")
    sizes = [50, 50, 50, 5, 5, 5]  # cluster 0 holds ten times the samples of cluster 1
    Partition(
        train=[list(range(100 * c, 100 * c + n)) for c, n in enumerate(sizes)],
        test=[[c] for c in range(6)],
        cluster=[0, 0, 0, 1, 1, 1],
    ).save(run / "partition.npz")
    scores = {"client": list(range(6)), "correct": [9, 10, 8, 1, 0, 2], "total": [10] * 6}
    records = [json.loads(line) for line in (run / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    records[-1]["per_client"] = scores
    (run / "fedavg" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    page = html_report.build([run], out).read_text()
    with open(out / "groups.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["cluster"], r["clients"], r["train_samples"]) for r in rows] == [
        ("fedavg", "0", "3", "150"),
        ("fedavg", "1", "3", "15"),
    ]  # flt's records carry no per-client scores (a run from before they were kept): no rows
    assert [float(r["accuracy"]) for r in rows] == pytest.approx([90.0, 10.0])
    assert [float(r["lowest"]) for r in rows] == pytest.approx([80.0, 0.0])
    assert "Accuracy by planted cluster" in page and "Accuracy by planted cluster" in (out / "report.md").read_text()


def test_no_cluster_table_without_planted_clusters_or_with_a_damaged_record(tmp_path):
    from flt.scenarios.partition import Partition

    run = fake_run(tmp_path / "run")
    Partition(train=[[0], [1]], test=[[0], [1]], cluster=[-1, -1]).save(run / "partition.npz")
    records = [json.loads(line) for line in (run / "flt" / "metrics.jsonl").read_text().splitlines()]
    records[-1]["per_client"] = {"client": [0, 1], "correct": [1, 1], "total": [1, 1]}
    (run / "flt" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html_report.build([run], tmp_path / "writers")
    assert not (tmp_path / "writers" / "groups.csv").exists()  # writers: no planted cluster
    Partition(train=[[0], [1]], test=[[0], [1]], cluster=[0, 1]).save(run / "partition.npz")
    records[-1]["per_client"] = {"client": [0, 1], "correct": [1], "total": [1, 1]}
    (run / "flt" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html_report.build([run], tmp_path / "damaged")
    assert not (tmp_path / "damaged" / "groups.csv").exists()
    records[-1]["per_client"] = {"client": [0, "one"], "correct": [1, 1], "total": [1, 1]}
    (run / "flt" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html_report.build([run], tmp_path / "not_numbers")
    assert not (tmp_path / "not_numbers" / "groups.csv").exists()


def test_runs_of_one_scenario_with_different_settings_are_told_apart(tmp_path):
    """Two runs of one scenario (say, with and without `--set partition.max_per_class`)
    keep their own rows, sections and convergence figures, named by their folders."""
    a, b = fake_run(tmp_path / "capped"), fake_run(tmp_path / "as_shipped")
    out = tmp_path / "out"
    page = html_report.build([a, b], out).read_text()
    with open(out / "methods.csv") as f:
        names = {r["scenario"] for r in csv.DictReader(f)}
    assert names == {"toy (capped)", "toy (as_shipped)"}
    assert "<h2>toy (capped)</h2>" in page and "<h2>toy (as_shipped)</h2>" in page
    assert len(list(out.glob("convergence-*.png"))) == 2
    c = fake_run(tmp_path / "other" / "capped")
    html_report.build([a, c], tmp_path / "out2")
    with open(tmp_path / "out2" / "methods.csv") as f:
        assert len({r["scenario"] for r in csv.DictReader(f)}) == 2  # same folder name, other parent


def test_a_clustering_in_words_says_what_was_found_and_why_not_one_more():
    from flt.reports.fcr_text import describe_clustering

    r = {
        "clusters": 8,
        "cluster_sizes": [20, 21, 10, 10, 10, 10, 9, 10],
        "silhouette": 0.124,
        "ari": 0.751,
        "nmi": 0.904,
        "planted_clusters": 10,
        "pipeline": {"min_split": 2.25, "min_heldout_keep": 3.0},
        "next_cut": {"clusters": 9, "weakest_split_score": 1.917, "smallest_cluster": 8, "heldout_z": [8.28, 9.44]},
    }
    first, quality, why = describe_clustering(r)
    assert first == "8 clusters of sizes [20, 21, 10, 10, 10, 10, 9, 10], silhouette 0.124"
    assert quality == "ARI 0.751, NMI 0.904 against 10 planted clusters"
    assert why.startswith("why not 9: weakest split score 1.92 (min_split 2.25), smallest cluster 8, held-out z 8.3")
    assert len(describe_clustering({**r, "next_cut": None})) == 2
    assert describe_clustering({"round": 3, "cause": "flags"}) == []  # no clustering in it: nothing to say
    # a thresholded graph (Case I trains on it, not on the clusters) says how dense it is
    graph = describe_clustering({**r, "next_cut": None, "gamma": 1.095, "mean_degree": 1.26})[2]
    assert graph == "graph A~ = [A <= 1.095]: 1.26 neighbours a client, itself included"


def test_a_run_stopped_before_its_last_round_says_so(tmp_path):
    """A run killed or stopped at a time limit keeps its rounds so far; its report must not
    pass the last evaluation off as round T's."""
    run = fake_run(tmp_path / "run")
    (run / "config.yaml").write_text("name: toy\ntrain:\n  rounds: 10\n  target_accuracy: 80.0\n")
    out = tmp_path / "out"
    html_report.build([run], out)
    md = (out / "report.md").read_text()
    assert "| toy | flt | 3 of 10, stopped | 90.00 ± 1.50 (round 3) |" in md
    with open(out / "methods.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    fedavg = rows["fedavg"]
    assert (fedavg["rounds"], fedavg["rounds_planned"], fedavg["final_round"]) == ("3", "10", "3")
    html_report.build([fake_run(tmp_path / "whole")], tmp_path / "out2")  # all 3 of 3: no mark
    assert "| toy | flt | 3 | 90.00 ± 1.50 | 91.00 ± 1.50 (2) |" in (tmp_path / "out2" / "report.md").read_text()


def test_a_dendrogram_of_identical_clients_draws_without_a_warning(tmp_path):
    """Two clients at distance 0 (found by tests/shape_sweep.py): scipy's zero-height axis
    made matplotlib print a UserWarning on the user's terminal."""
    from flt.reports.figures import plot_fcr

    z = np.array([[0.0, 1.0, 0.0, 2.0]])  # one merge at height 0
    adj = np.zeros((2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = plot_fcr(tmp_path, adj, np.ones((2, 2)), z, np.arange(2), [np.zeros((1, 2))] * 2, np.zeros(2, int))
    assert [p.name for p in paths] == ["adjacency.png", "dendrogram.png", "centroids.png"]
    assert all(p.stat().st_size > 0 for p in paths)
