"""Registry of federated methods: scenario files and summary.json use these names."""

from flt.server.strategies.cfl import CFL
from flt.server.strategies.fedavg import FedAvg
from flt.server.strategies.fedprox import FedProx
from flt.server.strategies.fedsem import FedSEM
from flt.server.strategies.fesem_soft import FeSEMSoft
from flt.server.strategies.flt import FLT
from flt.server.strategies.ifca import IFCA
from flt.server.strategies.local import Local
from flt.server.strategies.pca_km_hc import PCAKMHC

STRATEGIES = {cls.name: cls for cls in (FedAvg, FedProx, Local, FLT, PCAKMHC, IFCA, FedSEM, FeSEMSoft, CFL)}
