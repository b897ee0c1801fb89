"""Bit-reproducible GPU runs: a seed fixes the data, draws and initial weights, but by
default cuDNN may pick a different convolution kernel from run to run, and some of its
kernels (for instance backward passes of transposed convolutions, which the autoencoder's
decoder uses) add with atomics in whatever order the threads finish. Two GPU runs of the
same scenario then fine-tuned Enc2 differently. The CPU kernels are deterministic already.
"""

from __future__ import annotations

import os

import torch


def deterministic_kernels(device: torch.device) -> None:
    """Ask torch for deterministic kernels on `device` (a no-op on the CPU). Call it before
    the process's first CUDA operation: cuBLAS reads its workspace setting once, when it
    starts. An operation that has no deterministic kernel warns instead of failing."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspaces
    torch.backends.cudnn.benchmark = False  # benchmarking picks kernels by timing: a race
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
