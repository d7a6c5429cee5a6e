"""thinkserve.router: placement policy and Best-of-N aggregation over typed snapshots.

Pure Python: imports neither Ray nor torch, so the simulator and the cluster run the same code.
"""
from .answers import EXTRACTORS, Vote, VoteResult, extract_answer, get_extractor, majority_vote, normalize_answer
from .conductor import (BATCH, INTERACTIVE, STANDARD, BranchProgress, Conductor, ConductorConfig, DecodeCostModel,
                        PrefillCostModel, Promotion, ReasoningEfforts, Refusal, SLOClass)
from .consensus import RULES, Consensus, ConsensusDecision, StoppingRule, Tally, WavePlan, make_rule
from .lengths import LengthDistribution
from .placement import (COLOCATED, DISAGGREGATED, LOCAL_PREFILL, BranchAssignment, LeastLoadedPolicy, Placement,
                        PlacementRequest, spread_branches)
from .predictor import LengthFeatures, LengthPredictor, PredictorConfig, ProgressState, features_for
from .snapshot import ClusterSnapshot, InstanceSnapshot, PoolSnapshot, PrefixIndex

__all__ = [
    "BATCH", "BranchAssignment", "BranchProgress", "COLOCATED", "ClusterSnapshot", "Conductor", "ConductorConfig",
    "Consensus", "ConsensusDecision", "DISAGGREGATED", "DecodeCostModel", "EXTRACTORS", "INTERACTIVE",
    "InstanceSnapshot", "LOCAL_PREFILL", "LeastLoadedPolicy", "LengthDistribution", "LengthFeatures", "LengthPredictor", "Placement",
    "PlacementRequest", "PoolSnapshot", "PredictorConfig", "PrefillCostModel", "PrefixIndex", "ProgressState",
    "Promotion", "RULES", "ReasoningEfforts", "Refusal", "SLOClass", "STANDARD", "StoppingRule", "Tally", "Vote",
    "VoteResult", "WavePlan", "extract_answer", "features_for", "get_extractor", "majority_vote", "make_rule",
    "normalize_answer", "spread_branches",
]
