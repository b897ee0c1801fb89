"""Exact reruns: the same seed and scenario give the same records, bytes included, however
many device processes share the clients. Wall-clock figures live apart, in `timing`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flt_command import results_without_timing  # tests/ is on sys.path under pytest

from flt.devices import trainer as trainer_module
from flt.devices.seeds import client_generator
from flt.devices.trainer import CohortTrainer, TrainConfig
from flt.models.flat import flatten, param_spec
from flt.models.nets import build_model

REPO = Path(__file__).resolve().parents[1]
SIZES = [23, 50, 37, 61, 8]  # clients of unequal size: the cohort pads to the largest


def cohort(ids):
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 28, 28, generator=g) for n in SIZES]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in SIZES]
    return [xs[i] for i in ids], [ys[i] for i in ids]


@pytest.fixture(scope="module")
def trainer():
    # as in a device process (devices.threads: 1): with several intra-op threads a
    # cohort of one takes another matmul path, and its last bits can differ
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)  # has dropout: its masks must be per client too
    yield CohortTrainer(model, param_spec(model)), flatten(model)
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, batch_size=10, lr=0.05),
        TrainConfig(epochs=2, batch_size=10, lr=0.01, prox_mu=0.1),
        TrainConfig(epochs=1, batch_size=10, lr=0.001, optimizer="adam"),
        TrainConfig(epochs=2, batch_size=10, lr=0.05, momentum=0.5),
    ],
)
def test_a_clients_training_does_not_depend_on_its_cohort(trainer, cfg):
    tr, init = trainer
    everyone = list(range(len(SIZES)))
    full, _ = tr.train(init.expand(len(SIZES), -1), *cohort(everyone), cfg, [client_generator(7, c) for c in everyone])
    for ids in ([4], [1, 3], [0, 2, 4]):
        part, _ = tr.train(init.expand(len(ids), -1), *cohort(ids), cfg, [client_generator(7, c) for c in ids])
        for row, c in enumerate(ids):
            assert torch.equal(part[row], full[c]), (ids, c)  # bit for bit, not approximately


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, lr=0.05),
        TrainConfig(epochs=2, lr=0.05, prox_mu=0.1),
        # Adam divides by sqrt(v): where a gradient is ~0, float rounding of
        # vmap against the loop moves a weight by up to ~lr/40; a padded step
        # that wrongly applied momentum would move it by ~lr per step
        TrainConfig(epochs=2, lr=1e-4, optimizer="adam"),
        # the authors' FLT code: torch's SGD with momentum 0.5 (the loop uses torch.optim.SGD)
        TrainConfig(epochs=2, lr=0.05, momentum=0.5),
    ],
    ids=["sgd", "fedprox", "adam", "momentum"],
)
def test_the_vmapped_cohort_equals_the_per_client_loop(trainer, cfg):
    # unequal shards: the short clients' padded steps must change nothing (Adam included)
    tr, init = trainer
    ids = list(range(len(SIZES)))
    gens = lambda: [client_generator(3, c) for c in ids]  # noqa: E731
    vmapped, vloss = tr.train(init.expand(len(ids), -1), *cohort(ids), cfg, gens())
    looped, lloss = tr.train(init.expand(len(ids), -1), *cohort(ids), dataclasses.replace(cfg, vectorize=False), gens())
    assert torch.allclose(vmapped, looped, atol=1e-5, rtol=0)
    assert torch.allclose(vloss, lloss, atol=1e-5)
    other, _ = tr.train(init.expand(len(ids), -1), *cohort(ids), cfg, [client_generator(4, c) for c in ids])
    assert not torch.equal(other, vmapped)  # the round's seed does reach the batches
    if cfg.momentum:  # and the momentum reaches the steps
        plain, _ = tr.train(init.expand(len(ids), -1), *cohort(ids), dataclasses.replace(cfg, momentum=0.0), gens())
        assert not torch.allclose(plain, vmapped, atol=1e-4)


@pytest.mark.parametrize("cfg", [TrainConfig(epochs=2, lr=0.05), TrainConfig(epochs=2, lr=0.05, prox_mu=0.1)])
def test_the_hand_written_backward_equals_vmap_grad(trainer, cfg, monkeypatch):
    """The MLP's cohort SGD on a CPU takes _StackSGD (a backward pass by hand); every
    other model takes vmap(grad(...)): the two must be the same SGD, up to float rounding."""
    tr, init = trainer
    ids = list(range(len(SIZES)))
    start = init.expand(len(ids), -1) + 0.01 * torch.randn(len(ids), init.numel(), generator=torch.Generator())
    stack, sloss = tr.train(start, *cohort(ids), cfg, [client_generator(3, c) for c in ids])
    monkeypatch.setattr(trainer_module._StackSGD, "fits", classmethod(lambda cls, model, cfg: False))
    vmapped, vloss = tr.train(start, *cohort(ids), cfg, [client_generator(3, c) for c in ids])
    assert not torch.equal(stack, start)
    assert torch.allclose(stack, vmapped, atol=1e-6, rtol=0) and torch.allclose(sloss, vloss, atol=1e-6)


def test_a_clients_evaluation_and_pick_do_not_depend_on_its_cohort(trainer):
    """Bit for bit, so that a run is the same however its clients are split over devices.
    Vmapped over the padded cohort on a 2-core Xeon, the client of 8 images had other last
    bits alone than beside 61 for 2 of these 8 draws of the models, and its IFCA losses for
    6 (MKL's batched product picks its kernel by the row count)."""
    tr, init = trainer
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8) for n in SIZES]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in SIZES]
    for _ in range(8):
        models = init.expand(len(SIZES), -1) + 0.01 * torch.randn(len(SIZES), init.numel(), generator=g)
        correct, total, loss = tr.evaluate(models, xs, ys)
        candidates = models[:3]  # IFCA: every client of the cohort gets the same cluster models
        picks = tr.losses_of(candidates, xs, ys)
        for ids in ([4], [1, 4]):  # alone, and beside 50 images
            part = [xs[i] for i in ids], [ys[i] for i in ids]
            c2, t2, l2 = tr.evaluate(models[ids], *part)
            assert torch.equal(c2, correct[ids]) and torch.equal(t2, total[ids]) and torch.equal(l2, loss[ids])
            assert torch.equal(tr.losses_of(candidates, *part), picks[ids])


