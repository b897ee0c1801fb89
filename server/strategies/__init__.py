"""Registry of federated methods: scenario files and summary.json use these names."""

from server.strategies.cfl import CFL
from server.strategies.fedavg import FedAvg
from server.strategies.fedprox import FedProx
from server.strategies.fedsem import FedSEM
from server.strategies.fesem_soft import FeSEMSoft
from server.strategies.flt import FLT
from server.strategies.ifca import IFCA
from server.strategies.local import Local
from server.strategies.pca_km_hc import PCAKMHC

STRATEGIES = {cls.name: cls for cls in (FedAvg, FedProx, Local, FLT, PCAKMHC, IFCA, FedSEM, FeSEMSoft, CFL)}
