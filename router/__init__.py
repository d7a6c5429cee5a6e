"""thinkserve.router: placement policy and Best-of-N aggregation over typed snapshots.

Pure Python: imports neither Ray nor torch, so the simulator and the cluster run the same code.
"""
from .answers import EXTRACTORS, Vote, VoteResult, extract_answer, get_extractor, majority_vote, normalize_answer
from .consensus import RULES, Consensus, ConsensusDecision, StoppingRule, Tally, WavePlan, make_rule
from .placement import (COLOCATED, DISAGGREGATED, BranchAssignment, LeastLoadedPolicy, Placement,
                        PlacementRequest, spread_branches)
from .snapshot import ClusterSnapshot, InstanceSnapshot, PoolSnapshot

__all__ = [
    "BranchAssignment", "COLOCATED", "ClusterSnapshot", "Consensus", "ConsensusDecision", "DISAGGREGATED",
    "EXTRACTORS", "InstanceSnapshot", "RULES", "StoppingRule", "Tally", "WavePlan", "get_extractor", "make_rule",
    "LeastLoadedPolicy", "Placement", "PlacementRequest", "PoolSnapshot", "Vote", "VoteResult",
    "extract_answer", "majority_vote", "normalize_answer", "spread_branches",
]