def test_a_cnn_on_a_cpu_is_evaluated_client_by_client_with_the_padded_passs_figures():
    """`evaluate` takes the unpadded client loop for a CNN on a CPU (IFCA's pick ran 8x
    slower padded on S4's writers): same counts, same losses up to float rounding, and a
    client's figures do not depend on its cohort."""
    torch.manual_seed(0)
    net = build_model("leaf_cnn", (1, 28, 28), 62)
    tr, init = CohortTrainer(net, param_spec(net)), flatten(net)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8) for n in SIZES]
    ys = [torch.randint(0, 62, (n,), generator=g) for n in SIZES]
    models = init.expand(len(SIZES), -1) + 0.05 * torch.randn(len(SIZES), init.numel(), generator=g)
    padded = tr.evaluate(models, xs, ys, chunk=16, vectorize=True)
    loop = tr.evaluate(models, xs, ys, chunk=16, vectorize=False)
    auto = tr.evaluate(models, xs, ys, chunk=16)
    assert all(torch.equal(a, b) for a, b in zip(auto, loop, strict=True))  # auto: the loop here
    assert torch.equal(loop[0], padded[0]) and torch.equal(loop[1], padded[1])
    assert torch.allclose(loop[2], padded[2], atol=1e-5, rtol=0) and bool((loop[2] > 0).all())
    ids = [3, 1]
    alone = tr.evaluate(models[ids], [xs[i] for i in ids], [ys[i] for i in ids], chunk=16)
    assert all(torch.equal(a, b[ids]) for a, b in zip(alone, loop, strict=True))


def test_client_streams_depend_on_seed_and_client_only():
    draw = lambda seed, c: torch.rand(3, generator=client_generator(seed, c))  # noqa: E731
    assert torch.equal(draw(5, 2), draw(5, 2))
    assert not torch.equal(draw(5, 2), draw(5, 3)) and not torch.equal(draw(5, 2), draw(6, 2))


@pytest.mark.slow
def test_one_or_three_device_processes_give_identical_results(tmp_path):
    # three devices host 20 clients unevenly (7, 7, 6); two (an even split) run in test_shift.py
    runs, moved = [], []
    for n in (1, 3):
        out = tmp_path / f"p{n}"
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "flt.emulator.cli",
                "run",
                "scenarios/quickstart.yaml",
                "--set",
                "train.rounds=4",
                "--set",
                "methods=[fedavg, local, {name: flt, encoder: {dataset: public, epochs: 5}}]",
                "--set",
                f"devices.processes={n}",
                "--out",
                str(out),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr
        runs.append(results_without_timing(out))
        lines = (out / "fedavg" / "metrics.jsonl").read_text().splitlines()
        assert all('"timing": {' in line for line in lines)  # wall-clock figures are named as such
        moved.append(json.loads((out / "summary.json").read_text())["timing"]["tasks_off_host"])
    assert runs[0] == runs[1]
    # with more than one device, training tasks ran off their client's host (server/routing.py),
    # and the bytes did not move
    assert moved[0] == 0 and moved[1] > 0


