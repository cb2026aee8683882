"""Runtime of a MicroGroupPlan: exact Muon for tensor-parallel matrices (TP-ASC).

See :mod:`canzona_ds.tp.runtime` for the interface and the data layout.
"""
from .runtime import STRATEGIES, StepStats, TPMatrix, TPMuonConfig, TPMuonRuntime
from .verify import verify_same_across_group

__all__ = ["STRATEGIES", "StepStats", "TPMatrix", "TPMuonConfig", "TPMuonRuntime", "verify_same_across_group"]
