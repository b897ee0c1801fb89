"""What a strategy hands the reporting layer: an Artifact (reports/writer.py writes it), so
that strategies stay pure server logic and never touch the disk."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Artifact:
    """Something a strategy found that is worth a file: `arrays` go to NAME.npz in the
    method's folder, and `plot` names the figures the reporter draws from them ("fcr":
    adjacency, dendrogram and centroid scatter, reports/figures.py)."""

    name: str
    arrays: dict[str, np.ndarray]
    plot: str | None = None