@pytest.mark.slow
def test_a_shorter_run_is_the_first_rounds_of_a_longer_one(tmp_path):
    """The hyper-parameter grids read a T = 50 cell from its T = 100 run's round 50: that
    holds only if no draw and no learning rate depends on T."""
    runs = {}
    for t in (2, 3):
        out = tmp_path / f"t{t}"
        res = subprocess.run(
            [sys.executable, "-m", "flt.emulator.cli", "run", "scenarios/quickstart.yaml",
             "--set", f"train.rounds={t}", "--set", "train.eval_every=1", "--set",
             "methods=[fedavg, {name: flt, encoder: {dataset: public, epochs: 2}}]", "--out", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        runs[t] = results_without_timing(out)
    for method in ("fedavg", "flt"):
        short, long = runs[2][method], runs[3][method][:2]
        assert len(runs[3][method]) == 3
        # bytes included: a method's batch ids (in every header) do not depend on how many
        # exchanges the methods before it took (server/transport.py start_method)
        assert short == long, method


def test_a_clients_fine_tuned_embedding_does_not_depend_on_its_device_mates():
    from flt.devices.embedding import embed_finetuned
    from flt.models.autoencoder import ConvAE

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a device process (see the trainer fixture)
    try:
        torch.manual_seed(0)
        weights = flatten(ConvAE((1, 28, 28), 16)).numpy()
        meta = {"in_shape": [1, 28, 28], "latent": 16, "finetune": {"epochs": 1, "batch_size": 10, "lr": 1e-3}}
        xs, _ = cohort(list(range(len(SIZES))))
        gens = lambda: [client_generator(9, c) for c in range(len(SIZES))]  # noqa: E731
        whole = embed_finetuned(weights, meta, xs, gens())
        alone = embed_finetuned(weights, meta, xs[3:4], gens()[3:4])  # as on a device of its own
    finally:
        torch.set_num_threads(threads)
    assert [e.shape for e in whole] == [(n, 16) for n in SIZES]
    np.testing.assert_array_equal(whole[3], alone[0])  # bit for bit


ENCODER = {"seed": 0, "latent": 8, "channels": 4, "lr": 1e-3, "epochs": 1, "batch_size": 10}


def _pretrain_beside_another(cache: str, barrier, results) -> None:
    """One of two runs pretraining the same encoder into one cache: each waits, once its
    weights are saved, until the other has saved too, so both renames come after both
    saves (the interleaving that lost a run of the GPU's six on 2026-12-04)."""
    import os

    os.environ["FLT_CACHE"] = cache
    from flt.server import encoder

    save = torch.save

    def save_then_wait(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        barrier.wait(timeout=120)

    torch.save = save_then_wait
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 28, 28), dtype=np.uint8)
    try:
        ae, _ = encoder.pretrained_autoencoder(images, ENCODER, torch.device("cpu"))
        results.put(("ok", float(sum(p.abs().sum() for p in ae.parameters()))))
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put(("error", repr(exc)))


def test_two_runs_pretraining_the_same_encoder_at_once_both_get_it(tmp_path):
    """Runs sharing a cache (several `flt compare` at once, as on a GPU) may pretrain one
    encoder together: each must write its own temporary file, and both must end with it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_pretrain_beside_another, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [status for status, _ in got] == ["ok", "ok"], got
    assert got[0][1] == got[1][1]  # the same seed: the same weights
    left = sorted(p.name for p in (tmp_path / "encoders").iterdir())
    assert [name for name in left if name.endswith(".tmp")] == []  # nothing half-written stays
    assert len([name for name in left if name.endswith(".pt")]) == 1


def _encoder_weights(ae) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ae.state_dict().values()]


@pytest.mark.parametrize(
    "file,bytes_",
    [
        (".pt", b""),
        (".pt", b"PK\x03\x04 cut short"),
        (".pt", b"\x80\x04not a state dict"),
        (".json", b'{"final_mse": 0.1'),
        (".json", b"[1, 2]"),
        (".json", b"\xff\xfe"),
    ],
)
def test_a_damaged_encoder_cache_pretrains_again_to_the_same_weights(tmp_path, monkeypatch, caplog, file, bytes_):
    """The cached encoder is only saved work: a damaged weights or facts file is a warning
    naming it, and the encoder pretrained again is the one a clean cache gives."""
    from flt.server import encoder

    monkeypatch.setenv("FLT_CACHE", str(tmp_path))
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 28, 28), dtype=np.uint8)
    clean, report = encoder.pretrained_autoencoder(images, ENCODER, torch.device("cpu"))
    path = Path(report["cache"]).with_suffix(file)
    path.write_bytes(bytes_)
    again, report = encoder.pretrained_autoencoder(images, ENCODER, torch.device("cpu"))
    assert not report["cached"] and f"cache file {path} cannot be read" in caplog.text
    for a, b in zip(_encoder_weights(again), _encoder_weights(clean), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hit, report = encoder.pretrained_autoencoder(images, ENCODER, torch.device("cpu"))
    assert report["cached"] and isinstance(report["final_mse"], float)  # rewritten whole
    assert all(torch.equal(a, b) for a, b in zip(_encoder_weights(hit), _encoder_weights(clean), strict=True))


def test_an_unwritable_encoder_cache_still_gives_the_encoder(tmp_path, monkeypatch, caplog):
    from flt.server import encoder

    (tmp_path / "file").write_text("")  # a folder under a file cannot be made, even by root
    monkeypatch.setenv("FLT_CACHE", str(tmp_path / "file"))
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 28, 28), dtype=np.uint8)
    ae, report = encoder.pretrained_autoencoder(images, ENCODER, torch.device("cpu"))
    assert not report["cached"] and isinstance(report["final_mse"], float)
    assert not ae.training and list((tmp_path / "file").parent.glob("**/*.tmp")) == []
    assert "cannot write the cache file" in caplog.text and str(tmp_path / "file") in caplog.text
