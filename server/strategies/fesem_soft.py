"""FeSEM with soft assignment: multi-center federated learning (Xie, Long, Zhou, Jiang,
Jiang, Zhang, 2020, "Multi-Center Federated Learning", Algorithm 1) whose E-step gives
every returned model a responsibility for every centre instead of one centre.

The paper's stochastic EM is the hard (k-means) limit of EM for a mixture of isotropic
Gaussians in parameter space (Bishop 2006, "Pattern Recognition and Machine Learning",
sections 9.3.2 and 9.4: soft k-means, hard assignment as the variance goes to 0). With
the mixture's E-step, for the models W_m returned this round and the centres W~_k:
    E-step:  r_km = exp(-d_mk / (T * d_bar)) / sum_j exp(-d_mj / (T * d_bar)),
             d_mk = ||W_m - W~_k||_2^2,  d_bar = the mean of d over this round's [s, K]
    M-step:  W~_k = sum_m r_km n_m W_m / sum_m r_km n_m        (server/strategies/base.py:
             cluster_average with soft responsibilities)
T is `temperature`. Dividing by d_bar makes T free of the model's size and of the
training stage (squared parameter distances grow with the number of parameters). As
T -> 0 the responsibilities become one-hot on the nearest centre and the method is
FedSEM exactly (a test); a large T pulls every centre towards the global FedAvg model.

Everything else is FedSEM's (server/strategies/fedsem.py): the k-means++-style seeded
initialisation from the first round's returned models, `reassign_every`, and what a
client receives and is evaluated with: the centre with its largest responsibility (its
hard assignment). Only the E-step is this file's. The device side is FedSEM's too
(train, evaluate): no new client step.

Traffic: one model down and one up per selection, 2*rho*M*W_local*T (as FedSEM).
"""

from __future__ import annotations

import torch

from flt.server.strategies.fedsem import FedSEM
from flt.server.strategies.params import FESEM_SOFT


class FeSEMSoft(FedSEM):
    name = "fesem_soft"
    PARAMS = FESEM_SOFT  # server/strategies/params.py: every method's parameters, torch-free

    def __init__(self, ctx, **params):
        super().__init__(ctx, **params)
        self.temperature = float(self.params["temperature"])
        self.confidence: list[float] = []  # per aggregation: mean largest responsibility

    def responsibilities(self, models: torch.Tensor) -> torch.Tensor:
        """r [K, s]: a softmax over centres of the scaled negative squared distances."""
        d = torch.cdist(models, self.placed()) ** 2  # [s, K]
        scale = d.mean().clamp_min(torch.finfo(d.dtype).tiny)  # all models equal: uniform
        r = torch.softmax(-d / (self.temperature * scale), dim=1)
        self.confidence.append(float(r.max(1).values.mean()))
        return r.T

    def summary(self) -> dict:
        last = self.confidence[-1] if self.confidence else None
        return {**super().summary(), "temperature": self.temperature, "mean_max_responsibility": last}
