"""thinkserve.router: placement policy and Best-of-N aggregation over typed snapshots.

Pure Python: imports neither Ray nor torch, so the simulator and the cluster run the same code.
"""
from .answers import Vote, VoteResult, extract_answer, majority_vote, normalize_answer
from .conductor import (BATCH, INTERACTIVE, STANDARD, BranchProgress, Conductor, ConductorConfig, DecodeCostModel,
                        PrefillCostModel, Promotion, ReasoningEfforts, Refusal, SLOClass)
from .lengths import LengthDistribution
from .placement import (COLOCATED, DISAGGREGATED, BranchAssignment, LeastLoadedPolicy, Placement,
                        PlacementRequest, spread_branches)
from .predictor import LengthFeatures, LengthPredictor, PredictorConfig, ProgressState, features_for
from .snapshot import ClusterSnapshot, InstanceSnapshot, PoolSnapshot, PrefixIndex

__all__ = [
    "BATCH", "BranchAssignment", "BranchProgress", "COLOCATED", "ClusterSnapshot", "Conductor", "ConductorConfig",
    "DISAGGREGATED", "DecodeCostModel", "INTERACTIVE", "InstanceSnapshot", "LeastLoadedPolicy",
    "LengthDistribution", "LengthFeatures", "LengthPredictor", "Placement", "PlacementRequest", "PoolSnapshot",
    "PredictorConfig", "PrefillCostModel", "PrefixIndex", "ProgressState", "Promotion", "ReasoningEfforts",
    "Refusal", "SLOClass", "STANDARD", "Vote", "VoteResult", "extract_answer", "features_for", "majority_vote",
    "normalize_answer", "spread_branches",
]
