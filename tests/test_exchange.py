"""One clocked path for every exchange: set-up and re-clustering cost emulated time too.

The unit tests price exchanges on hand-made profiles; the end-to-end test runs FedAvg and
FLT on real device processes with phone-like profiles and checks that FLT's clock at round
1 leads FedAvg's by exactly the FCR exchange priced by hand (encoder down, embedding,
centroids up), and that without profiles nothing about the run changes but the clock.
"""

import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from flt_command import flt  # tests/ is on sys.path under pytest

from flt.common.wire import Message
from flt.emulator.config import parse_methods
from flt.emulator.population import Population
from flt.emulator.profiles import Profiles
from flt.server.exchange import Exchange
from flt.server.ops import embedded as _embedded
from flt.server.ops import trained as _trained
from flt.server.strategies.base import Context
from flt.server.strategies.flt import FLT

REPO = Path(__file__).resolve().parents[1]
MB = 1_000_000


def phones(n: int, ms: float = 20.0, up_mbit: float = 1.0, down_mbit: float = 5.0, latency_ms: float = 50.0):
    return Profiles(
        ms_per_sample=np.full(n, ms),
        up_bps=np.full(n, up_mbit * 1e6 / 8),
        down_bps=np.full(n, down_mbit * 1e6 / 8),
        latency_s=np.full(n, latency_ms / 1000),
        windows=[np.zeros((0, 2))] * n,
    )


def test_a_one_off_exchange_waits_for_every_client_and_moves_the_clock():
    pop = Population(3, rho=1.0, seed=0, profiles=phones(3), deadline_s=5.0)
    # 1 MB down at 5 Mbit/s = 1.6 s; 100 forward passes x 20 ms = 2 s; 2,560 B up at 1 Mbit/s
    kept, clock = pop.price("fcr", np.arange(3), MB, 2560, [100, 100, 400], 0)
    slowest = 1.6 + 0.05 + 400 * 0.020 + 2560 / 125_000 + 0.05
    assert kept.tolist() == [0, 1, 2] and clock["stragglers"] == 0  # no deadline cuts FCR short
    assert clock["duration_s"] == pytest.approx(slowest) and pop.clock.now_s == pytest.approx(slowest)
    # a round after it starts where FCR left the clock, and its deadline does apply
    kept, clock = pop.price("train", np.arange(3), 0, 0, 0, [10, 10, 1000])  # 3 x 20 ms a sample
    assert sorted(kept.tolist()) == [0, 1] and clock["stragglers"] == 1
    assert clock["emulated_s"] == pytest.approx(slowest + 5.0)


def test_decoding_an_exchange_releases_each_raw_reply_before_the_next():
    """`decoded` keeps the clients, the kept order and the report, and lets each raw reply
    go once it is decoded, so a large exchange is not held raw and decoded at once."""

    class Raw:
        def __init__(self, value):
            self.value = value

    replies = {2: Raw(20), 0: Raw(0)}
    refs = [weakref.ref(r) for r in replies.values()]
    raw = Exchange(replies, [0, 2], {"kind": "train"})
    del replies
    alive = []

    def decode(reply):
        alive.append(sum(r() is not None for r in refs))  # raw replies still held
        return reply.value + 1

    out = raw.decoded(decode)
    assert out.results == {2: 21, 0: 1} and out.kept == [0, 2] and out.report == {"kind": "train"}
    assert alive == [2, 1] and raw.results == {}


def test_without_profiles_nothing_is_priced():
    pop = Population(3, rho=1.0, seed=0)
    kept, clock = pop.price("fcr", np.arange(3), MB, MB, 100, 100)
    assert kept.tolist() == [0, 1, 2] and clock == {} and pop.clock.now_s == 0.0


def test_embedding_work_counts_forward_passes_and_fine_tuning_batches():
    frozen = Message("encoder", 0, 1, meta={"format": "onnx"})
    tuned = Message("encoder", 0, 1, meta={"format": "autoencoder", "finetune": {"epochs": 5, "batch_size": 32}})
    reply = Message("centroids", 0, 1, meta={"n": 70})
    assert _embedded(frozen, reply) == (70.0, 0.0)
    assert _embedded(tuned, reply) == (70.0, 5 * 3 * 32)  # 3 batches of 32 per epoch, as training counts
    assert _trained(Message("train", 1, 1, meta={"batch_size": 10}), Message("update", 1, 1, meta={"steps": 8})) == (
        0.0,
        80.0,
    )


PHONES = (
    "population.profiles={distribution: {compute: {dist: constant, ms_per_sample: 20}, "
    "network: [{share: 1.0, up_mbps: 1, down_mbps: 5}], latency_ms: {dist: constant, value: 50}}}"
)
TINY = [
    "--set",
    "train.rounds=1",
    "--set",
    "devices.processes=1",
    "--set",
    "methods=[fedavg, {name: flt, encoder: {dataset: public, epochs: 2}}]",
]


