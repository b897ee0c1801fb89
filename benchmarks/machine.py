"""What a benchmark ran on: recorded next to every figure it writes."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy
import torch

TORCH_DEFAULT_THREADS = torch.get_num_threads()  # read at import, before a script changes it


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu,
        "os_cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_default_threads": TORCH_DEFAULT_THREADS,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
