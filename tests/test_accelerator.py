"""devices.accelerator: device processes train on a GPU when asked and able, and say so
clearly when asked and unable. The CUDA tests run where torch sees a GPU and skip elsewhere."""

import json

import numpy as np
import pytest
import torch
from flt_command import QUICKSTART, flt, flt_run  # tests/ is on sys.path under pytest

from flt.devices.device import accelerator
from flt.devices.seeds import client_generator
from flt.devices.trainer import CohortTrainer, TrainConfig, use_vmap
from flt.models.flat import flatten, param_spec
from flt.models.nets import build_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def test_auto_takes_the_cpu_on_a_host_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert accelerator("auto", "dev-0") == torch.device("cpu")
    assert accelerator("cpu", "dev-0") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="dev-0 has no CUDA GPU"):
        accelerator("cuda", "dev-0")


def test_cuda_is_checked_here_only_for_device_processes_started_here(monkeypatch):
    from flt.common.schema import ConfigError
    from flt.emulator.session import check_local_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    here = {"launcher": "local", "processes": None, "accelerator": "cuda"}
    with pytest.raises(ConfigError, match="this host has no CUDA GPU"):
        check_local_accelerator(here)
    check_local_accelerator({**here, "accelerator": "auto"})
    check_local_accelerator({**here, "processes": 0})  # every device external: its own GPU
    check_local_accelerator({**here, "launcher": "ray"})  # Ray nodes: theirs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_local_accelerator(here)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda is valid here")
def test_flt_relate_asking_for_cuda_without_a_gpu_is_one_line_before_any_folder(tmp_path):
    res = flt("relate", str(QUICKSTART), "--set", "devices.accelerator=cuda", "--no-umap", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and res.stderr.startswith("error: devices.accelerator is cuda, but this host")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: cuda is valid here")
def test_asking_for_cuda_without_a_gpu_fails_naming_the_device(tmp_path):
    res = flt_run(
        str(QUICKSTART),
        str(tmp_path),
        "methods=[fedavg]",
        "train.rounds=1",
        "devices.processes=2",
        "devices.accelerator=cuda",
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr  # one line, before any process
    assert "devices.accelerator is cuda, but this host has no CUDA GPU" in res.stderr and "dev-0" in res.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # and before the run folder


def _cohort(device: str, sizes=(23, 40, 7)):
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 28, 28, generator=g).to(device) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g).to(device) for n in sizes]
    return xs, ys


@cuda
@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, lr=0.05),
        TrainConfig(epochs=2, lr=0.01, prox_mu=0.1),
        TrainConfig(epochs=1, lr=0.001, optimizer="adam"),
        TrainConfig(epochs=2, lr=0.05, vectorize=False),
    ],
)
def test_a_gpu_cohort_trains_as_the_cpu_does(cfg):
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    init = flatten(model)
    results = {}
    for dev in ("cpu", "cuda"):
        trainer = CohortTrainer(build_model("mlp", (1, 28, 28), 10).to(dev), param_spec(model))
        gens = [client_generator(5, c) for c in range(3)]
        trained, loss = trainer.train(init.to(dev).expand(3, -1), *_cohort(dev), cfg, gens)
        assert trained.device.type == dev
        results[dev] = trained.cpu(), loss.cpu()
    # same batches and dropout masks (drawn on the CPU); only float rounding differs
    assert torch.allclose(results["cpu"][0], results["cuda"][0], atol=1e-4)
    assert torch.allclose(results["cpu"][1], results["cuda"][1], atol=1e-4)


@pytest.mark.slow
@cuda
def test_a_run_on_the_gpu_learns_and_says_where_it_trained(tmp_path):
    # compare keeps the scenario's own FLT entry (its longer encoder pretraining)
    res = flt(
        "compare",
        str(QUICKSTART),
        "--methods",
        "fedavg,flt",
        "--set",
        "train.rounds=4",
        "--set",
        "devices.processes=2",
        "--set",
        "devices.accelerator=cuda",
        "--out",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr + res.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["methods"]["flt"]["final_accuracy"] > 50.0
    assert "on cuda" in (tmp_path / "logs" / "dev-0.log").read_text()


def test_auto_vectorize_takes_the_loop_for_cnns_on_a_cpu_and_vmap_elsewhere():
    mlp, cnn = build_model("mlp", (1, 28, 28), 10), build_model("leaf_cnn", (1, 28, 28), 62)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert use_vmap("auto", mlp, cpu) and not use_vmap("auto", cnn, cpu)
    assert use_vmap("auto", cnn, gpu) and use_vmap("auto", mlp, gpu)
    assert use_vmap(True, cnn, cpu) and not use_vmap(False, mlp, gpu)  # an explicit choice stands


def test_a_scenario_accepts_auto_or_a_bool_for_vectorize_and_names_the_field_otherwise():
    from flt.common.schema import ConfigError
    from flt.emulator import config

    for value in ("auto", "true", "false"):
        assert config.load(QUICKSTART, [f"train.vectorize={value}"])["train"]["vectorize"] in ("auto", True, False)
    with pytest.raises(ConfigError, match=r"train\.vectorize"):
        config.load(QUICKSTART, ["train.vectorize=fast"])


@pytest.mark.parametrize("on_gpu", ["accelerator('cuda', 'dev-0')", "aggregation_device()"])
def test_asking_for_a_gpu_asks_torch_for_deterministic_kernels(on_gpu):
    """A GPU run must repeat bit for bit: a device's accelerator('cuda') and the server's
    aggregation device turn cuDNN's kernel search off and its deterministic kernels on (in a
    child process: the flags are global)."""
    import subprocess
    import sys

    probe = (
        "import os, torch\n"
        "from flt.devices.device import accelerator\n"
        "from flt.emulator.session import aggregation_device\n"
        "before = (torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())\n"
        "accelerator('cpu', 'dev-0')\n"
        "cpu = (torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())\n"
        "torch.cuda.is_available = lambda: True\n"
        f"{on_gpu}\n"
        "print(before, cpu, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,\n"
        "      torch.are_deterministic_algorithms_enabled(), os.environ.get('CUBLAS_WORKSPACE_CONFIG'))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(False,", "False)", "(False,", "False)", "True", "False", "True", ":4096:8"]


@cuda
def test_gpu_fine_tuning_repeats_bit_for_bit():
    """Enc2's per-client fine-tuning (transposed convolutions) twice on the GPU: the same bits."""
    from flt.devices.embedding import embed_finetuned
    from flt.models.autoencoder import ConvAE

    accelerator("cuda", "dev-0")
    torch.manual_seed(0)
    weights = flatten(ConvAE((3, 32, 32), 16)).numpy()
    meta = {"in_shape": [3, 32, 32], "latent": 16, "finetune": {"epochs": 2, "batch_size": 10, "lr": 1e-3}}
    g = torch.Generator().manual_seed(1)
    xs = [torch.rand(n, 3, 32, 32, generator=g).cuda() for n in (60, 45, 50)]
    runs = [embed_finetuned(weights, meta, xs, [client_generator(9, c) for c in range(3)]) for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)
