"""`flt suite`: many scenarios, one folder each; finished ones skipped, interrupted ones
resumed; progress as a bar on a terminal and as thinned lines elsewhere."""

import io
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from flt_command import flt  # tests/ is on sys.path under pytest

from flt.common.schema import ConfigError
from flt.emulator import config, suite
from flt.models.autoencoder import ConvAE
from flt.reports import terminal
from flt.reports.terminal import Display, end_line, step
from flt.server.encoder import pretrain

REPO = Path(__file__).resolve().parents[1]
TINY = """name: {name}
seed: {seed}
data: {{dataset: digits}}
partition: {{kind: clusters, clients: 6, clusters: 2, classes_per_cluster: 2, samples_per_client: 30,
            test_per_client: 10, public_fraction: 0.2}}
model: mlp
train: {{rounds: 2, participation: 0.5, local_epochs: 1, batch_size: 10, lr: 0.05}}
devices: {{processes: 1}}
methods: [fedavg, local]
"""


def scenarios(folder: Path, names=("tiny_a", "tiny_b")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(names):
        (folder / f"{seed}_{name}.yaml").write_text(TINY.format(name=name, seed=seed))
    return folder


def finish(entry: suite.Entry, rounds: int) -> None:
    """A folder as a run leaves it, each method at `rounds` rounds (no processes)."""
    entry.folder.mkdir(parents=True)
    (entry.folder / "config.yaml").write_text(config.dump(entry.cfg))
    for name in suite.RUN_FILES[1:]:
        (entry.folder / name).write_bytes(b"")
    methods = {m["label"]: {"label": m["label"], "rounds": rounds} for m in entry.cfg["methods"]}
    (entry.folder / "summary.json").write_text(json.dumps({"methods": methods}))
    for m in entry.cfg["methods"]:
        (entry.folder / m["label"]).mkdir()
        (entry.folder / m["label"] / "metrics.jsonl").write_text('{"round": 1}\n' * rounds)


# -- planning: what to run, skip or resume ----------------------------------------------
def test_a_folder_gives_its_scenarios_in_name_order_and_bad_paths_are_named(tmp_path):
    folder = scenarios(tmp_path / "sc")
    assert [f.name for f in suite.scenario_files([folder])] == ["0_tiny_a.yaml", "1_tiny_b.yaml"]
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such scenario file"):
        suite.scenario_files([tmp_path / "nope.yaml"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: no scenario files"):
        suite.scenario_files([tmp_path / "empty"])


def test_every_scenario_is_validated_before_any_runs(tmp_path):
    folder = scenarios(tmp_path / "sc")
    (folder / "2_bad.yaml").write_text(TINY.format(name="bad", seed=0).replace("lr: 0.05", "lrr: 0.05"))
    with pytest.raises(ConfigError, match=r"2_bad.yaml: train.lrr"):
        suite.plan([folder], [], tmp_path / "out")
    (folder / "2_bad.yaml").write_text(TINY.format(name="tiny_a", seed=5))
    with pytest.raises(ConfigError, match="name 'tiny_a' is also"):
        suite.plan([folder], [], tmp_path / "out")


def test_state_new_finished_interrupted_and_a_changed_scenario(tmp_path):
    a, b = suite.plan([scenarios(tmp_path / "sc")], ["train.rounds=3"], tmp_path / "out")
    assert a.cfg["train"]["rounds"] == 3 and a.folder == tmp_path / "out" / "tiny_a"
    assert suite.state(a) == "new"
    a.folder.mkdir(parents=True)
    (a.folder / ".lock").write_text("123\n")  # killed the instant it locked its folder
    assert suite.state(a) == "new"
    shutil.rmtree(a.folder)
    finish(a, 3)
    finish(b, 2)  # killed: its methods stopped at round 2 of 3
    assert suite.state(a) == "finished" and suite.state(b) == "interrupted"
    assert suite.rounds_done(a) == 6 and suite.rounds_done(b) == 4
    (b.folder / "summary.json").unlink()  # killed before its first round: still resumable
    assert suite.state(b) == "interrupted"
    (b.folder / "partition.npz").unlink()  # killed before the partition was saved: starts again
    assert suite.state(b) == "new"
    changed = suite.plan([tmp_path / "sc"], ["train.rounds=3", "train.lr=0.1"], tmp_path / "out")[0]
    with pytest.raises(ConfigError, match=r"0_tiny_a.yaml: differs from the run in .*\(train.lr: now 0.1, was 0.05\)"):
        suite.state(changed)
    (a.folder / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="is not a run folder"):
        suite.state(a)


# -- progress: bars on a terminal, thinned lines elsewhere -------------------------------
def test_plain_output_prints_every_nth_step_the_last_and_forced_ones():
    lines: list[str] = []
    for i in range(1, 101):
        step(lines.append, i, 100, f"round {i}", "round", force=i == 33)
    assert lines == [f"round {i}" for i in (10, 20, 30, 33, 40, 50, 60, 70, 80, 90, 100)]
    out = io.StringIO()
    display = Display(out, tty=False)
    for i in range(1, 21):
        display.step(i, 20, f"round {i}", "round")
    printed = out.getvalue().splitlines()
    assert len(printed) == 10 and "\r" not in out.getvalue() and printed[-1].startswith("round 20")
    assert printed[0].startswith("round 2  ~") and printed[0].endswith("left")  # the time left, at this pace


def test_terminal_output_redraws_one_bar_and_keeps_the_last_line():
    out = io.StringIO()
    display = Display(out, tty=True)
    for i in range(1, 6):
        display.step(i, 5, f"round {i}", "round")
        if i == 2:
            display("a newcomer joined")  # a permanent line clears the bar, then it comes back
    text = out.getvalue()
    assert text.count("\n") == 2 and text.endswith("round 5\n")
    assert "\r[####----------------] round 1" in text and "\r\x1b[Ka newcomer joined\n" in text
    assert "left | round 4\x1b[K\r\x1b[Kround 5\n" in text  # the bar erased before the last line
    assert "[####################]" not in text  # the last step prints its line, not a full bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("where", ["pipe", "terminal", "terminal with a bar"])
def test_a_stop_line_starts_a_new_line_only_after_the_shells_echo(where, monkeypatch):
    """Ctrl-C on a terminal echoes `^C` where the cursor is: the stop's line must start on a
    line of its own, or where a bar (and the echo) was erased. In a pipe or a log there is
    no echo, and a newline there was a blank line before the one line a stop prints."""
    screen = _Terminal() if where.startswith("terminal") else io.StringIO()
    monkeypatch.setattr("sys.stderr", screen)
    display = Display(screen, tty=where.startswith("terminal"))
    monkeypatch.setattr(terminal, "_ACTIVE", display)
    if where.endswith("bar"):
        display.step(1, 5, "round 1", "round")
    assert end_line() == ("\n" if where == "terminal" else "")
    assert display.status == "" and screen.getvalue().endswith("\r\x1b[K" if where.endswith("bar") else "")


def test_encoder_pretraining_is_a_bar_not_a_line_per_epoch_and_warns_nothing():
    images = np.random.default_rng(0).integers(0, 255, (8, 1, 28, 28), dtype=np.uint8)
    settings = {"seed": 0, "lr": 1e-3, "epochs": 20, "batch_size": 8, "latent": 16}
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the requires_grad UserWarning among them
        loss = pretrain(ConvAE((1, 28, 28), 16), images, settings, torch.device("cpu"), lines.append)
    assert isinstance(loss, float) and loss > 0
    assert len(lines) == 10 and "epoch 20/20" in lines[-1]


def test_suite_lines_say_which_scenario_and_how_much_is_left(tmp_path):
    entries = suite.plan([scenarios(tmp_path / "sc")], [], tmp_path / "out")  # 2 x 2 methods x 2 rounds
    out = io.StringIO()
    display = suite.SuiteDisplay(entries, stream=out, tty=False)
    display.begin(1, 4)  # the first scenario's 4 rounds are done
    display.step(1, 2, "[fedavg] round 1/2", "round")
    line = out.getvalue().strip()
    assert line.startswith("[2/2 tiny_b] [fedavg] round 1/2") and "suite 62%" in line and line.endswith("left")


# -- the command, end to end ---------------------------------------------------------------


@pytest.mark.slow
def test_suite_runs_skips_the_finished_and_resumes_the_interrupted(tmp_path):
    folder, out = scenarios(tmp_path / "sc"), tmp_path / "out"
    res = flt("suite", str(folder), "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "scenario 1 of 2: tiny_a" in res.stdout and "scenario 2 of 2: tiny_b" in res.stdout
    assert "[2/2 tiny_b] [local] round   2/2" in res.stdout and "suite 100%" in res.stdout
    for name in ("tiny_a", "tiny_b"):
        methods = json.loads((out / name / "summary.json").read_text())["methods"]
        assert {m: v["rounds"] for m, v in methods.items()} == {"fedavg": 2, "local": 2}
    assert (out / "tiny_a" / "command.txt").read_text().startswith("flt suite ")
    before = json.loads((out / "tiny_b" / "summary.json").read_text())["methods"]

    # tiny_b as a kill during its second method leaves it; tiny_a stays finished
    summary = json.loads((out / "tiny_b" / "summary.json").read_text())
    del summary["methods"]["local"]
    (out / "tiny_b" / "summary.json").write_text(json.dumps(summary))
    shutil.rmtree(out / "tiny_b" / "local")
    fedavg_mtime = (out / "tiny_b" / "fedavg" / "metrics.jsonl").stat().st_mtime_ns
    res = flt("suite", str(folder), "--out", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "tiny_a (" in res.stdout and "finished before, skipped" in res.stdout
    assert "tiny_b" in res.stdout and "resuming from the last checkpoint" in res.stdout
    assert "[1/2 tiny_a] [" not in res.stdout  # nothing of tiny_a ran again
    after = json.loads((out / "tiny_b" / "summary.json").read_text())["methods"]
    assert (out / "tiny_b" / "fedavg" / "metrics.jsonl").stat().st_mtime_ns == fedavg_mtime  # kept
    assert after["local"]["final_accuracy"] == before["local"]["final_accuracy"]  # as the first time


def test_a_second_suite_into_a_live_suites_folder_is_refused(tmp_path):
    """Two suites in one folder each ran the scenarios the other had not reached, and then
    failed on the ones it held; the second is now refused before it runs anything."""
    import os

    from flt.common.files import folder_lock

    folder, out = scenarios(tmp_path / "sc"), tmp_path / "out"
    out.mkdir()
    with folder_lock(out, "--out"):  # as a live `flt suite` holds it
        res = flt("suite", str(folder), "--out", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"--out: {out} is in use by another flt run (process {os.getpid()})" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no scenario started