def records(run: Path, label: str) -> list[dict]:
    return [json.loads(x) for x in (run / label / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fcr_is_priced_on_the_clock_and_nothing_else_changes(tmp_path):
    priced, bare = tmp_path / "phones", tmp_path / "bare"
    for out, extra in ((priced, ["--set", PHONES]), (bare, [])):
        res = flt("run", "scenarios/quickstart.yaml", "--out", str(out), *TINY, *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    fedavg, flt1 = records(priced, "fedavg")[0], records(priced, "flt")[0]
    summary = json.loads((priced / "summary.json").read_text())["methods"]["flt"]
    (fcr,) = [e for e in flt1["events"] if e["kind"] == "exchange"]
    assert fcr["exchange"] == "fcr" and fcr["round"] == 0 and set(fcr["bytes"]) == {"down", "up"}
    assert not [e for e in fedavg["events"] if e["kind"] == "exchange"]  # rounds are the record itself

    # FCR priced by hand: every client downloads the ONNX encoder, embeds its shard (one
    # forward pass a sample) and uploads k x e float32 centroids and their k shares, for its
    # shard and for each half of it (3k rows); FCR ends at the slowest
    parts = np.load(priced / "partition.npz")
    n = np.diff(parts["train_offsets"]).max()
    k, latent = 5, 128
    cost = summary["fcr"]["encoder_bytes"] / (5e6 / 8) + 0.05 + n * 0.020 + 3 * k * (latent + 1) * 4 / (1e6 / 8) + 0.05
    assert fcr["duration_s"] == pytest.approx(cost)
    assert summary["fcr_emulated_s"] == pytest.approx(cost) and summary["fcr"]["emulated_s"] == pytest.approx(cost)
    # the same clients train the same bytes in round 1: FLT's clock leads by FCR alone
    assert flt1["round_s"] == pytest.approx(fedavg["round_s"])
    assert flt1["emulated_s"] - fedavg["emulated_s"] == pytest.approx(cost)

    # without profiles: no clock anywhere, and the run itself is the same
    plain = records(bare, "flt")[0]
    assert (
        "emulated_s" not in plain
        and "fcr_emulated_s" not in json.loads((bare / "summary.json").read_text())["methods"]["flt"]
    )
    assert plain["bytes"] == flt1["bytes"] and plain["acc_mean"] == flt1["acc_mean"]
    (bare_fcr,) = [e for e in plain["events"] if e["kind"] == "exchange"]
    assert bare_fcr["bytes"] == fcr["bytes"] and "duration_s" not in bare_fcr


class PricedEmbedder:
    """Stands in for the federation's embed call with a fixed price per exchange (the real
    call is run end to end above): every client answers near its cluster's centre."""

    def __init__(self, truth: np.ndarray, seconds: float, nbytes: int):
        self.truth, self.seconds, self.nbytes = truth, seconds, nbytes
        self.present = np.arange(len(truth))

    def embed(self, rnd, clients, tensors, meta, purpose="fcr", again=()) -> Exchange:
        rng = np.random.default_rng(rnd)
        got = {
            int(c): (
                (np.eye(8)[self.truth[c]] * 5 + 0.1 * rng.normal(size=(3, 8))).astype(np.float32),
                np.full(3, 1 / 3),
                None,  # no halves
            )
            for c in clients
        }
        return Exchange(
            got,
            sorted(got),
            {
                "kind": "exchange",
                "exchange": purpose,
                "duration_s": self.seconds,
                "bytes": {"down": {"encoder": self.nbytes}},
            },
        )


def test_flt_reports_what_its_exchanges_cost_without_reading_the_ledger(tmp_path):
    truth = np.repeat(np.arange(3), 4)
    ctx = Context(
        init=torch.zeros(6),
        n_clients=len(truth),
        n_train=np.full(len(truth), 50),
        device=torch.device("cpu"),
        seed=0,
        truth=truth,
        train={"rounds": 10, "participation": 0.5},
    )
    s = FLT(ctx, **parse_methods([{"name": "flt", "recluster_every": 2}])[0].params)
    s.encoder_payload = lambda: ({"onnx": np.zeros(4, np.uint8)}, {"format": "onnx"}, {})
    fed = PricedEmbedder(truth, seconds=7.5, nbytes=1234)  # no transport: FLT may not reach for one
    s.setup(fed)
    (event,) = s.maintain(2, fed)
    assert event["fcr_bytes"] == 1234 and s.fcr_reports[1]["emulated_s"] == 7.5
    summary = s.summary()
    assert summary["fcr_emulated_s"] == 7.5 and summary["recluster_emulated_s"] == 7.5
